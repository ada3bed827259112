"""`register`: a worker announces itself (host, device, memory). Before the initial plan this
counts towards --min-workers; afterwards a worker outside the current plan is a join."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.core.machine import Phase
from chameleond.core.spec import WorkerSpec
from chameleond.protocol import Event
from handlers import DUPLICATE, HANDLED, Outcome, handles
from handlers.rejoin import join

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("register")
def handle_register(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    rec = job.worker(event.worker)
    host, device = event.get("host"), event.get("device", "cpu") or "cpu"
    memory = int(event.get("memory_bytes"))
    known = (rec.host, rec.device, rec.memory_bytes, rec.registered)
    changed = known != (host, device, memory, True)
    rec.host, rec.device, rec.memory_bytes, rec.registered = host, device, memory, True
    rec.last_heartbeat = now
    in_spec = any(w.id == event.worker for w in job.base_spec.workers)
    if not in_spec and changed:
        # A new worker: the planner needs its host and memory to place anything on it.
        job.extra_workers[event.worker] = WorkerSpec(event.worker, host, memory, device)
    if changed:
        job.spec_changed()
    if job.machine.phase is Phase.WAITING:
        return HANDLED if changed else DUPLICATE
    outcome = join(job, event.worker, entry_id, now)
    # The registration itself is new information even when the join is not.
    return HANDLED if changed and outcome.duplicate else outcome
