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
With a limit per stage (`split_at_speeds`, the re-partition around a slow worker:
core.speedsplit; a slow worker's stage meets the bottleneck T when its work over its speed does)
the greedy is not exact, and the test is a pass over the boundaries each stage can reach.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from chameleond.core.estimator import LayerTable

# Whether stage s over layers [first, end) meets a bottleneck limit (and fits in memory).
Fits = Callable[[float, int, int, int], bool]
# A split of n stages whose every stage meets a limit, or None.
Meets = Callable[[float, int, Fits], "tuple[int, ...] | None"]


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
        def ok(limit: float, s: int, first: int, end: int) -> bool:
            return (
                self.work(first, end) <= limit
                and self.table.stage_memory(first, end, s, n_stages, n_micro) <= memory
            )

        return self._least(self.thresholds(), n_stages, ok)

    def split_at_speeds(
        self, speeds: Sequence[float], n_micro: int, memories: Sequence[int]
    ) -> tuple[int, ...] | None:
        """Stage sizes of the memory-feasible split whose slowest stage (its work over its
        worker's speed, stage i's worker at `speeds[i]` with `memories[i]` bytes) is least: a
        slow worker's stage gets fewer layers. None when no split fits."""
        n_stages = len(speeds)
        if not 1 <= n_stages <= self.n_layers:
            return None
        n_micro = min(n_micro, n_stages)
        base = self.thresholds()
        values = sorted({w / v for v in set(speeds) for w in base})

        def ok(limit: float, s: int, first: int, end: int) -> bool:
            return (
                self.work(first, end) / speeds[s] <= limit
                and self.table.stage_memory(first, end, s, n_stages, n_micro) <= memories[s]
            )

        return self._least(values, n_stages, ok, self._reachable)

    def _least(
        self, values: Sequence[float], n_stages: int, ok: Fits, meets: Meets | None = None
    ) -> tuple[int, ...] | None:
        """The split at the least of the sorted `values` that some split meets (found by
        `meets`, the greedy by default)."""
        test = self._greedy if meets is None else meets
        lo, hi = 0, len(values) - 1
        if test(values[hi], n_stages, ok) is None:
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if test(values[mid], n_stages, ok) is None:
                lo = mid + 1
            else:
                hi = mid
        return test(values[lo], n_stages, ok)

    def _reachable(self, limit: float, n_stages: int, ok: Fits) -> tuple[int, ...] | None:
        """A split whose every stage meets `ok` at `limit`, for limits that differ by stage,
        where the greedy is not exact (a later stage taken as large as it can be may leave a
        slower stage before it only ranges too large for it). Forward: the boundaries each
        stage can end at (for a start, the ends that meet `ok` are an interval, both bounds
        only tightening as the end moves right); back: each stage starting as early as it can
        among the boundaries the stages before it reach. None if there is none."""
        n = self.n_layers
        reach: list[list[int]] = [[0]]
        for s in range(n_stages):
            last = n - (n_stages - s - 1)  # one layer left for each stage after it
            ends: set[int] = set()
            for p in reach[s]:
                if p + 1 > last or not ok(limit, s, p, p + 1):
                    continue
                a, b = p + 1, last
                while a < b:
                    mid = (a + b + 1) // 2
                    if ok(limit, s, p, mid):
                        a = mid
                    else:
                        b = mid - 1
                ends.update(range(p + 1, a + 1))
            reach.append(sorted(ends))
        if n not in reach[n_stages]:
            return None
        sizes = [0] * n_stages
        end = n
        for s in range(n_stages - 1, -1, -1):
            start = next(p for p in reach[s] if p < end and ok(limit, s, p, end))
            sizes[s] = end - start
            end = start
        return tuple(sizes)

    def _greedy(self, limit: float, n_stages: int, ok: Fits) -> tuple[int, ...] | None:
        """A split whose every stage meets `ok` at `limit` (its work bound and its memory),
        built from the last stage back with each stage starting as early as it can; None if
        there is none."""
        sizes = [0] * n_stages
        end = self.n_layers
        for s in range(n_stages - 1, -1, -1):
            if s == 0:
                if not ok(limit, 0, 0, end):
                    return None
                sizes[0] = end
                break
            # The earliest start in [s, end - 1] that meets both bounds (both only loosen as
            # the start moves right).
            a, b = s, end - 1
            if not ok(limit, s, b, end):
                return None
            while a < b:
                mid = (a + b) // 2
                if ok(limit, s, mid, end):
                    b = mid
                else:
                    a = mid + 1
            sizes[s] = end - a
            end = a
        return tuple(sizes)
