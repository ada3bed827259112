"""An in-memory job of the packaged spec driven through the daemon's handler table (no I/O)."""

from __future__ import annotations

from chameleond.core.machine import Phase, PolicyMachine
from chameleond.daemon.dispatch import dispatch
from chameleond.handlers.outcome import Outcome
from chameleond.jobs import load_default_spec
from chameleond.jobstate.job import Job
from chameleond.protocol import parse_event

SPEC = load_default_spec()
WORKERS = tuple(w.id for w in SPEC.workers)


def job(registration_ttl_seconds: float = 60.0) -> Job:
    return Job(
        "t", SPEC, policy="adaptive", machine=PolicyMachine(),
        registration_ttl_seconds=registration_ttl_seconds,
    )  # fmt: skip


def send(j: Job, entry: str = "1-0", now: float = 1.0, **fields: object) -> Outcome:
    """One event, as its stream fields, parsed and handled like the daemon does."""
    return dispatch(j, parse_event({k: str(v) for k, v in fields.items()}), entry, now)


def training_job(registration_ttl_seconds: float = 60.0) -> Job:
    """Every worker of the spec registered and ready on generation 1: the job trains."""
    j = job(registration_ttl_seconds)
    for w in WORKERS:
        send(j, type="register", worker=w, host="localhost", memory_bytes=2**31)
    j.machine.initial(1, WORKERS, 1.0)
    for w in WORKERS:
        send(j, type="ack", worker=w, generation=1, phase="ready")
    assert j.machine.phase is Phase.TRAINING
    return j
