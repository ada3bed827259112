"""The restorer: who takes which slot of a new plan, what state moves, in which rounds, how long.

PAPER.md section 7, documented with the reasons for each choice in docs/restorer.md.

1. Assignment. Rows are the survivors, columns the slots (pipeline, stage) of the new shape; the
   cost of survivor -> slot is the bytes of parameters + optimizer state of the slot's layers that
   the survivor does not already hold. A minimum-cost perfect matching minimises what must move.
2. Migration manifest. Each missing layer is sent once, from a surviving replica, choosing sources
   so that no one source becomes the bottleneck; transfers are coalesced per (source, destination).
   Sources keep their old state until every receiver acknowledges (a worker-runtime rule: a
   transition that is cut short by another fault can then still be planned from the old holdings).
3. Rounds. Transfers that share a worker conflict; a colouring gives the rounds (DSATUR, or the
   weight-aware first-fit-decreasing when that is shorter), and the migration time is the sum over
   rounds of the slowest transfer in the round.

Gradient sync groups (`sync_groups`) are the same colouring applied to all-reduce owner groups.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np
import numpy.typing as npt
from scipy.optimize import linear_sum_assignment

from chameleond.core.colouring import dsatur, weighted_rounds
from chameleond.core.holdings import Held, Interval, of_plan
from chameleond.core.plan import Pipeline, Plan, Stage, SyncGroup, Transfer
from chameleond.core.roster import roster
from chameleond.core.spec import JobSpec, LinkSpec


class RestoreError(ValueError):
    """The inputs do not describe a restorable plan (bad shape, micro-batches or survivors)."""


class LostLayers(Exception):
    """Some layers have no surviving replica: backup-free recovery is impossible."""

    def __init__(self, layers: Iterable[int]) -> None:
        self.layers = tuple(sorted(set(layers)))
        super().__init__(f"layers {layer_ranges(self.layers)} lost every replica")


def layer_ranges(layers: Iterable[int]) -> str:
    """'0-3, 7, 9-10': layer ids written as inclusive runs, for people."""
    out: list[str] = []
    ids = sorted(set(layers))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ", ".join(out)


@dataclass(frozen=True)
class Restoration:
    pipelines: tuple[Pipeline, ...]  # the new shape with a worker in every slot
    migration: tuple[Transfer, ...]  # ordered by round, then destination, then source
    migration_seconds: float  # sum over rounds of the slowest transfer of the round
    moved_bytes: int  # the matching's optimum: total bytes sent


def min_cost_assignment(
    cost: npt.ArrayLike,
) -> tuple[tuple[tuple[int, int], ...], float]:
    """Minimum-cost perfect matching of a square cost matrix: ((row, column) pairs, total cost).

    scipy's linear_sum_assignment (shortest augmenting path, Jonker-Volgenant style, in C). It is
    deterministic for a given matrix, so a fixed row and column order gives a fixed answer.
    """
    m = np.asarray(cost)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise RestoreError(f"cost matrix must be square, got shape {m.shape}")
    if m.size and not np.isfinite(m).all():
        raise RestoreError("cost matrix has a non-finite entry")
    rows, cols = linear_sum_assignment(m)
    pairs = tuple((int(r), int(c)) for r, c in zip(rows, cols, strict=True))
    return pairs, float(m[rows, cols].sum())


def _check_shape(
    shape: Sequence[Sequence[tuple[int, int]]], micro_batches: Sequence[int], spec: JobSpec
) -> None:
    n_layers = len(spec.layers)
    if not shape:
        raise RestoreError("shape: at least one pipeline is required")
    if len(micro_batches) != len(shape):
        raise RestoreError(
            f"micro_batches: {len(micro_batches)} entries for {len(shape)} pipelines"
        )
    for p, stages in enumerate(shape):
        edge = 0
        for s, (a, b) in enumerate(stages):
            if a != edge or b <= a:
                raise RestoreError(
                    f"shape[{p}][{s}] = ({a}, {b}): stages must be non-empty and contiguous"
                )
            edge = b
        if edge != n_layers:
            raise RestoreError(f"shape[{p}]: stages cover layers 0-{edge - 1} of 0-{n_layers - 1}")
    if any(m <= 0 for m in micro_batches):
        raise RestoreError("micro_batches: every pipeline needs at least one micro-batch")
    if sum(micro_batches) != spec.training.micro_batches:
        raise RestoreError(
            f"micro_batches: sum {sum(micro_batches)} != {spec.training.micro_batches} per step"
        )


def assign(
    spec: JobSpec,
    current: Plan,
    shape: Sequence[Sequence[tuple[int, int]]],
    micro_batches: Sequence[int],
    survivors: Sequence[str],
    held: Held | None = None,
) -> Restoration:
    """Put the survivors into the slots of `shape` moving the fewest bytes; plan the migration.
    With more survivors than slots, the matching also chooses which stay idle (spares).

    `held`: what each worker holds (core.holdings); by default what `current` gives it. Raises
    `RestoreError` on inconsistent input and `LostLayers` when some layer has no surviving replica
    (the caller turns that into the unrecoverable result).
    """
    _check_shape(shape, micro_batches, spec)
    order = roster(spec).order
    unknown = [w for w in survivors if w not in order]
    if unknown:
        raise RestoreError(f"survivors: {', '.join(map(str, unknown[:5]))} not workers of the job")
    if len(set(survivors)) != len(survivors):
        raise RestoreError("survivors: a worker is listed twice")
    slots = [(p, s, a, b) for p, stages in enumerate(shape) for s, (a, b) in enumerate(stages)]
    if len(survivors) < len(slots):
        raise RestoreError(f"{len(survivors)} survivors for {len(slots)} slots")
    n_slots = len(slots)
    # Survivors beyond the slots stay idle as spares: zero-cost idle slots (no layers) let the
    # matching choose them, and they remain sources of what they hold.
    slots += [(-1, -1, 0, 0)] * (len(survivors) - n_slots)

    # Rows in the job's worker order, columns in (pipeline, stage) order: the matrix, and so the
    # matching, does not depend on the order the caller listed the survivors in.
    rows = sorted(survivors, key=order.__getitem__)
    have = _held_by(rows, of_plan(current) if held is None else held)
    layer_bytes = _layer_bytes(spec)
    replicas = _replicas(have, layer_bytes)
    matched = match_slots(rows, have, slots, layer_bytes)
    owner = {j: rows[r] for j, r in enumerate(matched[:n_slots])}

    pipelines: list[Pipeline] = []
    first_mb, j = 0, 0
    for p, stages in enumerate(shape):
        out = []
        for a, b in stages:
            out.append(Stage(owner[j], a, b))
            j += 1
        pipelines.append(Pipeline(tuple(out), first_mb, micro_batches[p]))
        first_mb += micro_batches[p]

    migration, seconds = _migration(spec, pipelines, have, replicas, layer_bytes)
    return Restoration(tuple(pipelines), migration, seconds, sum(t.nbytes for t in migration))


def repairs(
    spec: JobSpec, pipelines: Sequence[Pipeline], workers: Collection[str], held: Held
) -> tuple[tuple[Transfer, ...], float]:
    """The migration that gives each of `workers` the layers of its stages in `pipelines` that it
    does not hold yet (a layout kept while its last transition was cut short), and its seconds.
    Raises `LostLayers` when some layer has no holder among `workers`."""
    ws = set(workers)
    if _nothing_missing(spec, pipelines, ws, held):
        return (), 0.0
    running = [
        Pipeline(tuple(st for st in p.stages if st.worker in ws), p.first_micro_batch,
                 p.micro_batches)
        for p in pipelines
    ]  # fmt: skip
    kept = _held_by(sorted(ws), held)
    layer_bytes = _layer_bytes(spec)
    return _migration(spec, running, kept, _replicas(kept, layer_bytes), layer_bytes)


def _nothing_missing(
    spec: JobSpec, pipelines: Sequence[Pipeline], workers: Collection[str], held: Held
) -> bool:
    """Each of `workers` holds every layer of its stages, and those stages cover every layer
    with state (so none is lost): `repairs` has nothing to send (most reroutes)."""
    covered: set[tuple[int, int]] = set()
    for pipe in pipelines:
        for st in pipe.stages:
            if st.worker in workers:
                a, b = st.first_layer, st.end_layer
                if not _holds(held.get(st.worker, ()), a, b):
                    return False
                covered.add((a, b))
    layers = [False] * len(spec.layers)
    for a, b in covered:
        layers[a:b] = [True] * (b - a)
    stateful = (lp.param_bytes + lp.optimizer_bytes > 0 for lp in spec.layers)
    return all(c or not s for c, s in zip(layers, stateful, strict=True))


def _holds(intervals: Sequence[Interval], first: int, end: int) -> bool:
    """Whether merged `intervals` cover [first, end)."""
    if len(intervals) == 1:  # most workers hold one stage's layers
        x, y = intervals[0]
        return x <= first and end <= y
    return any(x <= first and end <= y for x, y in intervals)


def _held_by(workers: Iterable[str], held: Held) -> dict[str, list[Interval]]:
    """What `workers` hold (read, never changed: the lists are `held`'s own)."""
    return {w: ivs for w in workers if (ivs := held.get(w))}


def _layer_bytes(spec: JobSpec) -> npt.NDArray[np.int64]:
    return np.array([lp.param_bytes + lp.optimizer_bytes for lp in spec.layers], np.int64)


def _replicas(held: dict[str, list[Interval]], layer_bytes: npt.NDArray[np.int64]) -> _Replicas:
    replicas = _Replicas(held, len(layer_bytes))
    # A layer without parameters or optimizer state (an activation, a reshape) has nothing to lose.
    lost = [layer for layer in replicas.unheld if layer_bytes[layer] > 0]
    if lost:
        raise LostLayers(lost)
    return replicas


# Above this many (row class x column class) pairs the flow over classes stops paying off.
_CLASS_PAIRS_LIMIT = 512


def match_slots(
    rows: Sequence[str],
    held: dict[str, list[Interval]],
    slots: Sequence[tuple[int, int, int, int]],
    layer_bytes: npt.NDArray[np.int64],
    *,
    by_class: bool | None = None,
) -> list[int]:
    """The row (survivor) matched to each slot, moving the fewest bytes.

    Survivors holding the same layers are interchangeable, and so are slots with the same layers.
    When there are few such classes (the common case: a symmetric layout losing a few workers has
    one class per old stage, plus the newcomers), the matching is a transportation problem over
    classes, solved as a min-cost flow on a graph of a few dozen edges; its integral optimum,
    expanded member by member in order, is an optimal matching. Otherwise the full n x n matrix
    goes to linear_sum_assignment. `by_class` forces one path (tests compare them).
    """
    row_classes: dict[tuple[Interval, ...], list[int]] = {}
    for r, w in enumerate(rows):
        row_classes.setdefault(tuple(held.get(w, ())), []).append(r)
    col_classes: dict[tuple[int, int], list[int]] = {}
    for j, (_, _, a, b) in enumerate(slots):
        col_classes.setdefault((a, b), []).append(j)
    if by_class is None:
        # The flow's graph has one edge per class pair; the matrix, n^2 entries. Beyond a few
        # thousand survivors the matrix (and scipy's O(n^3) worst case) costs far more.
        limit = max(_CLASS_PAIRS_LIMIT, len(rows) // 2)
        by_class = len(row_classes) * len(col_classes) <= limit
    if not by_class:
        pairs, _ = min_cost_assignment(_cost_matrix(rows, held, slots, layer_bytes))
        owner = [0] * len(slots)
        for r, j in pairs:
            owner[j] = r
        return owner

    reps = [rows[members[0]] for members in row_classes.values()]
    class_slots = [(0, 0, a, b) for a, b in col_classes]
    cost = _cost_matrix(reps, held, class_slots, layer_bytes).tolist()
    g = nx.DiGraph()
    for i, members in enumerate(row_classes.values()):
        g.add_node(("row", i), demand=-len(members))
    for j, members in enumerate(col_classes.values()):
        g.add_node(("slot", j), demand=len(members))
    for i in range(len(reps)):
        for j in range(len(class_slots)):
            g.add_edge(("row", i), ("slot", j), weight=cost[i][j])
    flow = nx.min_cost_flow(g)
    owner = [0] * len(slots)
    row_lists = [iter(m) for m in row_classes.values()]
    col_lists = [iter(m) for m in col_classes.values()]
    for i in range(len(reps)):
        for j in range(len(class_slots)):
            for _ in range(flow[("row", i)][("slot", j)]):
                owner[next(col_lists[j])] = next(row_lists[i])
    return owner


def _cost_matrix(
    rows: Sequence[str],
    held: dict[str, list[Interval]],
    slots: Sequence[tuple[int, int, int, int]],
    layer_bytes: npt.NDArray[np.int64],
) -> npt.NDArray[np.int64]:
    """cost[r, j] = bytes of slot j's layers that survivor r lacks, from per-row prefix sums.

    held_prefix[r, k] = bytes of layers < k that r holds, so r's holding inside [a, b) is
    held_prefix[r, b] - held_prefix[r, a]: the whole matrix is two gathers and a subtraction.
    """
    n, n_layers = len(rows), len(layer_bytes)
    mask = np.zeros((n, n_layers), np.int64)
    for r, w in enumerate(rows):
        for a, b in held.get(w, ()):
            mask[r, a:b] = 1
    held_prefix = np.zeros((n, n_layers + 1), np.int64)
    np.cumsum(mask * layer_bytes, axis=1, out=held_prefix[:, 1:])
    prefix = np.concatenate(([0], np.cumsum(layer_bytes)))
    starts = np.array([a for _, _, a, _ in slots], np.intp)
    ends = np.array([b for _, _, _, b in slots], np.intp)
    slot_bytes = prefix[ends] - prefix[starts]
    result: npt.NDArray[np.int64] = slot_bytes[None, :] - (
        held_prefix[:, ends] - held_prefix[:, starts]
    )
    return result


class _Replicas:
    """The layer axis cut into segments over which the set of surviving holders is constant."""

    def __init__(self, held: dict[str, list[Interval]], n_layers: int) -> None:
        cuts = {0, n_layers}
        for ivs in held.values():
            for a, b in ivs:
                cuts.update((a, b))
        self.bounds = sorted(cuts)
        index = {b: i for i, b in enumerate(self.bounds)}
        self.holders: list[list[str]] = [[] for _ in self.bounds[:-1]]
        self.segments_of: dict[str, list[int]] = {}
        for w, ivs in held.items():
            for a, b in ivs:
                for k in range(index[a], index[b]):
                    self.holders[k].append(w)
                    self.segments_of.setdefault(w, []).append(k)
        self.unheld = [
            layer
            for k, hs in enumerate(self.holders)
            if not hs
            for layer in range(self.bounds[k], self.bounds[k + 1])
        ]

    def pieces(self, a: int, b: int, own: Collection[int]) -> list[tuple[int, int, int]]:
        """(segment, first, end) pieces of [a, b) in segments not in `own`."""
        out = []
        k = bisect.bisect_right(self.bounds, a) - 1
        while k < len(self.holders) and self.bounds[k] < b:
            if k not in own:
                out.append((k, max(a, self.bounds[k]), min(b, self.bounds[k + 1])))
            k += 1
        return out


class _Links:
    """spec.link without its linear worker lookup (called once per transfer candidate)."""

    def __init__(self, spec: JobSpec, host: Mapping[str, str]) -> None:
        self.intra, self.inter, self.host = spec.intra_host, spec.inter_host, host

    def __call__(self, a: str, b: str) -> LinkSpec:
        return self.intra if self.host[a] == self.host[b] else self.inter


class _Sources:
    """Per segment, its holders in heaps keyed by the seconds of sending already given to them.

    One heap over all holders and one per host, built when a piece of the segment first needs a
    source; entries go stale when a holder's load grows and are dropped lazily, so each choice
    costs O(log holders).
    """

    def __init__(
        self, replicas: _Replicas, order: Mapping[str, int], host: Mapping[str, str]
    ) -> None:
        self.replicas, self.order, self.host = replicas, order, host
        self.load: dict[str, float] = {}  # seconds of sending given to a holder; absent: none
        self.any: dict[int, list[tuple[float, int, str]]] = {}
        self.local: dict[tuple[int, str], list[tuple[float, int, str]]] = {}

    def _build(self, segment: int) -> None:
        # Sorted lists are heaps: every holder once, at its load now.
        load, order = self.load, self.order
        entries = sorted((load.get(w, 0.0), order[w], w) for w in self.replicas.holders[segment])
        self.any[segment] = entries
        for entry in entries:
            self.local.setdefault((segment, self.host[entry[2]]), []).append(entry)

    def _push(self, w: str) -> None:
        entry = (self.load[w], self.order[w], w)
        for k in self.replicas.segments_of[w]:
            if k in self.any:  # a heap not built yet reads the load when it is
                heapq.heappush(self.any[k], entry)
                heapq.heappush(self.local[(k, self.host[w])], entry)

    def _top(self, heap: list[tuple[float, int, str]] | None) -> str | None:
        while heap:
            load, _, w = heap[0]
            if load == self.load.get(w, 0.0):
                return w
            heapq.heappop(heap)
        return None

    def choose(self, segment: int, dst: str, local: float, remote: float) -> str:
        """The holder that would finish sending to `dst` earliest (`local`, `remote`: the
        piece's seconds on the same host and across hosts); same host on ties."""
        if segment not in self.any:
            self._build(segment)
        here, load = self.host[dst], self.load
        w = self._top(self.any[segment])
        assert w is not None, "segment without a holder reached source choice"
        if self.host[w] == here:  # the least loaded holder is local: no other can beat it
            finish = load.get(w, 0.0) + local
        else:
            finish = load.get(w, 0.0) + remote
            near = self._top(self.local.get((segment, here)))
            if near is not None and load.get(near, 0.0) + local <= finish:
                w, finish = near, load.get(near, 0.0) + local
        load[w] = finish
        self._push(w)
        return w


def _migration(
    spec: JobSpec,
    pipelines: Sequence[Pipeline],
    held: dict[str, list[Interval]],
    replicas: _Replicas,
    layer_bytes: npt.NDArray[np.int64],
) -> tuple[tuple[Transfer, ...], float]:
    workers = roster(spec)
    order = workers.order
    links = _Links(spec, workers.host)
    prefix = np.concatenate(([0], np.cumsum(layer_bytes))).tolist()
    # Every missing piece (destination, segment, layer range) with bytes to send.
    pieces: list[tuple[int, str, int, int, int]] = []
    for pipe in pipelines:
        for st in pipe.stages:
            w, first, end = st.worker, st.first_layer, st.end_layer
            if _holds(held.get(w, ()), first, end):
                continue  # nothing to send it
            for k, a, b in replicas.pieces(first, end, replicas.segments_of.get(w, ())):
                nbytes = prefix[b] - prefix[a]
                if nbytes > 0:  # layers without parameters or optimizer state move nothing
                    pieces.append((nbytes, w, k, a, b))
    # Largest first (LPT): big pieces spread over idle sources, small ones fill in the gaps.
    pieces.sort(key=lambda x: (-x[0], order[x[1]], x[3]))
    sources = _Sources(replicas, order, links.host)
    coalesced: dict[tuple[str, str], tuple[list[int], int]] = {}
    intra, inter = spec.intra_host, spec.inter_host
    for nbytes, dst, k, a, b in pieces:
        src = sources.choose(k, dst, intra.transfer_seconds(nbytes), inter.transfer_seconds(nbytes))
        layers, sent = coalesced.get((src, dst), ([], 0))
        layers.extend(range(a, b))
        coalesced[(src, dst)] = (layers, sent + nbytes)

    keys = sorted(coalesced, key=lambda sd: (order[sd[1]], order[sd[0]]))
    seconds = [links(src, dst).transfer_seconds(coalesced[(src, dst)][1]) for src, dst in keys]
    colour, _ = weighted_rounds(keys, seconds)
    sizes = [coalesced[k][1] for k in keys]
    migration_seconds = nic_bound_seconds(spec, links.host, keys, sizes, seconds, colour)
    transfers = [
        Transfer(src, dst, tuple(sorted(coalesced[(src, dst)][0])), coalesced[(src, dst)][1], c)
        for (src, dst), c in zip(keys, colour, strict=True)
    ]
    transfers.sort(key=lambda t: (t.round, order[t.dst], order[t.src]))
    return tuple(transfers), migration_seconds


def nic_bound_seconds(
    spec: JobSpec,
    host: Mapping[str, str],
    pairs: Sequence[tuple[str, str]],
    nbytes: Sequence[int],
    seconds: Sequence[float],
    colour: Sequence[int],
) -> float:
    """Migration time of transfers run in colouring rounds, each round a barrier: a round lasts
    as long as its slowest transfer, and never less than the busiest host interface needs for
    the bytes that round sends out of it or into it across hosts (every device of a host shares
    its interface: `spec.nic_bytes_per_second()`). Rounds add up."""
    nic = spec.nic_bytes_per_second()
    slowest: dict[int, float] = {}
    through: dict[tuple[int, str, str], int] = {}  # (round, host, "out" | "in") -> bytes
    for (src, dst), b, t, c in zip(pairs, nbytes, seconds, colour, strict=True):
        slowest[c] = max(slowest.get(c, 0.0), t)
        if host[src] != host[dst]:
            through[(c, host[src], "out")] = through.get((c, host[src], "out"), 0) + b
            through[(c, host[dst], "in")] = through.get((c, host[dst], "in"), 0) + b
    for (c, _, _), b in through.items():
        slowest[c] = max(slowest[c], b / nic)
    return sum(slowest.values())


def sync_groups(pipelines: Sequence[Pipeline], excluded: Collection[str]) -> tuple[SyncGroup, ...]:
    """Gradient all-reduce groups: layers with the same owners across pipelines, in rounds.

    A layer's group is the set of (non-excluded) workers owning a stage that holds it, one per
    pipeline. Layers with identical groups are merged; groups sharing a worker conflict and go to
    different rounds. A group of one is listed too (nothing to reduce, but explicit for workers).
    """
    out = set(excluded)
    spans: dict[tuple[int, int], list[str]] = {}  # a stage's layers -> their owners
    first: dict[str, tuple[int, int]] = {}  # each owner's first stage
    several: dict[str, list[tuple[int, int]]] = {}  # owners of more than one stage -> spans
    for pipe in pipelines:
        for st in pipe.stages:
            span = (st.first_layer, st.end_layer)
            found = spans.get(span)
            if found is None:
                found = spans[span] = []
            w = st.worker
            if w not in out:
                found.append(w)
                if w in first:
                    several.setdefault(w, [first[w]]).append(span)
                else:
                    first[w] = span
    bounds = sorted({b for span in spans for b in span})
    index = {b: i for i, b in enumerate(bounds)}
    # Per segment between two bounds: the spans over it, each span's owners sorted once.
    over: list[list[tuple[int, int]]] = [[] for _ in bounds[:-1]]
    for span, names in spans.items():
        if names:
            names.sort()
            for k in range(index[span[0]], index[span[1]]):
                over[k].append(span)
    merged: dict[tuple[str, ...], list[int]] = {}
    for k, covering in enumerate(over):
        if covering:
            # Sorting sorted runs is linear; a set only where an owner may repeat.
            ws = [w for span in covering for w in spans[span]]
            key = tuple(sorted(set(ws) if several else ws))
            merged.setdefault(key, []).extend(range(bounds[k], bounds[k + 1]))
    groups = sorted(merged.items(), key=lambda g: (min(g[1]), g[0]))
    colour = dsatur(_group_conflicts(groups, spans, several))
    return tuple(
        SyncGroup(ws, tuple(sorted(layers)), c)
        for (ws, layers), c in zip(groups, colour, strict=True)
    )


def _group_conflicts(
    groups: Sequence[tuple[tuple[str, ...], list[int]]],
    spans: dict[tuple[int, int], list[str]],
    several: dict[str, list[tuple[int, int]]],
) -> list[set[int]]:
    """`conflict_graph` of the groups' workers, from the stages: the groups of one owner's
    layers form a clique, so owners of the same stages give the same clique, built once."""
    group_of: dict[int, int] = {}
    for g, (_, layers) in enumerate(groups):
        for layer in layers:
            group_of[layer] = g
    cliques = {frozenset(group_of[layer] for layer in range(a, b) if layer in group_of)
               for (a, b), names in spans.items() if names}  # fmt: skip
    for owned in several.values():
        cliques.add(frozenset(group_of[layer] for a, b in owned for layer in range(a, b)
                              if layer in group_of))  # fmt: skip
    adjacency: list[set[int]] = [set() for _ in groups]
    for clique in cliques:
        if len(clique) > 1:
            for g in clique:
                adjacency[g].update(clique)
    for g, a in enumerate(adjacency):
        a.discard(g)
    return adjacency
