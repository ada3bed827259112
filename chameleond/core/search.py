"""Algorithm 1 (PAPER.md section 6): the fastest layout shape for a set of survivors.

The space is exactly the paper's. For every allowed pipeline count dp <= M (global micro-batches):
the non-decreasing partitions of the N survivors into dp lengths in [min_stages, max_stages] (and
at most one stage per layer); micro-batches split proportionally to length, m_j = floor(M n_j / N),
a pipeline left with 0 repaired to 1; the remainder r = M - sum m_j goes +1 to r pipelines (every
placement enumerated), or, when the repairs overshot (r < 0), one micro-batch is taken from the
pipeline with the most (longest on ties) until the sum is M; each pipeline's layers split evenly,
enumerating which stages take the leftover layers, or split balanced by time and memory (the
least bottleneck stage work that fits, `core.balance`: uneven layers get uneven stages; beyond the
paper's step 3). Layouts with a slot over memory are dropped; the
objective is the step time: the slowest pipeline's 1F1B longest path plus its gradient sync (a ring
over N / n_j peers for its largest stage; `ShapeModel.sync_seconds`).

The search is exact over that space and fast because the objective is a max over pipelines:

* A pipeline's micro-batches depend only on its own length (m_j above), and its best layer split
  only on (length, micro-batches): `best(n, m)` is memoised, each split timed at most once per
  distinct stage-duration tuple, splits skipped when a cheap lower bound cannot beat the best
  (every split of a length costed at once, with its bounds: `core.splits`).
* A partition is then a count per length class; the remainder goes to the classes whose +1 costs
  least (a prefix of the classes sorted by best(n, m+1)), which is optimal for a max objective.
* Count vectors are enumerated depth-first over classes sorted by best(n, m_n); any vector using a
  class whose time already reaches the incumbent is pruned, as are remainders no class can form.

Homogeneous-device assumption (docs/planner.md): every slot gets the smallest memory among the
survivors, and every stage boundary the slower link when the survivors span hosts. The restorer then
puts real workers into the slots; the plan's own estimate uses their real links.

The objective is exact for layouts of one length and one split. The last step (core.layouttime)
times the optimum as a plan runs it, its sync over the segments between every pipeline's stage
boundaries, beside the best uniform layout of each length, and returns the fastest by that time:
`SearchResult.layout`; the optimum by the objective stays `SearchResult.optimum`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import combinations

from chameleond.core.balance import Balancer
from chameleond.core.estimator import LayerTable, ring_allreduce_seconds, stage_finishes
from chameleond.core.knapsack import knapsack
from chameleond.core.layouttime import Timing, settle, uniform
from chameleond.core.roster import roster
from chameleond.core.spec import JobSpec, LayerProfile, LinkSpec
from chameleond.core.splits import ROUNDING, LayerArrays, SplitCosts, Table

Shape = tuple[tuple[tuple[int, int], ...], ...]  # per pipeline, per stage: (first_layer, end_layer)


Paths = dict[tuple[tuple[float, ...], tuple[float, ...], int], list[float]]


class Shared:
    """What searches over several survivor counts of one job share: longest paths, chain
    bounds, memory checks and layer splits depend on the shapes, the link and the device memory,
    not on the number of survivors."""

    def __init__(self) -> None:
        self.paths: dict[LinkSpec, Paths] = {}
        self.chains: dict[tuple[LinkSpec, tuple[int, ...], int], float] = {}
        self.fits: dict[tuple[int, tuple[int, ...], int], bool] = {}
        self.splits: dict[int, list[tuple[int, ...]]] = {}
        self.candidates: dict[tuple[int, int, int], list[tuple[int, ...]]] = {}
        self.balancer: Balancer | None = None
        self.bounds: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.tables: dict[tuple[int, LinkSpec, int, int], Table] = {}
        self.finishes: dict[tuple[LinkSpec, tuple[int, ...], int], list[float]] = {}
        self.grads: dict[tuple[int, ...], list[int]] = {}
        self.arrays: LayerArrays | None = None
        self.costs: dict[tuple[int, LinkSpec, int, int], SplitCosts] = {}
        # Whole results, by everything a search reads besides the tables (`result_key`).
        self.results: dict[tuple[object, ...], SearchResult] = {}


# The tables of the jobs searched most recently, by what they are computed from: a daemon
# decides many times per job, and no fault changes them. Only the search's own ShapeModel fills
# them (a weakened model for a referee's negative control gets tables of its own).
_TABLES: dict[tuple[tuple[LayerProfile, ...], bool], Shared] = {}
_TABLES_KEPT = 8
# Results kept per job: the prepared ones (core.decide `prepare`) and the latest decisions'.
_RESULTS_KEPT = 32


def job_tables(spec: JobSpec) -> Shared:
    """The shared tables of `spec`'s layers and sync mode, kept across searches."""
    key = (spec.layers, spec.training.overlap_sync)
    found = _TABLES.pop(key, None) or Shared()
    _TABLES[key] = found  # the most recent last
    for old in list(_TABLES)[:-_TABLES_KEPT]:
        _TABLES.pop(old, None)
    return found


