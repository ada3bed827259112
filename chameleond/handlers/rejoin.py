"""`rejoin`: a worker outside the current plan (repaired, restarted) is available again. The
planner decides whether and how to take it back (decide(joined=...))."""

from __future__ import annotations

from chameleond.events import Rejoin
from chameleond.handlers.outcome import DUPLICATE, DUPLICATE_OWED, HANDLED, HANDLED_OWED, Outcome
from chameleond.jobstate.change import SNAPSHOT, recorded
from chameleond.jobstate.job import Job
from chameleond.protocol import EventError


def join(job: Job, worker: str, entry_id: str, now: float) -> Outcome:
    if _deciding(job, worker):
        job.owe(worker, entry_id)
        return DUPLICATE_OWED
    new, transitions = job.machine.join(worker, now)
    change = recorded(transitions)
    if not new:
        return DUPLICATE.having(change)
    # A new process: only a later generation can run it, so a fault seen up to this one is
    # about the process before it (chameleond/handlers/fault.py).
    job.worker(worker).since_generation = job.machine.generation + 1
    change |= SNAPSHOT | job.count_return(worker, now)
    if job.pending(worker):
        job.owe(worker, entry_id)
        return HANDLED_OWED.having(change)
    return HANDLED.having(change)


def _deciding(job: Job, worker: str) -> bool:
    """A decision about the worker is pending or running: its fault, its join, its failed
    restore. A running decision also lists every worker that was out before it (`failed`): a new
    process of one of those is a join for the next decision, not a duplicate of this one (a
    host's workers that come back together register while the first one's join is decided)."""
    m, flight = job.machine, job.machine.in_flight
    if flight is None or worker not in flight.failed or worker in flight.faults:
        return job.pending(worker)
    in_flight = worker in flight.joined or worker in flight.unrestorable
    waiting = worker in m.pending_faults or worker in m.pending_joins
    return in_flight or waiting or worker in m.pending_unrestorable


def handle_rejoin(job: Job, event: Rejoin, entry_id: str, now: float) -> Outcome:
    if not job.knows(event.worker) or not job.workers[event.worker].registered:
        raise EventError(f"rejoin from {event.worker!r}, which never registered: send register")
    job.new_process(event.worker)
    job.worker(event.worker).last_heartbeat = now
    return join(job, event.worker, entry_id, now)
