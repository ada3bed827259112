"""`profile`: measured per-layer costs from a worker; they replace the spec's numbers (the mean
over the workers' newest reports) for every later decision. A CPU worker's report also carries
its host's measured capacity (cores the job's workers get), folded into the spec's host cores."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from chameleond.daemon.jobspec import fold_host_report, parse_host_report, parse_profile
from chameleond.protocol import Event, EventError
from handlers import DUPLICATE, HANDLED, Outcome, handles

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("profile")
def handle_profile(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    if not job.knows(event.worker):
        raise EventError(f"profile from {event.worker!r}, not a worker of job {job.name!r}")
    data = json.loads(event.get("data"))  # parse_event checked: an object with 'layers'
    profile = parse_profile(data, len(job.base_spec.layers))
    host = parse_host_report(data)
    rec = job.worker(event.worker)
    if rec.profile == profile and host is None:
        return DUPLICATE
    rec.profile = profile
    if host is not None:
        # Held in the job's base spec: a measurement like the profiles, re-sent periodically, so
        # a restarted daemon has it again within one reporting period.
        on_host = [w.id for w in job.base_spec.workers if w.host == host.host]
        if job.plan is not None:
            on_host = [w for w in on_host if w in job.plan.workers]
        job.base_spec = fold_host_report(job.base_spec, host, len(on_host))
    job.spec_changed()
    return HANDLED
