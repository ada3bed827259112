"""`heartbeat`: soft state only (the last time a worker was seen alive), O(1) per event."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event
from handlers import HANDLED, Outcome, handles

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("heartbeat")
def handle_heartbeat(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    # A heartbeat from an unknown worker is harmless noise: counted, not dead-lettered.
    job.heard(event.worker, now)
    return HANDLED
