"""Every candidate layer split of a pipeline length costed at once, as arrays: what the search
(`core.search`) orders and prunes its splits by.

For a length n and micro-batches m, each split (a row) gets its memory check (PAPER.md section 5,
min(n - i, m) stashed activations at stage i), the gradient bytes its sync share depends on, and
two lower bounds of its 1F1B longest path:

* the chain bound, max over stages k of sum_{s<k}(f_s + b_s + 2 c_s) + m (f_k + b_k): micro-batch
  0 forward to k, all of k's ops, the last backward back; computed with the same floating-point
  operations, in the same order, as `ShapeModel._chain`, because the search's choice among
  equally fast splits follows its order;
* the fill bound, which also counts stage k's fill bubble (below); used only to skip timing a
  split that cannot be the fastest, with a relative slack for rounding (`ROUNDING`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from chameleond.core.estimator import LayerTable
from chameleond.core.spec import LinkSpec

# The memory-feasible splits of one (length, micro-batches) class, grouped by the gradient bytes
# their sync share depends on; each group as its chain bounds and the splits' indices among the
# candidates, sorted by (chain, index). The sync share is one number per group, so the splits'
# order by lower bound is a merge of the groups, and the least bound a min over them, without a
# pass over every split.
# Each split also carries a tighter bound, the fill bound, used only to skip timing it.
Table = dict[int, tuple[list[float], list[int], list[float]]]


class LayerArrays:
    """LayerTable's prefix sums as arrays, to cost every split of a length at once."""

    def __init__(self, table: LayerTable) -> None:
        ends = range(table.n_layers + 1)
        self.fwd = np.array([table.forward_seconds(0, e) for e in ends], dtype=np.float64)
        self.bwd = np.array([table.backward_seconds(0, e) for e in ends], dtype=np.float64)
        self.state = np.array([table.state_bytes(0, e) for e in ends], dtype=np.int64)
        self.act = np.array([table.activation_bytes(0, e) for e in ends], dtype=np.int64)
        self.grad = np.array([table.gradient_bytes(0, e) for e in ends], dtype=np.int64)
        self._table = table
        self._transfer: dict[LinkSpec, npt.NDArray[np.float64]] = {}

    def transfer(self, link: LinkSpec) -> npt.NDArray[np.float64]:
        """Per stage end e (e >= 1): seconds on the wire of the output of layer e - 1."""
        found = self._transfer.get(link)
        if found is None:
            t = self._table
            ends = range(1, t.n_layers + 1)
            found = np.array([0.0, *(link.transfer_seconds(t.output_bytes(e)) for e in ends)])
            self._transfer[link] = found
        return found


class SplitCosts:
    """A length's candidate splits as arrays (one row per split, one column per stage): what
    does not depend on the micro-batches, or only through min(N_m, N_pp) (the memory check), so
    that each micro-batch count's table is a few array operations."""

    def __init__(
        self,
        arrays: LayerArrays,
        link: LinkSpec,
        cands: Sequence[tuple[int, ...]],
        in_flight: int,
        memory: int,
        overlap_sync: bool,
    ) -> None:
        n = len(cands[0])
        sizes = np.array(cands, dtype=np.int64).reshape(len(cands), n)
        ends = np.cumsum(sizes, axis=1)
        starts = ends - sizes
        self.n = n
        self.f = arrays.fwd[ends] - arrays.fwd[starts]
        self.b = arrays.bwd[ends] - arrays.bwd[starts]
        self.work = self.f + self.b
        c = arrays.transfer(link)[ends]
        # The chain bound's prefix: sum_{s < k} (work_s + 2 c_s), as `ShapeModel._chain` sums it.
        self.before = np.zeros_like(self.work)
        np.cumsum((self.work + 2 * c)[:, :-1], axis=1, out=self.before[:, 1:])
        # The fill bound's part without N_m (`table`): micro-batch 0 forward through every stage
        # (sum f + sum c) and back up to k (sum_{s > k} b_s + sum_{s >= k} c_s), and the last
        # micro-batch's way down from k (sum_{s < k} (b_s + c_s)).
        c[:, -1] = 0.0  # the last stage sends nothing on
        down = self.f.sum(axis=1) + c.sum(axis=1)
        b_after = np.cumsum(self.b[:, ::-1], axis=1)[:, ::-1] - self.b
        c_from = np.cumsum(c[:, ::-1], axis=1)[:, ::-1]
        below = np.cumsum(self.b + c, axis=1) - (self.b + c)
        self.fixed = down[:, None] + b_after + c_from + below
        stashed = np.minimum(n - np.arange(n), in_flight)
        held = (arrays.state[ends] - arrays.state[starts]) + stashed * (
            arrays.act[ends] - arrays.act[starts]
        )
        fits = np.all(held <= memory, axis=1)
        grads = arrays.grad[ends] - arrays.grad[starts]
        sync_key = grads[:, 0] if overlap_sync else np.max(grads, axis=1)
        self.groups = [
            (int(g), np.flatnonzero(fits & (sync_key == g)))
            for g in np.unique(sync_key[fits]).tolist()
        ]

    def table(self, n_micro: int) -> Table:
        """Per sync group: chain bounds, candidate indices and fill bounds, sorted by (chain,
        index). The fill bound, per stage k: micro-batch 0 forward through every stage and back
        to k, then the ops of k's 1F1B queue from B(k, 0) on (all N_m backwards, and the
        forwards after its min(N_pp - k - 1, N_m) warm-up ones and the one before B(k, 0)),
        then the last backward down to stage 0: each a chain of the dependency graph."""
        chain = np.max(self.before + n_micro * self.work, axis=1)
        warm = np.minimum(self.n - 1 - np.arange(self.n), n_micro)
        after = np.maximum(n_micro - warm - 1, 0)
        fill = np.max(self.fixed + n_micro * self.b + after * self.f, axis=1)
        fill = np.maximum(chain, fill)
        found = {}
        for g, index in self.groups:
            ordered = index[np.argsort(chain[index], kind="stable")]
            found[g] = (chain[ordered].tolist(), ordered.tolist(), fill[ordered].tolist())
        return found


# Relative slack for bounds computed by another summation order than the longest path's.
ROUNDING = 1e-9
