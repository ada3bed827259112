"""kill -9 of the daemon, including in the middle of a decision, then a restart: no acknowledged
fault is lost, no generation is reused or goes backwards, and the restarted daemon resumes."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator

import pytest
import redis
from daemon_harness import Generations, RunningJob, Workers, wait_for

from chameleond.redis_server import RedisServer

EVENTS = "chameleon:default:events"


@pytest.fixture
def generations(redis_server: RedisServer) -> Iterator[Generations]:
    g = Generations(redis_server.url)
    yield g
    g.close()


def pending(client: redis.Redis) -> int:
    return int(client.xpending(EVENTS, "chameleond")["pending"])


def unacknowledged(client: redis.Redis) -> set[str]:
    """Workers named by fault entries not yet acknowledged: pending, or not delivered yet."""
    group = next(g for g in client.xinfo_groups(EVENTS) if g["name"] == "chameleond")
    rows = client.xpending_range(EVENTS, "chameleond", min="-", max="+", count=1000)
    ids = [r["message_id"] for r in rows]
    entries = [e for i in ids for e in client.xrange(EVENTS, i, i)]
    entries += client.xrange(EVENTS, "(" + group["last-delivered-id"], "+")
    return {f["worker"] for _, f in entries if f.get("type") == "fault"}


def plan_records(workers: Workers) -> list[int]:
    return [int(d["generation"]) for d in workers.decisions()
            if d["kind"] == "decision" and d.get("selected")]  # fmt: skip


def test_kill_during_a_decision_then_restart_redecides_once(
    redis_client: redis.Redis, running_job: RunningJob, generations: Generations
) -> None:
    workers = running_job.workers
    slow = running_job.start_training("--decision-delay-seconds", "30")
    fault_id = workers.send(type="fault", worker="w1", cause="NIC down")
    wait_for(lambda: slow.status()["state"] == "planning", 15, "planning")
    slow.kill()  # kill -9 while the decision is held
    assert workers.generation() == 1 and pending(redis_client) == 1  # nothing half-written

    again = running_job.start()
    wait_for(lambda: workers.generation() == 2, 15, "generation 2 after the restart")
    plan = workers.plan()
    assert plan is not None and plan["excluded"] == ["w1"]
    wait_for(lambda: pending(redis_client) == 0, 10, "the fault acknowledged")
    entries = redis_client.xrange(EVENTS, fault_id, fault_id)
    assert entries and entries[0][1]["worker"] == "w1"
    assert plan_records(workers) == [1, 2]
    assert again.status()["state"] == "transitioning"
    again.stop()
    wait_for(lambda: generations.seen, 5, "published generations")
    assert generations.seen == sorted(set(generations.seen)) and generations.seen[-1] == 2


def test_random_kills_lose_no_acknowledged_fault_and_never_reuse_a_generation(
    redis_client: redis.Redis, running_job: RunningJob, generations: Generations
) -> None:
    rng = random.Random(7)
    workers = running_job.workers
    running_job.start_training().kill()
    faulted: list[str] = []
    for worker in ("w1", "w2", "w4"):
        d = running_job.start("--decision-delay-seconds", "0.4")
        workers.send(type="fault", worker=worker, cause="injected")
        faulted.append(worker)
        threading.Event().wait(rng.uniform(0.0, 0.8))
        d.kill()
        # Whatever was acknowledged is in the committed plan; nothing unacknowledged is lost.
        plan = workers.plan()
        assert plan is not None
        assert set(faulted) <= set(plan["excluded"]) | unacknowledged(redis_client)
    final = running_job.start()
    wait_for(lambda: pending(redis_client) == 0, 20, "every fault acknowledged")
    plan = workers.plan()
    assert plan is not None and sorted(plan["excluded"]) == sorted(faulted)
    assert final.status()["failed"] == sorted(faulted)
    final.stop()
    records = plan_records(workers)
    assert records == sorted(set(records)) and records[-1] == plan["generation"]
    assert generations.seen == sorted(set(generations.seen))
    stored = json.loads(redis_client.hget("chameleon:default:state", "snapshot") or "{}")
    assert stored["machine"]["generation"] == plan["generation"]
