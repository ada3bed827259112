"""`ack`: phase=ready (the worker built the generation's process groups and finished migration)
or phase=stopped (a fenced worker stopped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event
from handlers import DUPLICATE, HANDLED, Outcome, handles, reported_generation

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("ack")
def handle_ack(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    generation = reported_generation(job, event)
    rec = job.workers[event.worker]
    rec.last_heartbeat = now
    if event.get("phase") == "stopped":
        if rec.stopped_generation >= generation:
            return DUPLICATE
        rec.stopped_generation = generation
        job.dirty = True
        return HANDLED
    if event.worker in job.machine.plan_workers:  # a member's rebuilds, nobody else's
        job.observe_attempt(generation, int(event.get("attempt", "1")))  # validated
    acked, transitions = job.machine.ready(event.worker, generation, now)
    job.record(transitions)
    if not acked:
        return DUPLICATE
    job.dirty = True
    return HANDLED
