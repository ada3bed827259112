"""Redis restarts under a running daemon (same port, same append-only data directory), in the
middle of a decision: the daemon stays healthy, reconnects, commits the decision once Redis is
back, loses nothing that was acknowledged, and the generation continues."""

from __future__ import annotations

import json
import time

import redis
from daemon_harness import RunningJob, wait_for

from chameleond.redis_server import RedisServer

EVENTS = "chameleon:default:events"


def test_redis_restart_during_a_decision_loses_nothing_and_generations_continue(
    redis_server: RedisServer, redis_client: redis.Redis, running_job: RunningJob
) -> None:
    daemon = running_job.start_training("--decision-delay-seconds", "1.5")
    workers = running_job.workers

    fault = workers.send(type="fault", worker="w1", cause="ECC error")
    wait_for(lambda: daemon.status()["state"] == "planning", 10, "planning")
    redis_server.stop()  # SIGTERM: Redis writes its append-only file and exits
    time.sleep(2.5)  # the decision ends while Redis is away: its commit waits and retries
    assert daemon.get("/healthz")[0] == 200  # the read loop keeps turning (and retrying)
    status, body = daemon.get("/readyz")  # ... but cannot take faults: not ready
    assert status == 503 and "Redis unreachable" in str(body), body
    assert daemon.metric("chameleon_redis_up") == 0
    assert daemon.proc is not None and daemon.proc.poll() is None
    redis_server.start()
    wait_for(lambda: daemon.get("/readyz")[0] == 200, 15, "ready again after Redis is back")
    assert daemon.metric("chameleon_redis_up") == 1

    wait_for(lambda: workers.generation() == 2, 20, "generation 2 after Redis came back")
    plan = workers.plan()
    assert plan is not None and plan["excluded"] == ["w1"]
    wait_for(lambda: redis_client.xpending(EVENTS, "chameleond")["pending"] == 0, 10, "acks")
    assert redis_client.xrange(EVENTS, fault, fault)  # the fault entry itself survived

    running_job.next_fault(daemon, 2, ["w1"], "w3")  # generation 3
    wait_for(lambda: redis_client.xpending(EVENTS, "chameleond")["pending"] == 0, 10, "acks")

    # Everything acknowledged before the restart stayed acknowledged: nothing was handled
    # twice, and the decision history holds each generation once.
    assert daemon.metric('chameleon_events_total{outcome="handled",type="register"}') == 6
    assert daemon.metric('chameleon_events_total{outcome="handled",type="fault"}') == 2
    records = [d for d in workers.decisions() if d["kind"] == "decision"]
    assert [int(d["generation"]) for d in records] == [1, 2, 3]
    state = redis_client.hgetall("chameleon:default:state")
    assert int(state["generation"]) == 3
    assert json.loads(state["snapshot"])["machine"]["generation"] == 3
    assert "commit failed" in daemon.output() and "XREADGROUP failed" in daemon.output()
    assert daemon.terminate() == 0


def test_redis_that_comes_back_empty_gets_the_job_written_again(
    redis_client: redis.Redis, running_job: RunningJob
) -> None:
    """Redis restarted without persistence, or a failover to a replica that missed the job: the
    daemon notices (the consumer group and the generation are gone), writes the job again from
    memory, and the next fault gets the next generation."""
    daemon = running_job.start_training()
    workers = running_job.workers
    plan = redis_client.get("chameleon:default:plan")
    redis_client.flushall()
    wait_for(lambda: redis_client.get("chameleon:default:plan") == plan, 15, "plan again")
    assert redis_client.hget("chameleon:default:state", "generation") == "1"
    assert redis_client.exists("chameleon:default:spec")
    wait_for(lambda: daemon.get("/readyz")[0] == 200, 15, "ready")
    workers.send(type="fault", worker="w1", cause="ECC error")
    wait_for(lambda: workers.generation() == 2, 15, "generation 2 after the loss")
    plan2 = workers.plan()
    assert plan2 is not None and plan2["excluded"] == ["w1"]
    wait_for(lambda: redis_client.xpending(EVENTS, "chameleond")["pending"] == 0, 10, "acks")
    assert "Redis lost the job's state" in daemon.output()
    assert daemon.terminate() == 0
