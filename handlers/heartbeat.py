"""`heartbeat`: soft state only (the last time a worker was seen alive), O(1) per event."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event
from handlers import HANDLED, Outcome, handles

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("heartbeat")
def handle_heartbeat(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    rec = job.workers.get(event.worker)
    if rec is not None:
        rec.last_heartbeat = now
    # A heartbeat from an unknown worker is harmless noise: counted, not dead-lettered.
    return HANDLED
