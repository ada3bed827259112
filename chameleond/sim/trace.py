"""Failure traces as events on the job's workers.

A trace (`time_ms,add|remove,nodeN`, chameleond/traces) names nodes; a node holds several devices.
The job's workers, in spec order, are cut into groups of `devices_per_node` consecutive workers
(the last group may be smaller), one group per node. Nodes take groups as
`traces.replay.plan_replay` gives them slots: every group starts alive; the first nodes the trace
adds take the groups in order; a `remove` of a node that holds a group fails all its workers at
once; a later `add` takes a free group (its own former one when free) and its workers rejoin.
Events on nodes beyond the job (more nodes than groups) change nothing and are counted as skipped.

`synthetic_trace` draws interruptions at Llama 3's published rate (419 in 54 days on 16,384
GPUs: one every 3.1 h for that job, i.e. per device one every 3.1 h x 16,384), each taking down a
node that comes back after `repair_seconds`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from chameleond.core.spec import JobSpec
from chameleond.traces.replay import TraceEvent, plan_replay

LLAMA3_GPU_SECONDS_PER_INTERRUPTION = 54 * 86400 * 16384 / 419


@dataclass(frozen=True)
class JobEvent:
    seconds: float
    failed: frozenset[str]  # workers that fail now
    joined: frozenset[str]  # workers that come back now


@dataclass(frozen=True)
class JobTrace:
    events: tuple[JobEvent, ...]
    devices_per_node: int
    nodes: int  # groups the job is cut into
    skipped: int  # trace events that change nothing on this job
    end_seconds: float  # where the simulation stops


def peak_nodes(events: Sequence[TraceEvent]) -> int:
    """The most nodes the trace holds at once."""
    alive: set[str] = set()
    peak = 0
    for ev in events:
        if ev.action == "add":
            alive.add(ev.node)
        else:
            alive.discard(ev.node)
        peak = max(peak, len(alive))
    return max(peak, 1)


def default_devices_per_node(spec: JobSpec, events: Sequence[TraceEvent]) -> int:
    """The job's devices over the trace's peak node count (at least 1): the trace's whole node
    population maps onto the job, so its failure fraction is the job's."""
    return max(1, len(spec.workers) // peak_nodes(events))


def job_trace(
    spec: JobSpec,
    events: Sequence[TraceEvent],
    *,
    devices_per_node: int | None = None,
    end_seconds: float | None = None,
) -> JobTrace:
    """The trace's node events as failures and rejoins of the job's workers."""
    d = devices_per_node or default_devices_per_node(spec, events)
    if d < 1:
        raise ValueError(f"devices per node must be >= 1, got {d}")
    ids = [w.id for w in spec.workers]
    groups = {f"g{k}": tuple(ids[i : i + d]) for k, i in enumerate(range(0, len(ids), d))}
    replay = plan_replay(events, list(groups), time_scale=1.0)
    out: list[JobEvent] = []
    for step in replay.steps:
        workers = frozenset(groups[step.worker])
        failed = workers if step.action == "kill" else frozenset()
        joined = workers if step.action == "start" else frozenset()
        if out and out[-1].seconds == step.seconds:  # one instant, one event
            last = out[-1]
            out[-1] = JobEvent(
                last.seconds, (last.failed - joined) | failed, (last.joined - failed) | joined
            )
        else:
            out.append(JobEvent(step.seconds, failed, joined))
    last_event = events[-1].time_ms / 1000.0 if events else 0.0
    if end_seconds is None:
        times = sorted({e.seconds for e in out})
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False) if b > a]
        end_seconds = last_event + (sum(gaps) / len(gaps) if gaps else 3600.0)
    return JobTrace(tuple(out), d, len(groups), replay.skipped, max(end_seconds, last_event))


def synthetic_trace(
    devices: int,
    devices_per_node: int,
    *,
    hours: float,
    seed: int = 0,
    repair_seconds: float = 4 * 3600.0,
    gpu_seconds_per_interruption: float = LLAMA3_GPU_SECONDS_PER_INTERRUPTION,
) -> tuple[TraceEvent, ...]:
    """Interruptions at Llama 3's per-device rate over `hours`, each taking down one node (drawn
    uniformly among the nodes up) until it is repaired `repair_seconds` later."""
    rng = random.Random(seed)  # noqa: S311 - a seeded synthetic trace, not a secret
    nodes = [f"node{k + 1}" for k in range(math.ceil(devices / devices_per_node))]
    events = [TraceEvent(0, "add", n) for n in nodes]
    rate = devices / gpu_seconds_per_interruption
    t, end = 0.0, hours * 3600.0
    back: list[tuple[float, str]] = []
    down: set[str] = set()
    timed: list[tuple[int, int, str, str]] = []
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        for when, node in [b for b in back if b[0] <= t]:
            down.discard(node)
            back.remove((when, node))
        up = [n for n in nodes if n not in down]
        if not up:
            continue
        node = rng.choice(up)
        down.add(node)
        timed.append((int(t * 1000), 1, "remove", node))
        if t + repair_seconds < end:
            back.append((t + repair_seconds, node))
            timed.append((int((t + repair_seconds) * 1000), 0, "add", node))
    timed.sort()
    events += [TraceEvent(ms, action, node) for ms, _, action, node in timed]
    return tuple(events)
