"""Processor sharing: one step of a plan whose workers share a host's CPU cores.

A host listed in the spec's `hosts` gives the job `cpu_cores` cores (measured: what the job's
workers get there), and the job's workers on it compete for them. The operating system shares the
cores among the processes that can run: with k of the host's workers runnable, each computes at
min(1, C / k) of its speed alone. A worker waiting for an input (a pipeline bubble; an uneven plan
whose short pipelines finish early) leaves its share to the others, and cores sit idle only while
fewer workers than cores can run.

`shared_makespan` simulates that event by event over a plan's schedule: every worker runs its ops
in the schedule's order; an op is runnable once its inputs have arrived (the upstream op's end plus
the transfer, the edges of the longest path in schedule.py); between two events each runnable op
progresses at its host's shared rate. A worker on a host that is not listed computes at full
speed, so with enough cores everywhere the result is the schedule's longest path.
`shared_jobs_seconds` shares the cores the same way among work that starts together and has no
dependencies (the optimizer updates after the commit vote).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from chameleond.core.schedule import FORWARD, CommSeconds, Op

_DONE = 1e-15  # seconds of work left below which an op has finished (float round-off)


def shared_makespan(
    ops: Mapping[str, Sequence[Op]],
    work: Callable[[Op], float],
    comm: CommSeconds,
    host_of: Mapping[str, str],
    cores: Mapping[str, float],
) -> float:
    """End of the last op when each worker runs `ops[worker]` in order, an op taking `work(op)`
    seconds of one core, and the workers on a host in `cores` share its cores."""
    pos = dict.fromkeys(ops, 0)
    left = {w: max(work(q[0]), 0.0) for w, q in ops.items() if q}
    active = list(left)
    end: dict[tuple[str, int, int, int], float] = {}
    t = 0.0
    while active:
        runnable: list[str] = []
        next_ready = math.inf
        for w in active:
            ready = _ready(ops[w][pos[w]], end, comm)
            if ready is None:
                continue
            if ready <= t:
                runnable.append(w)
            else:
                next_ready = min(next_ready, ready)
        if not runnable:
            if next_ready == math.inf:  # pragma: no cover - schedule orders are deadlock-free
                raise RuntimeError("no op can run: the op order is not a linear extension")
            t = next_ready
            continue
        sharing = Counter(host_of[w] for w in runnable if host_of[w] in cores)
        rate = {
            w: min(1.0, cores[host_of[w]] / sharing[host_of[w]]) if host_of[w] in cores else 1.0
            for w in runnable
        }
        dt = min(min(left[w] / rate[w] for w in runnable), next_ready - t)
        t += dt
        for w in runnable:
            left[w] -= rate[w] * dt
            if left[w] > _DONE:
                continue
            op = ops[w][pos[w]]
            end[(op.kind, op.pipeline, op.stage, op.micro_batch)] = t
            pos[w] += 1
            if pos[w] < len(ops[w]):
                left[w] = max(work(ops[w][pos[w]]), 0.0)
        active = [w for w in active if pos[w] < len(ops[w])]
    return t


def _ready(
    op: Op, end: Mapping[tuple[str, int, int, int], float], comm: CommSeconds
) -> float | None:
    """When the op's inputs have arrived, or None while an op it needs has not ended."""
    p, s, m, w = op.pipeline, op.stage, op.micro_batch, op.worker
    if op.kind == FORWARD:
        if op.upstream is None:
            return 0.0
        up = end.get((FORWARD, p, s - 1, m))
        return None if up is None else up + comm(p, s - 1, FORWARD, op.upstream, w)
    ready = end.get((FORWARD, p, s, m))
    if ready is None or op.downstream is None:
        return ready
    down = end.get((op.kind, p, s + 1, m))
    return None if down is None else max(ready, down + comm(p, s, op.kind, op.downstream, w))


def shared_jobs_seconds(works: Sequence[float], cores: float | None) -> float:
    """Independent work released together on one host: when the last of it ends, with the host's
    `cores` shared equally among the unfinished (None: every piece on a core of its own)."""
    pending = sorted(x for x in works if x > 0)
    if cores is None or len(pending) <= cores:
        return pending[-1] if pending else 0.0
    t = done = 0.0
    for i, x in enumerate(pending):
        t += (x - done) / min(1.0, cores / (len(pending) - i))
        done = x
    return t


__all__ = ["shared_jobs_seconds", "shared_makespan"]
