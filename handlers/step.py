"""`step`: a worker committed a step. Feeds measured throughput and recovery time; O(1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event
from handlers import DUPLICATE, HANDLED, Outcome, handles

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("step")
def handle_step(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    rec = job.workers.get(event.worker)
    if rec is not None:
        rec.last_heartbeat = now  # a committed step is as good as a heartbeat
    fresh = job.observe_step(
        event.worker,
        int(event.get("generation")),
        int(event.get("step")),
        int(event.get("samples")),
        float(event.get("seconds")),
        float(event.get("loss")),
        now,
    )
    return HANDLED if fresh else DUPLICATE
