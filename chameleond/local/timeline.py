"""What a local run recorded, turned into a timeline: committed steps and decisions, and what the
workers measured of a generation's rebuild.

Every time here is a measurement: a Redis stream entry id is the millisecond at which Redis stored
the entry, so the events stream (step, fault, ack events) and the daemon's decisions stream give
when things happened without trusting any process's clock but Redis's. A step is committed on a
plan generation when every worker that reports steps for that generation has reported it; its
commit time is the latest of those reports.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from chameleond.core.spec import backend_of
from chameleond.events import Ack, AckPhase, Step
from chameleond.protocol import EventError, parse_event
from chameleond.records import Entry, entry_seconds


@dataclass(frozen=True)
class CommittedStep:
    generation: int
    step: int
    at: float  # commit time (unix seconds): the last worker's report
    loss: float | None
    samples: int
    seconds: float  # the slowest worker's measured step seconds


def committed_steps(
    events: Sequence[Entry], members: Mapping[int, Collection[str]] | None = None
) -> list[CommittedStep]:
    """Group step events by (generation, step). A step commits once every worker of its plan has
    reported it (`members`: generation -> workers); where a plan is unknown, every worker that
    reported any step of that generation."""
    reports: dict[tuple[int, int], list[tuple[float, Step]]] = defaultdict(list)
    reporters: dict[int, set[str]] = defaultdict(set)
    for entry_id, f in events:
        if f.get("type") != "step":
            continue
        try:
            step = parse_event(f)
        except EventError:
            continue  # the daemon dead-letters it: never committed
        if not isinstance(step, Step):
            continue
        reports[(step.generation, step.step)].append((entry_seconds(entry_id), step))
        reporters[step.generation].add(step.worker)
    out: list[CommittedStep] = []
    for (gen, number), rows in reports.items():
        need = set(members[gen]) if members and gen in members else reporters[gen]
        if not need <= {s.worker for _, s in rows}:
            continue  # not every worker of the generation reported it: not committed
        out.append(
            CommittedStep(
                generation=gen,
                step=number,
                at=max(t for t, _ in rows),
                # Workers without the model's head report no loss (or 0); the head's is the loss.
                loss=max(s.loss for _, s in rows),
                samples=max(s.samples for _, s in rows),
                seconds=max(s.seconds for _, s in rows),
            )
        )
    out.sort(key=lambda c: (c.at, c.step))
    return out


def median_interval(steps: Sequence[CommittedStep]) -> float | None:
    """Median time between consecutive commits (the measured step period)."""
    gaps = [b.at - a.at for a, b in itertools.pairwise(steps) if b.at > a.at]
    return statistics.median(gaps) if gaps else None


def group_rebuild_seconds(events: Sequence[Entry], generation: int) -> dict[str, float]:
    """Per backend, the slowest worker's build of `generation`'s process groups: its `ack` ready's
    build_seconds less migration_seconds (`Ack.rebuild_seconds`: the rendezvous included, the
    state transfer not), the backend from the device it registered with. What the daemon prices
    a new plan's rebuild at once measured (docs/planner.md, "The rebuild")."""
    devices: dict[str, str] = {}
    slowest: dict[str, float] = {}
    for _, f in events:
        if f.get("type") == "register":
            devices[f.get("worker", "")] = f.get("device") or "cpu"
        if f.get("type") != "ack" or f.get("generation") != str(generation):
            continue
        try:
            ack = parse_event(f)
        except EventError:
            continue  # the daemon dead-letters it: no measurement
        if not isinstance(ack, Ack) or ack.phase is not AckPhase.READY:
            continue
        seconds = ack.rebuild_seconds()
        if seconds is not None:
            backend = backend_of(devices.get(ack.worker, "cpu"))
            slowest[backend] = max(slowest.get(backend, 0.0), seconds)
    return {b: round(s, 4) for b, s in sorted(slowest.items())}
