"""`step`: a worker committed a step. Feeds measured throughput, the training figures (loss,
gradient norm, ...: counted once per step, not per worker) and recovery time; O(1)."""

from __future__ import annotations

from chameleond.events import Step
from chameleond.handlers.outcome import DUPLICATE, HANDLED, Outcome, reported_generation
from chameleond.jobstate.job import Job


def handle_step(job: Job, event: Step, entry_id: str, now: float) -> Outcome:
    generation = reported_generation(job, event)
    job.heard(event.worker, now)  # a committed step is as good as a heartbeat
    if generation == job.machine.generation and not job.machine.member(event.worker):
        return DUPLICATE  # a fenced worker's last step: not part of the plan's throughput
    fresh, change = job.observe_step(event, now)
    return (HANDLED if fresh else DUPLICATE).having(change)
