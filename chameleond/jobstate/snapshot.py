"""A job's durable state as one JSON document, and back: what each commit that changed the state
persists (daemon/commits.py) and what a restarted daemon resumes from (daemon/service.py)."""

from __future__ import annotations

import time
from typing import Any

from chameleond.core.holdings import Checkpoints, of_plan
from chameleond.core.machine import PolicyMachine
from chameleond.core.plan import Plan, plan_to_dict
from chameleond.core.spec import WorkerSpec
from chameleond.jobstate.job import Job
from chameleond.jobstate.jobspec import profile_from_json, profile_to_json
from chameleond.jobstate.records import FollowUp, RebuildMeter, Registration
from chameleond.jobstate.slowness import Slowness


def snapshot(job: Job, plan: Plan | None = None) -> dict[str, Any]:
    """The job's durable state. It holds the current plan (`plan`: the one a commit is about
    to publish) as well: the plan key is what workers read, and anyone who can write to Redis
    can write there, so a restarted daemon resumes from this copy (daemon/service.py)."""
    current = plan or job.plan
    return {
        "plan": plan_document(current) if current is not None else None,
        "machine": job.machine.snapshot(),
        "started": job.started,
        "fault_times": job.decided_fault_times()[-1000:],
        "repairs": [list(r) for r in job.repairs],
        "last_decision": job.last_decision,
        "waiting_faults": job.waiting_faults(),  # shown by status, never restored
        "follow_up": job.follow_up.to_json() if job.follow_up is not None else None,
        "checkpoints": job.checkpoints.to_json(),
        "unconfirmed": {w: r.to_json() for w, r in job.unconfirmed.items()},
        "extra_workers": [
            {"id": w.id, "host": w.host, "memory_bytes": w.memory_bytes, "device": w.device}
            for w in job.extra_workers.values()
        ],
        "workers": {w.id: w.to_json() for w in job.workers.values()},
        # The planner's layer figures from the profiles, not every worker's profile: a job of
        # thousands of workers whose start-up profiles list every layer would weigh 100 MB.
        "measured_layers": profile_to_json(job.measured_means()),
        "rebuilds": job.rebuilds.to_json(),
        "slowness": job.slowness.to_json(),
        "links": job.links_view(),  # shown by status, never restored (the workers' links are)
    }


def plan_document(plan: Plan) -> dict[str, Any]:
    """`plan_to_dict(plan)`, made once per plan: the plan is frozen, and every snapshot holds
    the current one (the commit that publishes it signs the same document). Not to be changed."""
    cached = _PLAN_DOCUMENT[0]
    if cached is None or cached[0] is not plan:
        cached = _PLAN_DOCUMENT[0] = (plan, plan_to_dict(plan))
    return cached[1]


# The last plan serialised and its document (one reference, replaced whole).
_PLAN_DOCUMENT: list[tuple[Plan, dict[str, Any]] | None] = [None]


def restore(job: Job, snap: dict[str, Any], plan: Plan | None, *, ready_timeout: float) -> None:
    """Resume `job` from its snapshot (and the current plan, as the snapshot holds it)."""
    job.machine = PolicyMachine.restore(snap["machine"], ready_timeout_seconds=ready_timeout)
    if "holdings" not in snap["machine"] and plan is not None:
        # A snapshot from before holdings were kept: the current plan's owners hold its layers.
        job.machine.holdings.initial(plan.generation, of_plan(plan))
    job.plan = plan
    job.started = float(snap.get("started", 0.0))
    job.fault_times = [float(t) for t in snap.get("fault_times", [])]
    job.repairs = [(float(a), float(b)) for a, b in snap.get("repairs", [])]
    job.last_decision = snap.get("last_decision")
    fu = snap.get("follow_up")
    job.follow_up = FollowUp.from_json(fu) if fu else None
    job.checkpoints = Checkpoints.from_json(snap.get("checkpoints", {}))
    job.unconfirmed = {
        str(w): Registration.from_json(r) for w, r in snap.get("unconfirmed", {}).items()
    }
    for w in snap.get("extra_workers", []):
        job.extra_workers[w["id"]] = WorkerSpec(
            str(w["id"]), str(w["host"]), int(w["memory_bytes"]), str(w["device"])
        )
    for wid, d in snap.get("workers", {}).items():
        job.worker(wid).load(d)
    job.restored_layers = profile_from_json(snap.get("measured_layers", []))
    job.rebuilds = RebuildMeter.from_json(snap.get("rebuilds", {}))
    job.slowness = Slowness.from_json(snap.get("slowness", {}))
    now = time.time()
    # Nobody could acknowledge or heartbeat to a daemon that was down: start the clocks again.
    m = job.machine
    m.ready_deadline = max(m.ready_deadline, now + ready_timeout)
    for rec in job.workers.values():
        rec.last_heartbeat = now
    job.invalidate_spec()
