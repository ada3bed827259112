"""The 1F1B schedule of a plan: the op order every worker executes, and the model's times for it.

One function serves both sides of the system. The estimator takes `makespan` as the pipelines' step
time (a longest path over the 1F1B dependency graph); the worker runtime executes `ops[worker]` in
order. Using the same order in both is what makes the estimate describe what actually runs.

Dependencies (PAPER.md section 4): an op starts after the previous op of the same executor; F(s, m)
after F(s-1, m) plus the activation transfer; B(s, m) after F(s, m) and B(s+1, m) plus the gradient
transfer. Each slot's queue is 1F1B: min(N_pp - s - 1, N_m) warm-up forwards, then alternating F/B,
then the remaining backwards.

Under rerouting a worker executes the queues of several slots. Its order is the merge of those
queues by their failure-free ("ideal") start times. That order is a linear extension of the
dependency graph (every edge goes from an earlier to a strictly later ideal start), so every worker
executing its ops in order with blocking receives and non-blocking sends cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chameleond.core.plan import Pipeline

FORWARD = "F"
BACKWARD = "B"
# Durations are clamped to this so that dependency edges strictly increase start times.
_MIN_SECONDS = 1e-12


@dataclass(frozen=True)
class Op:
    kind: str  # FORWARD | BACKWARD
    pipeline: int
    stage: int
    micro_batch: int  # global micro-batch index
    worker: str  # executor
    upstream: str | None  # executor of (pipeline, stage - 1, micro_batch)
    downstream: str | None  # executor of (pipeline, stage + 1, micro_batch)
    start: float
    end: float


@dataclass(frozen=True)
class Schedule:
    ops: dict[str, list[Op]]  # per executing worker, in execution order
    makespan: float


# (pipeline, stage, kind, executor) -> seconds of compute for one micro-batch
OpSeconds = Callable[[int, int, str, str], float]
# (pipeline, boundary stage s -> s+1, kind, src, dst) -> seconds on the wire (0 if src == dst)
CommSeconds = Callable[[int, int, str, str, str], float]


def slot_queue(n_stages: int, stage: int, n_micro: int) -> list[tuple[str, int]]:
    """1F1B order of one slot: (kind, local micro-batch index)."""
    warmup = min(n_stages - stage - 1, n_micro)
    q: list[tuple[str, int]] = [(FORWARD, i) for i in range(warmup)]
    f, b = warmup, 0
    while f < n_micro:
        q.append((FORWARD, f))
        f += 1
        q.append((BACKWARD, b))
        b += 1
    q.extend((BACKWARD, i) for i in range(b, n_micro))
    return q


def _pipeline_times(
    p: int,
    n_stages: int,
    n_micro: int,
    executor: Callable[[int, int], str],
    op_seconds: OpSeconds,
    comm_seconds: CommSeconds,
) -> dict[tuple[str, int, int], tuple[float, float]]:
    """Longest-path start/end of every op of one pipeline, each slot its own resource."""
    queues = [slot_queue(n_stages, s, n_micro) for s in range(n_stages)]
    pos = [0] * n_stages
    free = [0.0] * n_stages
    times: dict[tuple[str, int, int], tuple[float, float]] = {}
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for s in range(n_stages):
            while pos[s] < len(queues[s]):
                kind, m = queues[s][pos[s]]
                ready = free[s]
                if kind == FORWARD and s > 0:
                    dep = times.get((FORWARD, s - 1, m))
                    if dep is None:
                        break
                    src, dst = executor(s - 1, m), executor(s, m)
                    ready = max(ready, dep[1] + comm_seconds(p, s - 1, FORWARD, src, dst))
                if kind == BACKWARD:
                    if s + 1 < n_stages:
                        dep = times.get((BACKWARD, s + 1, m))
                        if dep is None:
                            break
                        src, dst = executor(s + 1, m), executor(s, m)
                        ready = max(ready, dep[1] + comm_seconds(p, s, BACKWARD, src, dst))
                    ready = max(ready, times[(FORWARD, s, m)][1])
                dur = max(op_seconds(p, s, kind, executor(s, m)), _MIN_SECONDS)
                times[(kind, s, m)] = (ready, ready + dur)
                free[s] = ready + dur
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - 1F1B queues always make progress
            raise RuntimeError("1F1B dependency cycle")
    return times


def build_schedule(
    pipelines: Sequence[Pipeline],
    routing: Sequence[Sequence[Sequence[str]]],
    op_seconds: OpSeconds,
    comm_seconds: CommSeconds,
) -> Schedule:
    """Per-worker op order and longest-path times of one step of a plan."""
    keyed: list[tuple[tuple[float, float, int, int, int], Op]] = []
    for p, pipe in enumerate(pipelines):
        n_stages, n_micro = len(pipe.stages), pipe.micro_batches

        def owner(s: int, _m: int, pipe: Pipeline = pipe) -> str:
            return pipe.stages[s].worker

        def routed(s: int, m: int, p: int = p) -> str:
            return routing[p][s][m]

        ideal = _pipeline_times(p, n_stages, n_micro, owner, op_seconds, comm_seconds)
        for (kind, s, m), (start, end) in ideal.items():
            op = Op(
                kind=kind,
                pipeline=p,
                stage=s,
                micro_batch=pipe.first_micro_batch + m,
                worker=routed(s, m),
                upstream=routed(s - 1, m) if s > 0 else None,
                downstream=routed(s + 1, m) if s + 1 < n_stages else None,
                start=start,
                end=end,
            )
            keyed.append(((start, end, p, s, 0 if kind == FORWARD else 1), op))
    keyed.sort(key=lambda k: k[0])

    # Second pass: the real executors, each a single resource running its ops in ideal order.
    end_of: dict[tuple[str, int, int, int], float] = {}
    free: dict[str, float] = {}
    ops: dict[str, list[Op]] = {}
    makespan = 0.0
    for _, op in keyed:
        p, s, mb, w = op.pipeline, op.stage, op.micro_batch, op.worker
        ready = free.get(w, 0.0)
        if op.kind == FORWARD and op.upstream is not None:
            ready = max(
                ready,
                end_of[(FORWARD, p, s - 1, mb)] + comm_seconds(p, s - 1, FORWARD, op.upstream, w),
            )
        if op.kind == BACKWARD:
            ready = max(ready, end_of[(FORWARD, p, s, mb)])
            if op.downstream is not None:
                ready = max(
                    ready,
                    end_of[(BACKWARD, p, s + 1, mb)]
                    + comm_seconds(p, s, BACKWARD, op.downstream, w),
                )
        end = ready + max(op_seconds(p, s, op.kind, w), _MIN_SECONDS)
        end_of[(op.kind, p, s, mb)] = end
        free[w] = end
        makespan = max(makespan, end)
        ops.setdefault(w, []).append(
            Op(op.kind, p, s, mb, w, op.upstream, op.downstream, ready, end)
        )
    return Schedule(ops=ops, makespan=makespan)


def idle_before(ops: Sequence[Op], makespan: float) -> list[float]:
    """One executor's idle time in the timeline: before each of its ops (the wait for that op's
    input: the warm-up bubble, and the gaps of the steady phase and the cool-down), then, as one
    more element, from its last op to the end of the step (the cool-down bubble of later stages).
    These are the bubbles BAFT records checkpoints in (PAPER.md section 9)."""
    idle, free = [], 0.0
    for op in ops:
        idle.append(max(0.0, op.start - free))
        free = op.end
    idle.append(max(0.0, makespan - free))
    return idle
