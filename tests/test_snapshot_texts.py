"""The snapshot's per-worker members made as text, each worker's part again only when it changed
(chameleond/jobstate/snapshot.py `WorkerTexts`): the text is the canonical text of the document
`snapshot` makes without them, through every kind of change, so a restarted daemon reads the
same state either way."""

from __future__ import annotations

import json
import time

from chameleond.auth import canonical, signed_json
from chameleond.core.decide import initial_plan
from chameleond.core.holdings import of_plan
from chameleond.core.machine import PolicyMachine
from chameleond.core.spec import LinkSpec
from chameleond.jobs import load_default_spec
from chameleond.jobstate.job import Job
from chameleond.jobstate.slowness import WorkerSlowness
from chameleond.jobstate.snapshot import WorkerTexts, restore, snapshot

SPEC = load_default_spec()


def texts_match(job: Job, texts: WorkerTexts) -> str:
    made = signed_json(None, "state", job.name, snapshot(job, texts=texts))
    assert made == canonical(snapshot(job))
    return made


def test_the_snapshot_text_follows_each_change_of_a_worker_its_slowness_and_its_holdings() -> None:
    job = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    texts = WorkerTexts()
    texts_match(job, texts)  # nothing registered, no plan
    plan = initial_plan(SPEC, generation=1)
    job.machine.initial(1, plan.workers, time.time(), of_plan(plan))
    job.plan = plan
    first = texts_match(job, texts)

    w0, w1 = SPEC.workers[0].id, SPEC.workers[1].id
    job.worker(w0).registered, job.worker(w0).host = True, "elsewhere"
    job.worker(w1).links[w0] = LinkSpec(1e9, 1e-5)
    changed = texts_match(job, texts)
    assert changed != first
    job.worker(w1).links[w0] = LinkSpec(2e9, 1e-5)  # a link measured again: a new figure
    texts_match(job, texts)

    job.slowness.workers[w0] = WorkerSlowness(True, 5.0, 0.5, None, 0.5)
    texts_match(job, texts)
    job.slowness.workers[w0].speed = 0.4  # changed in place, as the detector does
    job.slowness.episodes.append((1.0, 2.0))
    texts_match(job, texts)

    job.machine.holdings.lost(w1)
    texts_match(job, texts)
    job.machine.holdings.ready(w1, 1)  # its planned layers again
    job.worker("w-extra").registered = True  # a worker the spec does not list
    again = texts_match(job, texts)

    # What was written reads back to the same state (a restart gives the acks time again).
    copy = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    restore(copy, json.loads(again), plan, ready_timeout=30.0)
    read, written = json.loads(texts_match(copy, WorkerTexts())), json.loads(again)
    for doc in (read, written):
        del doc["machine"]["ready_deadline"]
    assert read == written
