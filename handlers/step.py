"""`step`: a worker committed a step. Feeds measured throughput and recovery time; O(1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event
from handlers import DUPLICATE, HANDLED, Outcome, handles, reported_generation

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("step")
def handle_step(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    generation = reported_generation(job, event)
    job.heard(event.worker, now)  # a committed step is as good as a heartbeat
    if generation == job.machine.generation and event.worker not in job.machine.plan_workers:
        return DUPLICATE  # a fenced worker's last step: not part of the plan's throughput
    fresh = job.observe_step(
        event.worker,
        generation,
        int(event.get("step")),
        int(event.get("samples")),
        float(event.get("seconds")),
        float(event.get("loss")),
        now,
    )
    return HANDLED if fresh else DUPLICATE
