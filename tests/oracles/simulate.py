"""A discrete-event simulation of one training step: the test oracle for the estimator.

Written from the 1F1B rules, not from schedule.py: workers are processes that pick their next op
from their own list, block until its input message has arrived, compute, and post messages that
arrive after the link's transfer time. Time advances from event to event (a heap of completions
and arrivals). With one worker per slot the lists are each slot's 1F1B queue; under rerouting the
caller passes the per-worker op order it wants simulated (the one the workers execute).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# (kind "F" | "B", pipeline, stage, local micro-batch)
SimOp = tuple[str, int, int, int]


@dataclass(frozen=True)
class SimPipeline:
    forward: Sequence[float]  # seconds per micro-batch, per stage
    backward: Sequence[float]
    n_micro: int


def one_f_one_b(n_stages: int, stage: int, n_micro: int) -> list[tuple[str, int]]:
    """Warm-up forwards (as many as stages downstream), steady F/B pairs, cool-down backwards."""
    warm = min(n_stages - 1 - stage, n_micro)
    order = [("F", m) for m in range(warm)]
    for k in range(n_micro - warm):
        order += [("F", warm + k), ("B", k)]
    order += [("B", m) for m in range(n_micro - warm, n_micro)]
    return order


def simulate(
    pipelines: Sequence[SimPipeline],
    executor: Callable[[int, int, int], str],
    transfer: Callable[[int, int, str, str], float],
    order: Mapping[str, Sequence[SimOp]] | None = None,
) -> float:
    """Seconds from the first op to the last of one step.

    executor(p, s, m): the worker running stage s of pipeline p for micro-batch m;
    transfer(p, boundary, src, dst): seconds for a message across boundary s -> s+1 (either way);
    order: per worker op lists; default, each slot's own 1F1B queue on its executor.
    """
    if order is None:
        built: dict[str, list[SimOp]] = {}
        for p, pipe in enumerate(pipelines):
            n = len(pipe.forward)
            for s in range(n):
                for kind, m in one_f_one_b(n, s, pipe.n_micro):
                    built.setdefault(executor(p, s, m), []).append((kind, p, s, m))
        order = built
    arrived: set[SimOp] = set()  # inputs delivered: ("F", p, s, m) = activation for F(p, s, m)
    done: set[SimOp] = set()
    nxt = dict.fromkeys(order, 0)
    busy: set[str] = set()
    events: list[tuple[float, int, str, SimOp, str]] = []  # (time, seq, what, op, worker)
    seq = 0
    now = 0.0

    def ready(op: SimOp) -> bool:
        kind, p, s, _ = op
        last = len(pipelines[p].forward) - 1
        if kind == "F":
            return s == 0 or op in arrived
        return (s == last or op in arrived) and ("F", p, s, op[3]) in done

    def try_start(w: str) -> None:
        nonlocal seq
        if w in busy or nxt[w] >= len(order[w]):
            return
        op = order[w][nxt[w]]
        if not ready(op):
            return
        kind, p, s, _ = op
        pipe = pipelines[p]
        seconds = pipe.forward[s] if kind == "F" else pipe.backward[s]
        busy.add(w)
        nxt[w] += 1
        seq += 1
        heapq.heappush(events, (now + max(seconds, 1e-12), seq, "done", op, w))

    for w in order:
        try_start(w)
    while events:
        now, _, what, op, w = heapq.heappop(events)
        kind, p, s, m = op
        if what == "arrive":
            arrived.add(op)
            try_start(executor(p, s, m))
            continue
        done.add(op)
        busy.discard(w)
        last = len(pipelines[p].forward) - 1
        target: SimOp | None = None
        if kind == "F" and s < last:
            target, boundary = ("F", p, s + 1, m), s
        elif kind == "B" and s > 0:
            target, boundary = ("B", p, s - 1, m), s - 1
        if target is not None:
            dst = executor(p, target[2], m)
            seq += 1
            arrival = now + transfer(p, boundary, w, dst)
            heapq.heappush(events, (arrival, seq, "arrive", target, dst))
        try_start(w)
    missing = sum(len(ops) for ops in order.values()) - len(done)
    if missing:
        raise RuntimeError(f"simulation deadlocked with {missing} ops not run")
    return now