def tables_key(spec: JobSpec) -> tuple[object, ...]:
    """What `spec`'s tables are computed from: equal keys, the same tables (`job_tables`, and
    the link each ShapeModel reads them under)."""
    return (spec.layers, spec.training.overlap_sync, spec.intra_host, spec.inter_host)


def forget_tables() -> None:
    """Drop the kept tables: the next search of every job starts cold (benchmarks)."""
    _TABLES.clear()


def forget_results() -> None:
    """Drop the kept results, not the tables: the next search of every job runs, warm."""
    for shared in _TABLES.values():
        shared.results.clear()


@dataclass(frozen=True)
class Layout:
    shape: Shape
    micro_batches: tuple[int, ...]  # N_m per pipeline, same order as shape
    # Algorithm 1's objective: max over pipelines of 1F1B longest path + gradient sync share; for
    # the layout `search` returns, its step as a plan (core.layouttime: the same with one split),
    # but for a job on shared CPU hosts, which keeps the objective's optimum.
    seconds: float


@dataclass(frozen=True)
class SearchResult:
    layout: Layout | None  # None: no layout fits (reason says why)
    plans_considered: int  # partitions scored, each with its best micro-batch placement
    shapes_timed: int  # pipeline shapes whose longest path was computed
    reason: str = ""
    # Algorithm 1's optimum by its objective (what the referees check), before the last step
    # weighs it against the uniform layouts; `layout` is the one the planner takes.
    optimum: Layout | None = None


