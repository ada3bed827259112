"""A job's durable state as one JSON document, and back: what each commit that changed the state
persists (daemon/commits.py) and what a restarted daemon resumes from (daemon/service.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from chameleond.auth import JsonText, canonical
from chameleond.core.holdings import Checkpoints, Interval, of_plan
from chameleond.core.machine import PolicyMachine
from chameleond.core.plan import Plan, plan_to_dict
from chameleond.core.spec import WorkerSpec
from chameleond.jobstate.job import Job
from chameleond.jobstate.jobspec import profile_from_json, profile_to_json
from chameleond.jobstate.records import FollowUp, RebuildMeter, Registration
from chameleond.jobstate.slowness import Slowness


def snapshot(
    job: Job, plan: Plan | None = None, texts: WorkerTexts | None = None
) -> dict[str, Any]:
    """The job's durable state. It holds the current plan (`plan`: the one a commit is about
    to publish) as well: the plan key is what workers read, and anyone who can write to Redis
    can write there, so a restarted daemon resumes from this copy (daemon/service.py).
    With `texts`, the per-worker members are their canonical text (`WorkerTexts`)."""
    current = plan or job.plan
    if texts is None:
        machine: Any = job.machine.snapshot()
        workers: Any = {w.id: w.to_json() for w in job.workers.values()}
        slowness: Any = job.slowness.to_json()
    else:
        machine, workers, slowness = texts.machine(job), texts.workers(job), texts.slowness(job)
    return {
        "plan": plan_document(current) if current is not None else None,
        "machine": machine,
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
        "workers": workers,
        # The planner's layer figures from the profiles, not every worker's profile: a job of
        # thousands of workers whose start-up profiles list every layer would weigh 100 MB.
        "measured_layers": profile_to_json(job.measured_means()),
        "rebuilds": job.rebuilds.to_json(),
        "slowness": slowness,
        "links": job.links_view(),  # shown by status, never restored (the workers' links are)
    }


class WorkerTexts:
    """The snapshot's members with a part per worker (`workers`, `slowness`, the holdings of
    `machine`) as canonical JSON text, each worker's part encoded again only when its document
    (its intervals, for the holdings) differs from the one its text was made from: at 8,192
    workers they are 2.5 MB of the snapshot, and between two snapshots few workers change. The
    text is `canonical` of the documents `snapshot` makes without it."""

    def __init__(self) -> None:
        # (member, worker) -> (what the worker's part was made from, '"worker":{...}')
        self._parts: dict[tuple[str, str], tuple[Any, str]] = {}

    def workers(self, job: Job) -> JsonText:
        part = self._part
        return _object({w.id: part("workers", w.id, w.to_json()) for w in job.workers.values()})

    def slowness(self, job: Job) -> JsonText:
        s, part = job.slowness, self._part
        workers = _object({w: part("slowness", w, ws.to_json()) for w, ws in s.workers.items()})
        episodes = canonical([list(e) for e in s.episodes])
        return JsonText(f'{{"episodes":{episodes},"workers":{workers}}}')

    def machine(self, job: Job) -> JsonText:
        h = job.machine.holdings
        held, planned = self._intervals("held", h.held), self._intervals("planned", h.planned)
        holdings = (
            f'{{"committed_generation":{canonical(h.committed_generation)},'
            f'"generation":{canonical(h.generation)},"held":{held},"planned":{planned}}}'
        )
        rest = job.machine.snapshot(holdings=False)
        members = {k: f"{canonical(k)}:{canonical(v)}" for k, v in rest.items()}
        return _object({**members, "holdings": f'"holdings":{holdings}'})

    def _intervals(self, member: str, intervals: Mapping[str, list[Interval]]) -> JsonText:
        part = self._part
        return _object({w: part(member, w, tuple(ivs), partial(_lists, ivs))
                        for w, ivs in intervals.items()})  # fmt: skip

    def _part(
        self, member: str, worker: str, key: Any, doc: Callable[[], Any] | None = None
    ) -> str:
        """The worker's part, from `key` (its document; or what `doc` makes it from)."""
        found = self._parts.get((member, worker))
        if found is not None and found[0] == key:
            return found[1]
        text = f"{canonical(worker)}:{canonical(key if doc is None else doc())}"
        self._parts[(member, worker)] = (key, text)
        return text


def _lists(ivs: Iterable[Interval]) -> list[list[int]]:
    return [list(iv) for iv in ivs]


def _object(members: Mapping[str, str]) -> JsonText:
    """The canonical text of a JSON object from its members' texts (key -> '"key":value')."""
    return JsonText("{" + ",".join([members[k] for k in sorted(members)]) + "}")


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
