"""The rerouting candidate: the current layout, with failed slots executed by their peers.

A failed worker's slot (pipeline p, stage s, layers [a, b)) is executed, micro-batch by micro-batch,
by surviving workers that own a stage with the identical layer range in another pipeline: they hold
exactly the parameters and optimizer state it needs, so nothing moves. Each micro-batch goes to the
peer with the least work so far (its own micro-batches plus those already rerouted to it), on ties
a peer on the failed worker's host (activations then travel on the faster link), then the earlier
pipeline. Loads carry over between failed slots, so several failures spread evenly.

The failed set is cumulative and the routing is rebuilt from the layout each time, so a plan that
is already rerouted is handled like any other. If some failed slot has no surviving peer, rerouting
is infeasible and the reason names the slot and its layers.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass

from chameleond.core.plan import Plan
from chameleond.core.spec import JobSpec

RoutingTable = tuple[tuple[tuple[str, ...], ...], ...]


@dataclass(frozen=True)
class Rerouting:
    routing: RoutingTable | None  # routing[p][s][i]: executor of the i-th micro-batch; None: no
    reason: str = ""  # why rerouting is infeasible
    rerouted: int = 0  # micro-batch slots moved to a peer


def reroute(spec: JobSpec, current: Plan, failed: Collection[str]) -> Rerouting:
    """Routing table for `current`'s layout with every worker in `failed` executing nothing."""
    host = {w.id: w.host for w in spec.workers}
    out = set(failed)
    # Slots by layer range: the peers that can execute a range without moving state.
    holders: dict[tuple[int, int], list[tuple[int, str]]] = {}
    load: dict[str, int] = {}
    for p, pipe in enumerate(current.pipelines):
        for st in pipe.stages:
            if st.worker not in out:
                holders.setdefault((st.first_layer, st.end_layer), []).append((p, st.worker))
                load[st.worker] = load.get(st.worker, 0) + pipe.micro_batches

    routing: list[tuple[tuple[str, ...], ...]] = []
    moved = 0
    for p, pipe in enumerate(current.pipelines):
        stages: list[tuple[str, ...]] = []
        for s, st in enumerate(pipe.stages):
            if st.worker not in out:
                stages.append((st.worker,) * pipe.micro_batches)
                continue
            peers = holders.get((st.first_layer, st.end_layer), [])
            if not peers:
                layers = _layer_span(st.first_layer, st.end_layer)
                return Rerouting(
                    None, f"stage {s} of pipeline {p} has no surviving replica ({layers})"
                )
            here = host.get(st.worker)
            heap = [(load[w], int(host.get(w) != here), q, w) for q, w in peers]
            heapq.heapify(heap)
            executors = []
            for _ in range(pipe.micro_batches):
                n, remote, q, w = heapq.heappop(heap)
                executors.append(w)
                load[w] = n + 1
                heapq.heappush(heap, (n + 1, remote, q, w))
            moved += pipe.micro_batches
            stages.append(tuple(executors))
        routing.append(tuple(stages))
    return Rerouting(tuple(routing), "", moved)


def _layer_span(first: int, end: int) -> str:
    return f"layer {first}" if end - first == 1 else f"layers {first}-{end - 1}"
