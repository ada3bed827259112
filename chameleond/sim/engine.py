"""`simulate`: one policy over one trace; `compare`: every policy, with the ratios and the ideal.

The ideal at time t is the proportional one: (the live workers' speeds summed / N) x the
failure-free throughput (B over the initial plan's step); a worker at full speed counts 1. A
policy's gap to it is 1 - its average throughput / the ideal's average over the same span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chameleond.core.decide import decide
from chameleond.core.plan import Plan
from chameleond.core.spec import JobSpec
from chameleond.sim.policies import (
    POLICIES,
    SLOW_AWARE,
    JobState,
    Record,
    SimConfig,
    make_policy,
)
from chameleond.sim.timeline import KINDS, Kind, Segment
from chameleond.sim.trace import JobTrace, after, evict_stragglers


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    average_throughput: float  # useful samples per second over the trace
    ideal_throughput: float  # the proportional ideal's average
    gap_to_ideal: float
    breakdown: dict[Kind, float]  # seconds per segment kind
    segments: tuple[Segment, ...]
    records: tuple[Record, ...] = field(default=())
    plan: Plan | None = None  # the plan the policy runs when the trace ends

    def to_dict(self, with_segments: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "average_throughput": self.average_throughput,
            "ideal_throughput": self.ideal_throughput,
            "gap_to_ideal": self.gap_to_ideal,
            "breakdown_seconds": self.breakdown,
            "decisions": len(self.records),
            "selected": _count(r.selected or "none" for r in self.records),
        }
        if with_segments:
            out["segments"] = [[s.start, s.end, s.kind, s.throughput] for s in self.segments]
        return out


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


def ideal_average(spec: JobSpec, trace: JobTrace, failure_free: float) -> float:
    """Average of (live workers' speeds / N) x failure-free throughput over [0, end)."""
    n = len(spec.workers)
    down: frozenset[str] = frozenset()
    speeds: dict[str, float] = {}

    def share() -> float:
        return (n - len(down) - sum(1 - s for s in speeds.values())) / n

    area, last = 0.0, 0.0
    for ev in trace.events:
        t = min(ev.seconds, trace.end_seconds)
        area += (t - last) * share()
        last = t
        down, speeds = after(ev, down, speeds)
    area += max(0.0, trace.end_seconds - last) * share()
    return failure_free * area / trace.end_seconds if trace.end_seconds > 0 else failure_free


def failure_free_throughput(spec: JobSpec, initial: Plan) -> float:
    """B over the faster of the initial plan's step and the best plan the search finds over
    every worker: the reference a policy's throughput is compared with."""
    every = decide(spec, initial, [], mtbf_seconds=spec.mtbf_prior_seconds, generation=2)
    dyn = every.candidates[1]
    step = min(initial.estimates.step_seconds, dyn.step_seconds)
    return spec.training.global_batch / step


def simulate(
    spec: JobSpec, trace: JobTrace, policy: str, cfg: SimConfig | None = None
) -> PolicyResult:
    pol = make_policy(policy, spec, cfg)
    timeout = pol.cfg.straggler_timeout_seconds
    seen = trace if timeout is None or policy in SLOW_AWARE else evict_stragglers(trace, timeout)
    tl = pol.start()
    down: frozenset[str] = frozenset()
    for ev in seen.events:
        if ev.seconds >= trace.end_seconds:
            break
        tl.play(ev.seconds)
        down = (down | ev.failed) - ev.joined
        pol.event(tl, ev, down)
    tl.play(trace.end_seconds)
    end = trace.end_seconds
    breakdown = dict.fromkeys(KINDS, 0.0)
    for s in tl.segments:
        breakdown[s.kind] += s.end - s.start
    useful = sum((s.end - s.start) * s.throughput for s in tl.segments)
    average = useful / end if end > 0 else 0.0
    failure_free = failure_free_throughput(spec, pol.initial)
    ideal = ideal_average(spec, trace, failure_free)
    gap = 1 - average / ideal if ideal > 0 else 0.0
    return PolicyResult(
        policy, average, ideal, gap, breakdown, tuple(tl.segments), tuple(pol.records),
        tl.state.plan if isinstance(tl.state, JobState) else None,
    )  # fmt: skip


def compare(
    spec: JobSpec,
    trace: JobTrace,
    policies: Sequence[str] = POLICIES,
    cfg: SimConfig | None = None,
) -> dict[str, Any]:
    """Every policy over the trace, as the `chameleonctl simulate --json` object."""
    results = {p: simulate(spec, trace, p, cfg) for p in policies}
    out: dict[str, Any] = {
        "job": spec.name,
        "devices": len(spec.workers),
        "devices_per_node": trace.devices_per_node,
        "events": len(trace.events),
        "skipped_trace_events": trace.skipped,
        "slow_episodes": sum(f < 1.0 for e in trace.events for f in e.slowed.values()),
        "seconds": trace.end_seconds,
        "policies": {p: r.to_dict() for p, r in results.items()},
    }
    if "chameleon" in results:
        ours = results["chameleon"].average_throughput
        out["chameleon_ratio"] = {
            p: (ours / r.average_throughput if r.average_throughput > 0 else None)
            for p, r in results.items()
            if p != "chameleon"
        }
    out["_results"] = results
    return out
