"""`ack`: phase=ready (the worker built the generation's process groups and finished migration)
or phase=stopped (a fenced worker stopped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event
from handlers import DUPLICATE, HANDLED, Outcome, handles

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("ack")
def handle_ack(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    generation = int(event.get("generation"))
    rec = job.workers.get(event.worker)
    if rec is not None:
        rec.last_heartbeat = now
    if event.get("phase") == "stopped":
        if rec is None or rec.stopped_generation >= generation:
            return DUPLICATE
        rec.stopped_generation = generation
        job.dirty = True
        return HANDLED
    job.observe_attempt(generation, int(event.get("attempt", "1")))  # validated by parse_event
    acked, transitions = job.machine.ready(event.worker, generation, now)
    job.record(transitions)
    if not acked:
        return DUPLICATE
    job.dirty = True
    return HANDLED
