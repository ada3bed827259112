"""`profile`: measured per-layer costs from a worker; they replace the spec's numbers (the mean
over reporting workers) for every later decision."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from chameleond.daemon.jobspec import parse_profile
from chameleond.protocol import Event, EventError
from handlers import DUPLICATE, HANDLED, Outcome, handles

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("profile")
def handle_profile(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    if not job.knows(event.worker):
        raise EventError(f"profile from {event.worker!r}, not a worker of job {job.name!r}")
    profile = parse_profile(json.loads(event.get("data")), len(job.base_spec.layers))
    rec = job.worker(event.worker)
    if rec.profile == profile:
        return DUPLICATE
    rec.profile = profile
    job.spec_changed()
    return HANDLED
