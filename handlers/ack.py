"""`ack`: a worker's answer to a plan generation. phase=ready: it built the generation's process
groups and finished migration. phase=stopped: fenced, it stopped. phase=unrestorable: the plan is
a `restore` and the worker cannot load its layers from the checkpoint of `step` (files missing or
unreadable there); the restore is decided again from an older checkpoint, and the entry is
acknowledged with that decision."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event
from handlers import (
    DUPLICATE,
    DUPLICATE_OWED,
    HANDLED,
    HANDLED_OWED,
    Outcome,
    handles,
    reported_generation,
)

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("ack")
def handle_ack(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    generation = reported_generation(job, event)
    rec = job.workers[event.worker]
    rec.last_heartbeat = now
    phase = event.get("phase")
    if phase == "stopped":
        if rec.stopped_generation >= generation:
            return DUPLICATE
        rec.stopped_generation = generation
        job.dirty = True
        return HANDLED
    if phase == "unrestorable":
        return _unrestorable(job, event, entry_id, generation, now)
    if event.worker in job.machine.plan_workers:  # a member's rebuilds, nobody else's
        job.observe_attempt(generation, int(event.get("attempt", "1")))  # validated
    acked, transitions = job.machine.ready(event.worker, generation, now)
    job.record(transitions)
    if not acked:
        return DUPLICATE
    job.dirty = True
    return HANDLED


def _unrestorable(job: Job, event: Event, entry_id: str, generation: int, now: float) -> Outcome:
    step = int(event.get("step"))  # validated
    plan = job.plan
    if plan is None or plan.generation != generation or plan.restore_step != step:
        return DUPLICATE  # about a plan already replaced
    if job.checkpoints.cannot_load(step, generation):
        job.dirty = True
    cause = event.get("cause") or f"cannot load the checkpoint of step {step}"
    new, transitions = job.machine.unrestorable(event.worker, cause, now)
    job.record(transitions)
    if new or job.pending(event.worker):  # answered by the next decision's commit
        job.owe(event.worker, entry_id)
        return HANDLED_OWED if new else DUPLICATE_OWED
    return DUPLICATE
