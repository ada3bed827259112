"""`register`: a worker announces itself (host, device, memory). Before the initial plan this
counts towards --min-workers; afterwards a worker outside the current plan is a join.

A worker the spec does not list becomes one of the job's workers only once its profile follows
(workers send `register` then `profile`, chameleond/worker/_startup.py): until then its registration
is held (`Job.unconfirmed`), for at most the registration TTL and with at most UNCONFIRMED_MAX held
at once, so registrations nobody follows up can neither pile up nor be planned in."""

from __future__ import annotations

from chameleond.core.machine import Phase
from chameleond.core.spec import WorkerSpec
from chameleond.events import Register
from chameleond.handlers.outcome import DUPLICATE, HANDLED, Outcome
from chameleond.handlers.rejoin import join
from chameleond.jobstate.change import UNCHANGED
from chameleond.jobstate.job import Job
from chameleond.jobstate.records import UNCONFIRMED_MAX, Registration
from chameleond.protocol import EventError


def handle_register(job: Job, event: Register, entry_id: str, now: float) -> Outcome:
    host, device, memory = event.host, event.device, event.memory_bytes
    if not job.knows(event.worker):
        held = job.await_profile(event.worker, Registration(host, memory, device, now))
        if held is None:
            raise EventError(
                f"register from {event.worker!r}, not a worker of the spec: "
                f"{UNCONFIRMED_MAX} registrations already wait for their profile"
            )
        return HANDLED.having(held)
    rec = job.worker(event.worker)
    known = (rec.host, rec.device, rec.memory_bytes, rec.registered)
    changed = known != (host, device, memory, True)
    rec.host, rec.device, rec.memory_bytes, rec.registered = host, device, memory, True
    ended = rec.ended is not None
    job.new_process(event.worker)
    rec.last_heartbeat = now
    if event.worker in job.extra_workers and changed:
        job.extra_workers[event.worker] = WorkerSpec(event.worker, host, memory, device)
    change = job.spec_changed() if changed or ended else UNCHANGED
    if job.machine.phase is Phase.WAITING:
        return (HANDLED if changed else DUPLICATE).having(change)
    return admitted(job, event.worker, entry_id, now, changed).having(change)


def admitted(job: Job, worker: str, entry_id: str, now: float, changed: bool) -> Outcome:
    """A registered worker (of the spec, or confirmed by its profile) outside the current plan
    is a join."""
    outcome = join(job, worker, entry_id, now)
    # The registration itself is new information even when the join is not.
    return HANDLED.having(outcome.change) if changed and outcome.duplicate else outcome
