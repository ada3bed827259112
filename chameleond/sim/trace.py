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

Fail-slow: an event's `slowed` maps workers to the speed they compute at from then on (a share of
their own: 0.5 takes twice as long); 1.0 is the recovery. `synthetic_slow_trace` draws episodes
on the job's workers, `overlay` puts them on a fail-stop trace, and `evict_stragglers` turns the
part of an episode beyond a straggler timeout into a failure and a rejoin (what a baseline with a
timeout does).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from chameleond.core.spec import JobSpec
from chameleond.traces.replay import TraceEvent, plan_replay

LLAMA3_GPU_SECONDS_PER_INTERRUPTION = 54 * 86400 * 16384 / 419
# Fail-slow episodes (docs/simulator.md, "Fail-slow"): as frequent for the job as Llama 3's
# interruptions were for its 16,384-GPU job (an assumption); lasting from tens of seconds to
# nearly ten hours (FALCON, Wu et al., arXiv:2410.12588: a 10,000-GPU production cluster), drawn
# log-uniformly; the slow device at a quarter to three quarters of its speed (an assumption).
SLOW_EPISODES_PER_HOUR = 3600 * 16384 / LLAMA3_GPU_SECONDS_PER_INTERRUPTION
SLOW_FACTOR = (0.25, 0.75)
SLOW_SECONDS = (30.0, 10 * 3600.0)


@dataclass(frozen=True)
class JobEvent:
    seconds: float
    failed: frozenset[str]  # workers that fail now
    joined: frozenset[str]  # workers that come back now
    # worker -> the speed it computes at from now on (1.0: recovered from a fail-slow episode)
    slowed: Mapping[str, float] = field(default_factory=dict, hash=False)


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


def after(
    ev: JobEvent, down: frozenset[str], speeds: Mapping[str, float]
) -> tuple[frozenset[str], dict[str, float]]:
    """Who is down and the live workers that compute below full speed, after `ev`. A failure ends
    its worker's episode (it comes back on repaired hardware, at full speed); a down worker's
    slowdown changes nothing."""
    down = (down | ev.failed) - ev.joined
    slow = {w: f for w, f in speeds.items() if w not in down}
    for w, f in ev.slowed.items():
        if w in down:
            continue
        if f >= 1.0:
            slow.pop(w, None)
        else:
            slow[w] = f
    return down, slow


def merged(events: Sequence[JobEvent]) -> tuple[JobEvent, ...]:
    """The events in time order, those of one instant as one event."""
    out: list[JobEvent] = []
    for ev in sorted(events, key=lambda e: e.seconds):
        if out and out[-1].seconds == ev.seconds:
            last = out[-1]
            out[-1] = JobEvent(
                last.seconds,
                (last.failed - ev.joined) | ev.failed,
                (last.joined - ev.failed) | ev.joined,
                {**last.slowed, **ev.slowed},
            )
        else:
            out.append(ev)
    return tuple(out)


def synthetic_slow_trace(
    spec: JobSpec,
    *,
    hours: float,
    seed: int = 0,
    episodes_per_hour: float = SLOW_EPISODES_PER_HOUR,
    factor: tuple[float, float] = SLOW_FACTOR,
    seconds: tuple[float, float] = SLOW_SECONDS,
) -> JobTrace:
    """Fail-slow episodes over `hours`, a Poisson process of `episodes_per_hour` over the whole
    job: each slows one worker (drawn uniformly among those at full speed) to a speed drawn
    uniformly in `factor`, for a duration drawn log-uniformly in `seconds`; no worker fails."""
    rng = random.Random(seed)  # noqa: S311 - a seeded synthetic trace, not a secret
    ids = [w.id for w in spec.workers]
    end = hours * 3600.0
    t = 0.0
    until: dict[str, float] = {}  # slow worker -> when it recovers
    events: list[JobEvent] = []
    none: frozenset[str] = frozenset()
    while episodes_per_hour > 0:
        t += rng.expovariate(episodes_per_hour / 3600.0)
        if t >= end:
            break
        until = {w: u for w, u in until.items() if u > t}
        fast = [w for w in ids if w not in until]
        if not fast:
            continue
        w = rng.choice(fast)
        f = rng.uniform(*factor)
        d = math.exp(rng.uniform(math.log(seconds[0]), math.log(seconds[1])))
        until[w] = t + d
        events.append(JobEvent(t, none, none, {w: f}))
        if t + d < end:
            events.append(JobEvent(t + d, none, none, {w: 1.0}))
    return JobTrace(merged(events), 1, len(ids), 0, end)


def overlay(trace: JobTrace, slow: JobTrace) -> JobTrace:
    """`slow`'s episodes on the fail-stop `trace` (its span and node mapping): an episode whose
    worker is down at its onset is left out, one whose worker fails ends there."""
    down: frozenset[str] = frozenset()
    speeds: dict[str, float] = {}
    out: list[JobEvent] = []
    for ev in merged([*trace.events, *slow.events]):
        if ev.seconds >= trace.end_seconds:  # the fail-stop trace's own, past its span
            if ev.failed or ev.joined:
                out.append(replace(ev, slowed={}))
            continue
        gone = (down | ev.failed) - ev.joined
        kept = {w: f for w, f in ev.slowed.items() if w not in gone and (f < 1.0 or w in speeds)}
        ev = replace(ev, slowed=kept)
        down, speeds = after(ev, down, speeds)
        if ev.failed or ev.joined or ev.slowed:
            out.append(ev)
    return replace(trace, events=tuple(out))


def evict_stragglers(trace: JobTrace, timeout: float) -> JobTrace:
    """The trace as a policy with a straggler timeout sees it: a worker slow for `timeout` seconds
    is taken as failed then, and rejoins when its episode ends (at its recovery; a failure of its
    own later in the episode is already counted)."""
    since: dict[str, float] = {}  # slow worker -> onset of its episode
    evicted: set[str] = set()
    down: frozenset[str] = frozenset()
    speeds: dict[str, float] = {}
    out: list[JobEvent] = []
    none: frozenset[str] = frozenset()

    def evict_until(t: float) -> None:
        nonlocal down, speeds
        for w, s in sorted(since.items(), key=lambda x: x[1]):
            if s + timeout < t and w not in down:
                ev = JobEvent(s + timeout, frozenset({w}), none)
                down, speeds = after(ev, down, speeds)
                evicted.add(w)
                del since[w]
                out.append(ev)

    for ev in trace.events:
        evict_until(min(ev.seconds, trace.end_seconds))
        back = {w for w, f in ev.slowed.items() if w in evicted and f >= 1.0}
        evicted.difference_update(back | ev.failed)
        ev = replace(
            ev,
            failed=ev.failed - down,
            joined=ev.joined | back,
            slowed={w: f for w, f in ev.slowed.items() if w not in back},
        )
        down, speeds = after(ev, down, speeds)
        since = {w: since.get(w, ev.seconds) for w in speeds}
        out.append(ev)
    evict_until(trace.end_seconds)
    return replace(trace, events=merged(out))
