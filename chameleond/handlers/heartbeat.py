"""`heartbeat`: soft state only (the last time a worker was seen alive), O(1) per event."""

from __future__ import annotations

from chameleond.events import Heartbeat
from chameleond.handlers.outcome import HANDLED, Outcome
from chameleond.jobstate.job import Job


def handle_heartbeat(job: Job, event: Heartbeat, entry_id: str, now: float) -> Outcome:
    # A heartbeat from an unknown worker is harmless noise: counted, not dead-lettered.
    job.heard(event.worker, now)
    return HANDLED
