"""`ack`: a worker's answer to a plan generation. phase=ready: it built the generation's process
groups and finished migration; what the build cost it, migration excluded, is the measured
communicator rebuild the planner uses from then on for its backend (`Job.rebuild_seconds`).
phase=stopped: it stopped: fenced, or on its own as a member of the plan (`reason` finished: it
committed its last step; left: stopped by a signal), which is no failure; once every worker of
the plan has finished, the job is `finished`.
phase=unrestorable: the plan is a `restore` and the worker cannot load its layers from the
checkpoint of `step` (files missing or unreadable there); the restore is decided again from an
older checkpoint, and the entry is acknowledged with that decision."""

from __future__ import annotations

from chameleond.events import Ack, AckPhase
from chameleond.handlers.outcome import (
    DUPLICATE,
    DUPLICATE_OWED,
    HANDLED,
    HANDLED_OWED,
    Outcome,
    reported_generation,
)
from chameleond.jobstate.change import SNAPSHOT, UNCHANGED, recorded, snapshot_if
from chameleond.jobstate.job import Job
from chameleond.jobstate.records import WorkerState


def handle_ack(job: Job, event: Ack, entry_id: str, now: float) -> Outcome:
    generation = reported_generation(job, event)
    job.heard(event.worker, now)
    if event.phase is AckPhase.STOPPED:
        return _stopped(job, event, entry_id, generation, now)
    if event.phase is AckPhase.UNRESTORABLE:
        return _unrestorable(job, event, entry_id, generation, now)
    change = UNCHANGED
    if job.machine.member(event.worker):  # a member's rebuilds, nobody else's
        job.observe_attempt(generation, event.attempt)
        rebuild = event.rebuild_seconds()
        if rebuild is not None and generation == job.machine.generation:
            change = job.observe_rebuild(event.worker, generation, rebuild)
    acked, transitions = job.machine.ready(event.worker, generation, now)
    change |= recorded(transitions)
    if not acked:
        return DUPLICATE.having(change)
    return HANDLED.having(change | SNAPSHOT)


def _stopped(job: Job, event: Ack, entry_id: str, generation: int, now: float) -> Outcome:
    """A worker stopped. Fenced (outside the plan it names): it obeyed. A member of the current
    plan stopping on its own finished its steps, or left (`reason=left`): it is never declared
    failed, and one that left is taken out of the plans like a fault, without counting one. A
    process finishes or leaves from the plan it was in, which a newer plan may since have replaced
    (its last step committed, or the signal came, while that plan was on its way): it still
    finished or left, unless the worker came back after it."""
    rec = job.workers[event.worker]
    m = job.machine
    left = event.reason == "left"
    on_its_own = event.reason in ("finished", "left")
    current = generation == m.generation or (on_its_own and rec.since_generation <= generation)
    member = (
        current
        and generation <= m.generation
        and m.member(event.worker)
        and not job.declared_failed(event.worker)
    )
    if not member or (rec.ended is not None and rec.stopped_generation >= generation):
        if rec.stopped_generation >= generation:
            return DUPLICATE
        rec.stopped_generation = generation
        return HANDLED.having(SNAPSHOT)
    rec.stopped_generation = generation
    rec.ended = WorkerState.LEFT if left else WorkerState.FINISHED
    if rec.ended is WorkerState.FINISHED:
        # Its peers finish at the same step: nothing to decide. Once all have, the job is done.
        return HANDLED.having(SNAPSHOT | recorded(job.finish_if_done(now)))
    new, transitions = m.fault(event.worker, "left the job", now)
    change = SNAPSHOT | recorded(transitions)
    if new and job.pending(event.worker):
        job.owe(event.worker, entry_id)  # acknowledged with the plan that lets it go
        return HANDLED_OWED.having(change)
    return HANDLED.having(change)


def _unrestorable(job: Job, event: Ack, entry_id: str, generation: int, now: float) -> Outcome:
    step = event.step
    plan = job.plan
    if plan is None or plan.generation != generation or plan.restore_step != step:
        return DUPLICATE  # about a plan already replaced
    change = snapshot_if(job.checkpoints.cannot_load(step, generation))
    cause = event.cause or f"cannot load the checkpoint of step {step}"
    new, transitions = job.machine.unrestorable(event.worker, cause, now)
    change |= recorded(transitions)
    if new or job.pending(event.worker):  # answered by the next decision's commit
        job.owe(event.worker, entry_id)
        return (HANDLED_OWED if new else DUPLICATE_OWED).having(change)
    return DUPLICATE.having(change)
