"""The unrecoverable path: a stage that loses every replica, and a job whose initial layout does
not fit in memory. Both are recorded transitions naming the reason, /api/v1/status shows them,
no plan is published, and the daemon keeps running and answering."""

from __future__ import annotations

import json
from pathlib import Path

import redis
from daemon_harness import Daemon, RunningJob, Workers, signed, wait_for

from chameleond.jobs import load_default_spec
from chameleond.jobstate.jobspec import spec_document

EVENTS = "chameleon:default:events"


def transitions(workers: Workers) -> list[dict[str, str]]:
    return [d for d in workers.decisions() if d["kind"] == "transition"]


def still_serving(daemon: Daemon, workers: Workers, client: redis.Redis) -> None:
    """Alive, healthy, and still handling (and acknowledging) events."""
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert daemon.get("/healthz")[0] == 200
    workers.heartbeat()
    wait_for(lambda: client.xpending(EVENTS, "chameleond")["pending"] == 0, 10, "events handled")
    assert daemon.proc.poll() is None


def test_a_stage_without_replicas_is_unrecoverable_and_the_daemon_keeps_serving(
    redis_client: redis.Redis, running_job: RunningJob
) -> None:
    daemon = running_job.start_training()
    workers = running_job.workers
    plan = workers.plan()
    assert plan is not None and plan["generation"] == 1
    first_stage = [p["stages"][0]["worker"] for p in plan["pipelines"]]

    # One MULTI/EXEC: the daemon's blocked read sees every fault at once, never the first alone
    # (which would be answered by a reroute before the others arrive).
    pipe = redis_client.pipeline(transaction=True)
    for w in first_stage:  # every replica of stage 0 at once
        pipe.xadd(EVENTS, signed({"type": "fault", "worker": w, "cause": "rack power"}))
    pipe.execute()
    # The committed record, not only the in-memory phase.
    wait_for(lambda: transitions(workers)[-1]["to"] == "unrecoverable", 15, "unrecoverable")
    assert daemon.status()["state"] == "unrecoverable"

    last = transitions(workers)[-1]
    assert (last["from"], last["to"]) == ("planning", "unrecoverable")
    assert "lost every replica" in last["cause"]
    assert all(w in last["cause"] for w in first_stage)
    record = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
    assert record["selected"] == "" and "lost every replica" in record["unrecoverable"]
    assert all(not c["feasible"] for c in json.loads(record["candidates"]))
    status = daemon.status()
    assert "lost every replica" in status["last_decision"]["unrecoverable"]
    assert set(first_stage) <= set(status["failed"])
    assert workers.generation() == 1  # nothing published
    wait_for(lambda: redis_client.xpending(EVENTS, "chameleond")["pending"] == 0, 10, "ack")
    still_serving(daemon, workers, redis_client)
    # A repeated fault is a duplicate, not a new decision.
    workers.send(type="fault", worker=first_stage[0], cause="again")
    still_serving(daemon, workers, redis_client)
    assert daemon.status()["state"] == "unrecoverable"


def test_no_initial_plan_that_fits_is_a_recorded_transition(
    redis_client: redis.Redis, running_job: RunningJob, tmp_path: Path
) -> None:
    # The packaged job on workers with 1 kB of memory each: no split of it fits.
    doc = spec_document(load_default_spec())
    doc["job"]["name"] = "default"  # the job's (a spec naming another job is refused)
    for w in doc["workers"]:
        w["memory_bytes"] = 1_000
    small = tmp_path / "small.json"
    small.write_text(json.dumps(doc))
    daemon = running_job.start("--spec", str(small))
    workers = running_job.workers
    workers.send(type="fault", worker="w5", cause="before the first plan")  # kept for it
    workers.register()
    wait_for(lambda: transitions(workers), 15, "the transition to unrecoverable")
    assert daemon.status()["state"] == "unrecoverable"
    # The fault is answered by the unrecoverable record: acknowledged, w5 is out.
    wait_for(lambda: redis_client.xpending(EVENTS, "chameleond")["pending"] == 0, 10, "ack")
    assert daemon.status()["failed"] == ["w5"]
    (t,) = transitions(workers)
    assert (t["from"], t["to"], t["generation"]) == ("waiting", "unrecoverable", "0")
    assert t["cause"].startswith("no initial plan:") and "memory" in t["cause"]
    (record,) = [d for d in workers.decisions() if d["kind"] == "decision"]
    assert record["selected"] == "" and record["unrecoverable"] == t["cause"]
    status = daemon.status()
    assert status["generation"] == 0 and status["last_decision"]["unrecoverable"] == t["cause"]
    assert daemon.get("/api/v1/plan")[0] == 404 and workers.plan() is None
    # A fault, a rejoin and more registrations: answered, but there is no plan to change.
    workers.send(type="fault", worker="w1", cause="ECC error")
    workers.send(type="rejoin", worker="w1")
    workers.register()
    still_serving(daemon, workers, redis_client)
    snap = json.loads(redis_client.hget("chameleon:default:state", "snapshot") or "{}")
    assert snap["machine"]["phase"] == "unrecoverable"