class ShapeModel:
    """Pipeline times and memory of shapes under the homogeneous-device assumption."""

    def __init__(
        self, spec: JobSpec, survivors: Sequence[str], shared: Shared | None = None
    ) -> None:
        self.spec = spec
        self.table = LayerTable(spec)
        self.n_layers = len(spec.layers)
        workers = roster(spec)
        try:
            self.memory = min(map(workers.memory.__getitem__, survivors))
            spans_hosts = len(set(map(workers.host.__getitem__, survivors))) > 1
        except KeyError:
            unknown = sorted(set(survivors) - set(workers.order))[:5]
            raise KeyError(f"survivors: {unknown} not workers") from None
        self.link = spec.inter_host if spans_hosts else spec.intra_host
        self.n_survivors = len(survivors)
        self._best: dict[tuple[int, int], tuple[float, tuple[int, ...] | None]] = {}
        self._shares: dict[tuple[int, int], float] = {}
        # Longest paths depend on the stage durations, micro-batches and link only: searches over
        # several survivor counts share them.
        self.shared = Shared() if shared is None else shared
        self._timed = self.shared.paths.setdefault(self.link, {})
        self.shapes_timed = 0
        if self.shared.balancer is None:
            self.shared.balancer = Balancer(self.table)
        self.balancer = self.shared.balancer

    def candidates(self, n: int, n_micro: int) -> list[tuple[int, ...]]:
        """The layer splits searched for a pipeline of n stages with n_micro micro-batches: the
        split balanced by time and memory (`core.balance`) first, then every even split."""
        key = (self.memory, n, min(n_micro, n))  # the balanced split's (`Balancer.split`)
        if key not in self.shared.candidates:
            out = list(self.splits(n))
            balanced = self.balancer.split(n, n_micro, self.memory)
            if balanced is not None and balanced not in out:
                out.insert(0, balanced)
            self.shared.candidates[key] = out
        return self.shared.candidates[key]

    def splits(self, n: int) -> list[tuple[int, ...]]:
        """Stage sizes of every even split of the layers over n stages.

        Enumerated with the leftover layers on later stages first, so that ties go there: stage i
        stashes activations for N_pp - i micro-batches, so later stages have room to spare.
        """
        if n in self.shared.splits:
            return self.shared.splits[n]
        q, e = divmod(self.n_layers, n)
        out = []
        for extra in combinations(range(n - 1, -1, -1), e):
            sizes = [q] * n
            for s in extra:
                sizes[s] += 1
            out.append(tuple(sizes))
        self.shared.splits[n] = out
        return out

    def bounds(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """(first_layer, end_layer) per stage; memoised, so callers must not change it."""
        key = tuple(sizes)
        out = self.shared.bounds.get(key)
        if out is None:
            out, a = [], 0
            for k in sizes:
                out.append((a, a + k))
                a += k
            self.shared.bounds[key] = out
        return out

    def fits(self, sizes: Sequence[int], n_micro: int) -> bool:
        key = (self.memory, tuple(sizes), n_micro)
        if key not in self.shared.fits:
            n = len(sizes)
            self.shared.fits[key] = all(
                self.table.stage_memory(a, b, s, n, n_micro) <= self.memory
                for s, (a, b) in enumerate(self.bounds(sizes))
            )
        return self.shared.fits[key]

    def seconds(self, sizes: Sequence[int], n_micro: int) -> float:
        key = (self.link, tuple(sizes), n_micro)
        finishes = self.shared.finishes.get(key)
        if finishes is None:
            t = self.table
            spans = self.bounds(sizes)
            fwd = tuple(t.forward_seconds(a, b) for a, b in spans)
            bwd = tuple(t.backward_seconds(a, b) for a, b in spans)
            timed = (fwd, bwd, n_micro)
            if timed not in self._timed:
                comm = [self.link.transfer_seconds(t.output_bytes(b)) for _, b in spans[:-1]]
                self._timed[timed] = stage_finishes(fwd, bwd, comm, n_micro)
                self.shapes_timed += 1
            finishes = self.shared.finishes[key] = self._timed[timed]
        return self.with_sync(sizes, finishes)

    def with_sync(self, sizes: Sequence[int], finishes: Sequence[float]) -> float:
        """The pipeline's time with its share of the gradient all-reduce: each stage's gradients
        in a ring over N / n_j peers (as many as there would be pipelines of this length), on the
        search's link; after the whole pipeline, or from each stage's own last backward when the
        job overlaps sync with backward. Exact for layouts of one length and split (every stage
        one group, one round)."""
        n = len(sizes)
        if not self.spec.training.overlap_sync:
            return max(finishes) + self._share(n, self._sync_key(sizes))
        grads = self._grads(sizes)
        tails = [f + self._share(n, g) for f, g in zip(finishes, grads, strict=True)]
        return max(*finishes, *tails)

    def sync_seconds(self, sizes: Sequence[int]) -> float:
        """The largest stage's all-reduce: the sync share when it follows the whole pipeline."""
        return self._share(len(sizes), max(self._grads(sizes)))

    def _grads(self, sizes: Sequence[int]) -> list[int]:
        key = tuple(sizes)
        found = self.shared.grads.get(key)
        if found is None:
            t = self.table
            found = self.shared.grads[key] = [t.gradient_bytes(a, b) for a, b in self.bounds(key)]
        return found

    def _share(self, n: int, grad: int) -> float:
        """One all-reduce of `grad` bytes over the N / n peers of a length-n pipeline's stage."""
        key = (n, grad)
        found = self._shares.get(key)
        if found is None:
            found = self._shares[key] = ring_allreduce_seconds(
                self.n_survivors / n, grad, self.link
            )
        return found

    def _sync_key(self, sizes: Sequence[int]) -> int:
        """The gradient bytes the pipeline's lower bound adds a sync for: stage 0's when the sync
        overlaps backward (stage 0 ends last), else the largest stage's."""
        grads = self._grads(sizes)
        return grads[0] if self.spec.training.overlap_sync else max(grads)

    def lower_bound(self, sizes: Sequence[int], n_micro: int) -> float:
        """A chain through the busiest stage k: micro-batch 0 forward to k, all of k's 2 N_m ops,
        the last backward back to stage 0; plus the sync share (`_sync_key`)."""
        return self._chain(sizes, n_micro) + self._share(len(sizes), self._sync_key(sizes))

    def _chain(self, sizes: Sequence[int], n_micro: int) -> float:
        t = self.table
        key = (self.link, tuple(sizes), n_micro)
        best = self.shared.chains.get(key, -1.0)
        if best < 0:
            best, before = 0.0, 0.0
            for a, b in self.bounds(sizes):
                work = t.forward_seconds(a, b) + t.backward_seconds(a, b)
                best = max(best, before + n_micro * work)
                before += work + 2 * self.link.transfer_seconds(t.output_bytes(b))
            self.shared.chains[key] = best
        return best

    def splits_table(self, n: int, n_micro: int) -> Table:
        """The memory-feasible candidates of (n, n_micro), grouped by `_sync_key`, each group
        sorted by chain bound, then candidate index: shared by every survivor count.

        Computed for every candidate at once (thousands of even splits for long pipelines), with
        the same floating-point operations, in the same order, as `_chain` and `fits`."""
        key = (self.memory, self.link, n, n_micro)
        found = self.shared.tables.get(key)
        if found is None:
            costs_key = (self.memory, self.link, n, min(n_micro, n))
            costs = self.shared.costs.get(costs_key)
            if costs is None:
                if self.shared.arrays is None:
                    self.shared.arrays = LayerArrays(self.table)
                costs = self.shared.costs[costs_key] = SplitCosts(
                    self.shared.arrays,
                    self.link,
                    self.candidates(n, n_micro),
                    min(n_micro, n),
                    self.memory,
                    self.spec.training.overlap_sync,
                )
            found = self.shared.tables[key] = costs.table(n_micro)
        return found

    def by_bound(self, n: int, n_micro: int) -> Iterator[tuple[float, float, tuple[int, ...]]]:
        """The memory-feasible candidates as (lower bound, fill bound, sizes), in increasing
        order of (lower bound, candidate index): a merge of the table's groups, each group's sync
        share added to both bounds."""
        cands = self.candidates(n, n_micro)
        groups = [
            (self._share(n, grad), *rows) for grad, rows in self.splits_table(n, n_micro).items()
        ]
        pos = [0] * len(groups)
        while True:
            low = math.inf
            for (share, chains, _, _), p in zip(groups, pos, strict=True):
                if p < len(chains) and chains[p] + share < low:
                    low = chains[p] + share
            if low == math.inf:
                return
            # Every candidate whose bound equals `low` (a prefix of each group), by index.
            run = []
            for g, (share, chains, index, fill) in enumerate(groups):
                p = pos[g]
                while p < len(chains) and chains[p] + share == low:
                    run.append((index[p], fill[p] + share))
                    p += 1
                pos[g] = p
            run.sort()
            for i, tight in run:
                yield low, tight, cands[i]

    def floor(self, n: int, n_micro: int) -> float:
        """A lower bound of best(n, n_micro) without any longest path: the least chain bound over
        the memory-feasible splits (inf when none fits). Classes are ordered and pruned by it, so
        lengths that cannot win are never timed."""
        if (n, n_micro) in self._best:
            return self._best[(n, n_micro)][0]
        table = self.splits_table(n, n_micro)
        return min((c[0] + self._share(n, g) for g, (c, _, _) in table.items()), default=math.inf)

    def best(self, n: int, n_micro: int) -> tuple[float, tuple[int, ...] | None]:
        """Fastest memory-feasible split of a pipeline of n stages with n_micro micro-batches:
        the first, in order of (lower bound, candidate index), of those with the least time."""
        key = (n, n_micro)
        if key in self._best:
            return self._best[key]
        best: tuple[float, tuple[int, ...] | None] = (math.inf, None)
        if n_micro >= 1:
            for lb, tight, sizes in self.by_bound(n, n_micro):
                if lb >= best[0]:
                    break
                if tight > best[0] * (1 + ROUNDING):
                    continue  # slower than the best for certain: timing it would not change it
                t = self.seconds(sizes, n_micro)
                if t < best[0]:
                    best = (t, sizes)
        self._best[key] = best
        return best


def micro_batch_floor(total: int, survivors: int, length: int) -> int:
    """Algorithm 1 step 2 for one pipeline: proportional floor, at least one."""
    return max(total * length // survivors, 1)


def allowed_lengths(spec: JobSpec, n_surv: int) -> range:
    """The pipeline lengths a layout of `n_surv` survivors may have: within the search's
    [min_stages, max_stages], at most one stage per layer and per survivor."""
    lo = max(spec.search.min_stages, 1)
    return range(lo, min(spec.search.max_stages, len(spec.layers), n_surv) + 1)


def spare_counts(spec: JobSpec, n_surv: int) -> list[int]:
    """How many survivors a layout may use: all of them, or fewer, leaving the rest idle as
    spares, where pipelines of one allowed length use more of them than any layout of all:
    n x floor(N / n) for each allowed length n, within one pipeline's length of N. Jobs whose
    workers share CPU hosts (`spec.hosts`), or whose `[search] spares` is false, use all of them."""
    out = {n_surv}
    if not spec.search.spares:
        return [n_surv]
    if spec.hosts:
        # Workers sharing a host's cores: the search's objective (the critical path) is not
        # their step (docs/planner.md, shared host), so it cannot tell when idling one pays.
        return [n_surv]
    lengths = allowed_lengths(spec, n_surv)
    for n in lengths:
        used = n * (n_surv // n)
        if used and n_surv - used < lengths[-1]:
            out.add(used)
    return sorted(out, reverse=True)


def search(
    spec: JobSpec, survivors: Sequence[str], shape_model: type[ShapeModel] = ShapeModel
) -> SearchResult:
    """The fastest layout shape over the survivors (workers are assigned later by the restorer).

    A layout may leave a few survivors idle (`spare_counts`): with B fixed, fewer devices in a
    better-balanced layout can step faster than all of them (31 survivors of an 8 x 4 job: 7 x 4
    and 3 spares beats any partition of 31). Each count is searched exactly; the fastest wins,
    all survivors on ties. Which survivors stay idle is the caller's choice (core.decide).
    `shape_model` is for referees' negative controls (a deliberately weakened model must show a
    gap against the exact search, bench/exact.py).

    The result holds shapes, not workers: a search of survivors alike by `result_key` (as many,
    the same least memory, spanning hosts alike) returns the kept result, nothing timed."""
    if shape_model is not ShapeModel:
        return _search(spec, survivors, Shared(), shape_model)
    shared = job_tables(spec)
    key = result_key(spec, survivors)
    found = shared.results.pop(key, None)
    if found is None:
        found = _search(spec, survivors, shared, shape_model)
    else:
        found = replace(found, shapes_timed=0)
    shared.results[key] = found  # the most recent last
    for old in list(shared.results)[:-_RESULTS_KEPT]:
        del shared.results[old]
    return found


def result_key(spec: JobSpec, survivors: Sequence[str]) -> tuple[object, ...]:
    """Everything a search of `survivors` reads besides its tables' key: the links, the
    micro-batches, the search's bounds, and for each survivor count it searches (`spare_counts`)
    the least memory and whether those survivors span hosts (`ShapeModel`)."""
    workers = roster(spec)
    counts = []
    try:
        for used in spare_counts(spec, len(survivors)):
            those = survivors[:used]
            memory = min(map(workers.memory.__getitem__, those), default=0)
            spans = len(set(map(workers.host.__getitem__, those))) > 1
            counts.append((used, memory, spans))
    except KeyError:
        unknown = sorted(set(survivors) - set(workers.order))[:5]
        raise KeyError(f"survivors: {unknown} not workers") from None
    s = spec.search
    return (
        spec.intra_host, spec.inter_host, spec.training.micro_batches, s.min_stages,
        s.max_stages, s.spares, bool(spec.hosts), tuple(counts),
    )  # fmt: skip


def _search(
    spec: JobSpec, survivors: Sequence[str], shared: Shared, shape_model: type[ShapeModel]
) -> SearchResult:
    best: SearchResult | None = None
    considered = timed = 0
    for used in spare_counts(spec, len(survivors)):
        found = _search_all(spec, survivors[:used], shared, shape_model)
        considered += found.plans_considered
        timed += found.shapes_timed
        if (
            found.layout is not None
            and (best is None or best.layout is None or found.layout.seconds < best.layout.seconds)
        ) or best is None:
            best = found
    assert best is not None
    if best.layout is None:
        return SearchResult(None, considered, timed, best.reason)
    layout = _settled(spec, survivors, shared, shape_model, best.layout)
    return SearchResult(layout, considered, timed, optimum=best.layout)


def _settled(
    spec: JobSpec,
    survivors: Sequence[str],
    shared: Shared,
    shape_model: type[ShapeModel],
    layout: Layout,
) -> Layout:
    """The search's layout, or a uniform one that steps faster as a plan (core.layouttime), with
    its time as a plan (`Layout.seconds`). Jobs whose workers share CPU hosts keep the search's:
    their step is the hosts' cores shared among the workers, not the critical path this times
    (as for spares, `spare_counts`)."""
    if spec.hosts:
        return layout
    model = shape_model(spec, survivors, shared)
    timing = Timing(model.table, model.link, spec.training.overlap_sync)
    n = len(survivors)
    alternatives = uniform(
        model.best, n, spec.training.micro_batches, allowed_lengths(spec, n), spare_counts(spec, n)
    )
    shape, micro, seconds = settle(timing, layout.shape, layout.micro_batches, alternatives)
    return Layout(shape, micro, seconds)


def _search_all(
    spec: JobSpec,
    survivors: Sequence[str],
    shared: Shared | None = None,
    shape_model: type[ShapeModel] = ShapeModel,
) -> SearchResult:
    """Algorithm 1 over exactly these survivors, every one of them in the layout."""
    n_surv, total = len(survivors), spec.training.micro_batches
    if n_surv == 0:
        return SearchResult(None, 0, 0, "no surviving workers")
    model = shape_model(spec, survivors, shared)
    lengths = allowed_lengths(spec, n_surv)
    # When a length's proportional share floors to 0, the repairs can overshoot and other
    # pipelines then lose a micro-batch: a class's bound must allow for that.
    overshoot = any(total * n < n_surv for n in lengths)
    classes = []  # (lower bound of the class's pipeline time, length, m_n)
    for n in lengths:
        m = micro_batch_floor(total, n_surv, n)
        t = model.floor(n, m - 1 if overshoot and m > 1 else m)
        if t < math.inf:
            classes.append((t, n, m))
    classes.sort()
    if not classes:
        return SearchResult(None, 0, model.shapes_timed, _why_none(spec, model, lengths))

    if not overshoot:
        found = _search_by_threshold(model, classes, n_surv, total)
        if found is not None:
            return found
    return _search_depth_first(model, classes, n_surv, total)


def _search_by_threshold(
    model: ShapeModel, classes: Sequence[tuple[float, int, int]], n_surv: int, total: int
) -> SearchResult | None:
    """The smallest time threshold some partition meets, probing the classes' exact times in
    increasing order; each probe is a knapsack over stage sums. None: fall back to depth-first.

    With no repairs, the remainder of a partition is r = sum_j (M n_j / N - m_j), a sum of
    per-pipeline surpluses. A partition meets threshold T iff it uses only lengths with
    best(n, m_n) <= T, and the lengths whose +1 also meets T (set P) have room for r:
    sum_j surplus_j - #{j in P} <= 0. Minimising that left side over partitions is an unbounded
    knapsack on the stage sum with integer weights (surpluses scaled by N).
    """
    # Candidate thresholds in increasing order, lazily: a class's exact time is computed only
    # when its lower bound comes up, so lengths that cannot win are never timed.
    exact: list[list[float | None]] = [[None, None] for _ in classes]
    heap: list[tuple[float, bool, int, int]] = []
    for i, (floor0, n, m) in enumerate(classes):
        heap.append((floor0, False, i, 0))
        heap.append((model.floor(n, m + 1), False, i, 1))
    heapq.heapify(heap)
    states = 0

    def probe(limit: float) -> list[int] | None:
        nonlocal states
        items = []
        for (_, n, m), (t0, t1) in zip(classes, exact, strict=True):
            if t0 is not None and t0 <= limit:
                room = n_surv if t1 is not None and t1 <= limit else 0
                items.append((n, total * n - n_surv * m - room))
        states += len(items) * n_surv
        counts = knapsack(items, n_surv)
        if counts is None:
            return None
        return [counts.get(n, 0) for _, n, _ in classes]

    found = None
    while heap and found is None:
        value, is_exact, i, which = heapq.heappop(heap)
        if value == math.inf:
            break
        if not is_exact:
            n, m = classes[i][1], classes[i][2] + which
            heapq.heappush(heap, (model.best(n, m)[0], True, i, which))
            continue
        exact[i][which] = value
        # Every class whose time could be <= value is known once nothing <= value is pending.
        if heap and heap[0][0] <= value:
            continue
        found = probe(value)
    if found is None or sum(found) > total:
        return None  # no partition, or one with more pipelines than micro-batches: search it all
    layout = _layout(model, _placement(model, classes, found, total))
    if layout is None:
        return None
    return SearchResult(layout, states, model.shapes_timed)


def _search_depth_first(
    model: ShapeModel, classes: Sequence[tuple[float, int, int]], n_surv: int, total: int
) -> SearchResult:
    """Count vectors over the classes, depth first, pruned by the classes' lower bounds."""
    # fewest[i][x]: fewest pipelines of classes i.. that sum to x stages (inf: impossible).
    k = len(classes)
    fewest = [[math.inf] * (n_surv + 1) for _ in range(k + 1)]
    fewest[k][0] = 0
    for i in range(k - 1, -1, -1):
        n, row, nxt = classes[i][1], fewest[i], fewest[i + 1]
        for x in range(n_surv + 1):
            row[x] = min(nxt[x], row[x - n] + 1) if x >= n else nxt[x]

    best_t = math.inf
    best_counts: list[int] | None = None
    scored = 0
    counts = [0] * k

    def visit(i: int, left: int, used: int, bound: float) -> None:
        nonlocal best_t, best_counts, scored
        if left == 0:
            scored += 1
            t = _seconds(model, _placement(model, classes, counts, total))
            if t < best_t:
                best_t, best_counts = t, list(counts)
            return
        if i == k or fewest[i][left] > total - used or bound >= best_t:
            return
        t_i, n = classes[i][0], classes[i][1]
        if max(bound, t_i) < best_t:
            for c in range(min(left // n, total - used), 0, -1):
                counts[i] = c
                visit(i + 1, left - c * n, used + c, max(bound, t_i))
                if max(bound, t_i) >= best_t:
                    break
            counts[i] = 0
        visit(i + 1, left, used, bound)

    visit(0, n_surv, 0, 0.0)
    layout = None
    if best_counts is not None:
        layout = _layout(model, _placement(model, classes, best_counts, total))
    if layout is None:
        reason = f"no partition of {n_surv} survivors into memory-feasible pipelines"
        return SearchResult(None, scored, model.shapes_timed, reason)
    return SearchResult(layout, scored, model.shapes_timed)


Groups = dict[tuple[int, int], int]  # (length, micro-batches) -> number of pipelines


def _placement(
    model: ShapeModel, classes: Sequence[tuple[float, int, int]], counts: Sequence[int], total: int
) -> Groups:
    """The best micro-batch placement for one partition (counts per class)."""
    used = [(n, m, c) for (_, n, m), c in zip(classes, counts, strict=True) if c]
    r = total - sum(m * c for _, m, c in used)
    groups: Groups = {}
    if r < 0:
        for n, m, c in used:
            groups[(n, m)] = groups.get((n, m), 0) + c
        return _take_from_largest(groups, -r)
    # +1 to the classes where it costs least: optimal for a max over pipelines.
    for n, m, c in sorted(used, key=lambda u: (model.best(u[0], u[1] + 1)[0], u[0])):
        extra = min(c, r)
        r -= extra
        if extra:
            groups[(n, m + 1)] = groups.get((n, m + 1), 0) + extra
        if c - extra:
            groups[(n, m)] = groups.get((n, m), 0) + c - extra
    return groups


def _seconds(model: ShapeModel, groups: Groups) -> float:
    return max(model.best(n, m)[0] for n, m in groups)


def _layout(model: ShapeModel, groups: Groups) -> Layout | None:
    worst = _seconds(model, groups)
    if worst == math.inf:
        return None
    shape: list[tuple[tuple[int, int], ...]] = []
    micro: list[int] = []
    for n, m in sorted(groups):
        sizes = model.best(n, m)[1]
        assert sizes is not None
        stages = tuple(model.bounds(sizes))
        shape.extend([stages] * groups[(n, m)])
        micro.extend([m] * groups[(n, m)])
    return Layout(tuple(shape), tuple(micro), worst)


def _take_from_largest(
    groups: dict[tuple[int, int], int], excess: int
) -> dict[tuple[int, int], int]:
    """Repairs overshot the total: take one micro-batch at a time from the pipeline with the most
    (the longest on ties), as Algorithm 1's repair step does."""
    groups = dict(groups)
    while excess:
        n, m = max(groups, key=lambda nm: (nm[1], nm[0]))
        moved = min(groups[(n, m)], excess)
        groups[(n, m)] -= moved
        if not groups[(n, m)]:
            del groups[(n, m)]
        groups[(n, m - 1)] = groups.get((n, m - 1), 0) + moved
        excess -= moved
    return groups


def _why_none(spec: JobSpec, model: ShapeModel, lengths: range) -> str:
    lo, hi = lengths.start, lengths.stop - 1
    if lo > hi:
        return f"no allowed pipeline length (min_stages {lo}, at most {hi} stages possible)"
    return (
        f"every pipeline length {lo}-{hi} is out of memory "
        f"({model.memory} bytes per worker, smallest among the survivors)"
    )
