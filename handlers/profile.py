"""`profile`: measured per-layer costs from a worker; they replace the spec's numbers (the mean
over the workers' newest reports) for every later decision. A CPU worker's report also carries
its host's measured capacity (cores the job's workers get, over the fraction of them the plan it
was measured on keeps busy), folded into the spec's host cores."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from chameleond.daemon.jobspec import fold_profile
from chameleond.protocol import Event, EventError
from handlers import DUPLICATE, HANDLED, Outcome, handles

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("profile")
def handle_profile(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    if not job.knows(event.worker):
        raise EventError(f"profile from {event.worker!r}, not a worker of job {job.name!r}")
    data = json.loads(event.get("data"))  # parse_event checked: an object with 'layers'
    # Held in the job's base spec: a measurement like the profiles, re-sent periodically, so a
    # restarted daemon has it again within one reporting period.
    spec, profile, has_host = fold_profile(job.base_spec, data, job.plan, job.spec)
    rec = job.worker(event.worker)
    if rec.profile == profile and not has_host:
        return DUPLICATE
    rec.profile = profile
    job.base_spec = spec
    job.spec_changed()
    return HANDLED
