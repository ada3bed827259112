"""`fault`: a worker (or a node, named like a worker) is out. New faults wait for the next
decision; the entry is acknowledged when that decision is committed. A fault a worker reports
carries the generation it saw the peer fail in; one from before the named worker was taken into
the plans again is about its earlier process, and changes nothing. A raw error text (a peer's
collective error) is recorded as a short cause, the text itself kept as the decision's `detail`
(chameleond.handlers.cause)."""

from __future__ import annotations

from chameleond.events import Fault
from chameleond.handlers.cause import readable
from chameleond.handlers.outcome import DUPLICATE, DUPLICATE_OWED, HANDLED, HANDLED_OWED, Outcome
from chameleond.jobstate.change import recorded
from chameleond.jobstate.job import Job
from chameleond.protocol import EventError


def handle_fault(job: Job, event: Fault, entry_id: str, now: float) -> Outcome:
    worker = event.worker
    if not job.knows(worker):
        raise EventError(f"fault names {worker!r}, which is not a worker of job {job.name!r}")
    cause, detail = readable(event.cause)
    if event.generation is not None and job.stale_fault(worker, event.generation):
        return DUPLICATE
    if job.pending(worker):
        # Already part of the next decision: ack with it, never earlier.
        job.owe(worker, entry_id)
        return DUPLICATE_OWED
    new, transitions = job.machine.fault(worker, cause, now, detail=detail)
    change = recorded(transitions)
    if not new:
        return DUPLICATE.having(change)
    change |= job.count_fault(worker, now)
    if job.pending(worker):
        job.owe(worker, entry_id)
        return HANDLED_OWED.having(change)
    # The worker ran nothing: marked failed in the snapshot committed with the ack.
    return HANDLED.having(change)
