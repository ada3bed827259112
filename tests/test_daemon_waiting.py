"""A fault received before the workers registered: status shows it while it waits, and its
decision and recovery latency count from the initial plan (the first moment the daemon can act);
the wait is its own figure, chameleon_fault_waiting_seconds."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis
from daemon_harness import Daemon, RunningJob, Workers, wait_for

from chameleond.core.plan import plan_from_dict
from chameleond.records import entry_seconds
from chameleond.redis_server import RedisServer

WAIT = 2.0


@pytest.fixture
def daemon(running_job: RunningJob) -> Daemon:
    return running_job.start(timeout=60)


def test_a_fault_before_the_workers_waits_visibly_and_is_not_counted_as_decision_time(
    daemon: Daemon, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    workers = Workers(redis_client)
    fault_id = workers.send(type="fault", worker="w3", cause="ECC error")
    waiting = wait_for(lambda: daemon.status()["waiting_faults"], 60, "the waiting fault")
    assert [(f["worker"], f["cause"]) for f in waiting] == [("w3", "ECC error")]
    received = waiting[0]["received_at"]
    assert entry_seconds(fault_id) - 0.01 <= received <= time.time()
    assert daemon.status()["workers_registered"] == 0

    def ctl_status() -> str:
        return subprocess.run(
            [sys.executable, "-m", "chameleond.cli.ctl", "status", "--redis-url", redis_server.url],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout  # fmt: skip

    out = wait_for(lambda: "fault waiting" in (o := ctl_status()) and o, 60, "status line")
    assert "fault waiting for a decision: w3 (ECC error)" in out

    time.sleep(WAIT)  # the workers take their time to come up
    workers.register()
    # The initial plan (generation 1), then at once the decision that answers w3.
    wait_for(lambda: workers.generation() == 2, 60, "the decision that answers w3")
    raw = workers.plan()
    assert raw is not None
    plan = plan_from_dict(raw)
    assert "w3" not in plan.workers and "w3" in plan.excluded

    records = workers.decisions()
    initial = next(r for r in records if r["cause"] == "initial plan")
    decision = next(r for r in records if r.get("faults") == '["w3"]')
    waited = float(initial["at"]) - entry_seconds(fault_id)
    assert waited >= WAIT
    # Decision latency runs from the initial plan, not from the fault's receipt.
    assert float(decision["decision_seconds"]) == pytest.approx(
        float(decision["at"]) - float(initial["at"]), abs=0.01
    )
    assert daemon.metric("chameleon_fault_waiting_seconds_count") == 1
    # From the daemon's receipt (after the XADD, before the status showed it) to the initial plan.
    assert WAIT <= daemon.metric("chameleon_fault_waiting_seconds_sum") <= waited + 0.01
    assert daemon.metric("chameleon_decision_seconds_count") == 1
    assert daemon.metric("chameleon_decision_seconds_sum") == pytest.approx(
        float(decision["decision_seconds"]), abs=0.01
    )
    status = daemon.status()
    assert status["waiting_faults"] == []
    assert WAIT <= status["faults_waited_seconds"]["w3"] <= waited + 0.01

    # Recovery too: every worker of the new plan commits a step; it counts from the plan as well.
    for w in plan.workers:
        workers.send(type="ack", worker=w, generation=2, phase="ready")
    for w in plan.workers:
        workers.send(type="step", worker=w, generation=2, step=0, samples=8, seconds=0.1, loss=1.0)
    wait_for(lambda: daemon.metric("chameleon_recovery_seconds_count") >= 1, 60, "recovery")
    recovered = time.time() - float(initial["at"])
    assert daemon.metric("chameleon_recovery_seconds_sum") <= recovered
