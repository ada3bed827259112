"""The weighted reroute: the current layout, with a share of each slow worker's micro-batches
executed by its same-range peers.

A slot whose owner is slow (`WorkerSpec.speed` < 1: a throttled device, a noisy neighbour) keeps
its state where it is; k of its pipeline's m micro-batches are executed by the workers that own a
stage with the identical layer range in another pipeline (core.reroute's peers: they hold the
same parameters and optimizer state, so nothing moves). Each moved micro-batch goes to the peer
with the least work so far in time (micro-batches executed over its speed), on ties one on the
slow worker's host, then the earlier pipeline. The moved micro-batches are spread evenly over the
slot's queue (k = 1 moves the last one, whose backward falls in the peers' cool-down).

k is chosen per slow slot to minimise the estimated step time (core.estimator with the workers'
speeds): every k of one slot with the others fixed, slot after slot, until a round changes
nothing; with one slow slot that is exhaustive. The fewer moved wins ties, and plans a worker's
memory cannot hold are skipped. k stays below m: a slow owner executes at least one micro-batch
of its slot, so it stays in the plan, its sync groups and its update; moving all of them is the
decision made as if it had failed (core.slowdecide's exclude candidate). Slots of workers the
current plan excludes are rerouted whole, as core.reroute does.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from chameleond.core.estimator import Estimator
from chameleond.core.plan import Plan
from chameleond.core.reroute import RoutingTable, reroute
from chameleond.core.restorer import sync_groups

# At most this many rounds over the slow slots (each round times every k of every slot).
ROUNDS = 4

Slot = tuple[int, int]  # (pipeline, stage)


@dataclass(frozen=True)
class WeightedRouting:
    routing: RoutingTable | None  # None: the current layout cannot be rerouted (reason)
    moved: Mapping[Slot, int]  # per slow slot, the micro-batches its peers execute
    step_seconds: float
    reason: str = ""


def slow_slots(est: Estimator, current: Plan, fenced: Collection[str]) -> list[Slot]:
    """The slots whose owner runs below full speed and has a peer to share with."""
    ranges: dict[tuple[int, int], int] = {}
    for pipe in current.pipelines:
        for st in pipe.stages:
            if st.worker not in fenced:
                key = (st.first_layer, st.end_layer)
                ranges[key] = ranges.get(key, 0) + 1
    speed = {w.id: w.speed for w in est.spec.workers}
    return [
        (p, s)
        for p, pipe in enumerate(current.pipelines)
        for s, st in enumerate(pipe.stages)
        if st.worker not in fenced
        and speed[st.worker] < 1.0
        and ranges[(st.first_layer, st.end_layer)] > 1
        and pipe.micro_batches > 1
    ]


def weighted_routing(
    est: Estimator, current: Plan, fenced: Collection[str], moved: Mapping[Slot, int]
) -> RoutingTable | None:
    """`current`'s layout with `fenced` workers' slots rerouted whole and `moved[(p, s)]` of each
    slow slot's micro-batches executed by its peers; None when a fenced slot has no peer."""
    base = reroute(est.spec, current, fenced).routing
    if base is None:
        return None
    spec = est.spec
    speed = {w.id: w.speed for w in spec.workers}
    host = {w.id: w.host for w in spec.workers}
    load: dict[str, int] = {}
    for rows in base:
        for executors in rows:
            for w in executors:
                load[w] = load.get(w, 0) + 1
    holders: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for p, pipe in enumerate(current.pipelines):
        for st in pipe.stages:
            if st.worker not in fenced:
                holders.setdefault((st.first_layer, st.end_layer), []).append((p, st.worker))
    routing = [list(rows) for rows in base]
    for (p, s), k in sorted(moved.items()):
        if k <= 0:
            continue
        st, m = current.pipelines[p].stages[s], current.pipelines[p].micro_batches
        load[st.worker] -= k
        peers = [(q, w) for q, w in holders[(st.first_layer, st.end_layer)] if w != st.worker]
        heap = [(load[w] / speed[w], int(host[w] != host[st.worker]), q, w) for q, w in peers]
        heapq.heapify(heap)
        row: list[str] = list(routing[p][s])
        for i in range(m):
            if (i * k) // m == ((i + 1) * k) // m:
                continue  # this micro-batch stays with its owner
            _, remote, q, w = heapq.heappop(heap)
            row[i] = w
            load[w] += 1
            heapq.heappush(heap, (load[w] / speed[w], remote, q, w))
        routing[p][s] = tuple(row)
    return tuple(tuple(rows) for rows in routing)


def weighted_reroute(est: Estimator, current: Plan, fenced: Collection[str]) -> WeightedRouting:
    """The share of each slow slot's micro-batches to move that gives the fastest step."""
    excluded = sorted(fenced)
    groups = sync_groups(current.pipelines, excluded)

    def step(moved: Mapping[Slot, int]) -> float | None:
        routing = weighted_routing(est, current, fenced, moved)
        if routing is None:
            return None
        if est.over_memory(est.peak_memory(current.pipelines, routing, excluded)):
            return float("inf")
        return est.step_seconds(current.pipelines, routing, groups)

    slots = slow_slots(est, current, fenced)
    moved = dict.fromkeys(slots, 0)
    best = step(moved)
    if best is None:
        reason = reroute(est.spec, current, fenced).reason
        return WeightedRouting(None, {}, float("inf"), reason)
    for _ in range(ROUNDS):
        changed = False
        for slot in slots:
            for k in range(current.pipelines[slot[0]].micro_batches):
                if k == moved[slot]:
                    continue
                t = step({**moved, slot: k})
                if t is not None and (t < best or (t == best and k < moved[slot])):
                    best, moved[slot], changed = t, k, True
        if not changed:
            break
    routing = weighted_routing(est, current, fenced, moved)
    return WeightedRouting(routing, moved, best)
