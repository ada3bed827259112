"""`profile`: measured per-layer costs from a worker; they replace the spec's numbers (the mean
over the workers' newest reports) for every later decision. A CPU worker's report also carries
its host's measured capacity (cores the job's workers get, over the fraction of them the plan it
was measured on keeps busy), folded into the spec's host cores. A profile may carry the links the
worker measured to its pipeline neighbours (jobstate/links.py): the newest replace the worker's
earlier ones, and the slowest of each kind replace the spec's link figures."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chameleond.core.machine import Phase
from chameleond.core.spec import JobSpec, LayerProfile, LinkSpec
from chameleond.events import Profile
from chameleond.handlers.outcome import DUPLICATE, HANDLED, Outcome
from chameleond.handlers.register import admitted
from chameleond.jobstate.change import Change
from chameleond.jobstate.job import Job
from chameleond.jobstate.jobspec import fold_profile
from chameleond.jobstate.links import parse_links
from chameleond.protocol import EventError


def handle_profile(job: Job, event: Profile, entry_id: str, now: float) -> Outcome:
    _, expired = job.expire_unconfirmed(now)  # a profile after the TTL confirms nothing
    return _handle(job, event, entry_id, now).having(expired)


def _handle(job: Job, event: Profile, entry_id: str, now: float) -> Outcome:
    held = job.unconfirmed.get(event.worker)
    if not job.knows(event.worker) and held is None:
        raise EventError(f"profile from {event.worker!r}, not a worker of job {job.name!r}")
    data = event.data
    if held is not None:
        # The profile a worker outside the spec sends after `register` confirms it (a bad one
        # raises and leaves the registration held).
        change = job.confirm(event.worker)
        try:
            spec, profile, has_host = _folded(job, data)
            links = parse_links(data, _worker_count(job))
        except (EventError, ValueError, KeyError, TypeError):
            job.unconfirm(event.worker, held)  # as it was: nothing to persist
            raise
        change |= _fold(job, event.worker, spec, profile, links)
        if job.machine.phase is Phase.WAITING:
            return HANDLED.having(change)
        return admitted(job, event.worker, entry_id, now, changed=True).having(change)
    # Held in the job's base spec: a measurement like the profiles, re-sent periodically, so a
    # restarted daemon has it again within one reporting period.
    spec, profile, has_host = _folded(job, data)
    links = parse_links(data, _worker_count(job))
    rec = job.worker(event.worker)
    # Every training report reaches the slowness detector, a repeat of the last one too: a
    # worker's speed is a matter of how long it stays where it is.
    observed = job.observe_profile(event.worker, data, profile, now)
    if rec.profile == profile and not has_host and links in (None, rec.links):
        return DUPLICATE.having(observed)
    return HANDLED.having(_fold(job, event.worker, spec, profile, links) | observed)


def _folded(job: Job, data: Mapping[str, Any]) -> tuple[JobSpec, dict[int, LayerProfile], bool]:
    """`fold_profile` of the event's data. Only a host report needs the planner's spec (the
    plan's busy fraction of the host): the measured spec is not derived for the others, which
    come constantly (one per worker per reporting period)."""
    model = job.spec if "host" in data else job.base_spec
    return fold_profile(job.base_spec, data, job.plan, model)


def _worker_count(job: Job) -> int:
    """The workers of the planner's spec: the base spec's and those registered beyond it."""
    return len(job.base_spec.workers) + len(job.extra_workers)


def _fold(
    job: Job,
    worker: str,
    spec: JobSpec,
    profile: dict[int, LayerProfile],
    links: dict[str, LinkSpec] | None,
) -> Change:
    rec = job.worker(worker)
    rec.profile = profile
    if links is not None:  # a profile without links keeps the worker's newest
        rec.links = links
    job.base_spec = spec
    return job.measured_changed()
