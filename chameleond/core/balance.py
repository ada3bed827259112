"""Layer splits balanced by time and memory: the min-max contiguous partition of a pipeline.

A pipeline of n stages steps, in 1F1B's steady state, once per micro-batch at the pace of its
busiest stage, so the split that matters is the one whose largest stage work (forward + backward,
summed over its layers from the profile) is least, subject to PAPER.md section 5's memory bound
per slot. Layers need not be alike: a large embedding or head takes a stage of its own while the
blocks share the others, which a count-even split cannot do.

The least bottleneck is one of the O(L^2) contiguous range works; a binary search over them
asks, for each threshold T, whether some split meets it. That test is a greedy from the last
stage back, each stage starting as early as T and its memory allow (leaving one layer for every
stage before it). Right to left is exact: stage i stashes activations for min(N_pp - i, N_m)
micro-batches, so a range that fits at stage i fits at every later stage, and a greedy stage that
reaches further left never leaves the stages before it less room than any feasible split does.
"""

from __future__ import annotations

from chameleond.core.estimator import LayerTable


class Balancer:
    """Balanced splits of one job's layers, for any pipeline length, micro-batches and memory."""

    def __init__(self, table: LayerTable) -> None:
        self.table = table
        self.n_layers = table.n_layers
        self._thresholds: list[float] | None = None
        self._splits: dict[tuple[int, int, int], tuple[int, ...] | None] = {}

    def work(self, first: int, end: int) -> float:
        t = self.table
        return t.forward_seconds(first, end) + t.backward_seconds(first, end)

    def thresholds(self) -> list[float]:
        """Every contiguous range's work, sorted: the least bottleneck is one of them."""
        if self._thresholds is None:
            n = self.n_layers
            values = {self.work(a, b) for a in range(n) for b in range(a + 1, n + 1)}
            self._thresholds = sorted(values)
        return self._thresholds

    def split(self, n_stages: int, n_micro: int, memory: int) -> tuple[int, ...] | None:
        """Stage sizes of the memory-feasible split with the least bottleneck stage work (later
        stages as large as the bottleneck allows), or None when no split fits in memory.

        Micro-batches enter only through the stashed activations, min(N_pp - i, N_m) at stage
        i, which are N_pp - i at every stage once N_m >= N_pp: those counts share one split."""
        if not 1 <= n_stages <= self.n_layers:
            return None
        key = (n_stages, min(n_micro, n_stages), memory)
        if key not in self._splits:
            self._splits[key] = self._split(n_stages, key[1], memory)
        return self._splits[key]

    def _split(self, n_stages: int, n_micro: int, memory: int) -> tuple[int, ...] | None:
        values = self.thresholds()
        lo, hi = 0, len(values) - 1
        if self._greedy(values[hi], n_stages, n_micro, memory) is None:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self._greedy(values[mid], n_stages, n_micro, memory) is None:
                lo = mid + 1
            else:
                hi = mid
        return self._greedy(values[lo], n_stages, n_micro, memory)

    def _greedy(
        self, limit: float, n_stages: int, n_micro: int, memory: int
    ) -> tuple[int, ...] | None:
        """A split whose every stage works at most `limit` and fits, built from the last stage
        back with each stage starting as early as it can; None if there is none."""
        t = self.table
        sizes = [0] * n_stages
        end = self.n_layers
        for s in range(n_stages - 1, -1, -1):

            def ok(first: int, s: int = s, end: int = end) -> bool:
                return (
                    self.work(first, end) <= limit
                    and t.stage_memory(first, end, s, n_stages, n_micro) <= memory
                )

            if s == 0:
                if not ok(0):
                    return None
                sizes[0] = end
                break
            # The earliest start in [s, end - 1] that meets both bounds (both only loosen as
            # the start moves right).
            a, b = s, end - 1
            if not ok(b):
                return None
            while a < b:
                mid = (a + b) // 2
                if ok(mid):
                    b = mid
                else:
                    a = mid + 1
            sizes[s] = end - a
            end = a
        return tuple(sizes)
