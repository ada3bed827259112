"""A fail-slow worker through a real daemon: training profiles that say w0 runs at half speed
make it slow after the hold, and a decision that moves its micro-batches to its peers is
published. With --no-slow-mitigation it is detected and measured, and no plan is published."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from chameleond.jobs import load_default_spec
from chameleond.jobstate.slowness import HOLD_SECONDS
from tests.daemon_harness import WORKERS, Daemon, RunningJob, wait_for

SPEC = load_default_spec()


def executed_by(plan: dict[str, Any], worker: str) -> int:
    """Micro-batch slots `worker` executes in `plan`'s routing."""
    return sum(row.count(worker) for pipe in plan["routing"] for row in pipe)


def train(rj: RunningJob, daemon: Daemon, generation: int) -> None:
    """Every worker of the plan acknowledges `generation` and commits a step of it."""
    plan = rj.workers.plan()
    assert plan is not None and plan["generation"] == generation
    members = [w for w in WORKERS if w not in plan["excluded"]]
    if generation > 1:
        rj.workers.ready(generation, members)
    for w in members:
        rj.workers.send(type="step", worker=w, generation=generation, step=generation,
                        samples=12, seconds=0.1, loss=1.0)  # fmt: skip
    wait_for(lambda: daemon.status()["state"] == "training", 15, f"training {generation}")


def profiles(rj: RunningJob, slow: str | None, until: Any, timeout: float = 30.0) -> Any:
    """Every owner reports a training profile of its stage each 0.5 s, `slow` at twice the
    seconds, until `until()` holds."""
    plan = rj.workers.plan()
    assert plan is not None
    deadline = time.monotonic() + timeout
    rounds = 0
    while (done := until()) is None or done is False:
        assert time.monotonic() < deadline, "timed out"
        rounds += 1
        jitter = 1.0 + 0.01 * (rounds % 3)  # measurements vary: no report repeats the last
        for pipe in plan["pipelines"]:
            for st in pipe["stages"]:
                f = (2.0 if st["worker"] == slow else 1.0) * jitter
                layers = [
                    {**asdict(SPEC.layers[i]), "index": i,
                     "forward_seconds": f * SPEC.layers[i].forward_seconds,
                     "backward_seconds": f * SPEC.layers[i].backward_seconds}
                    for i in range(st["first_layer"], st["end_layer"])
                ]  # fmt: skip
                data = {"layers": layers, "source": "training", "generation": plan["generation"]}
                rj.workers.send(type="profile", worker=st["worker"], data=json.dumps(data))
        time.sleep(0.5)
    return done


def test_a_slow_worker_is_detected_and_its_work_moved(running_job: RunningJob) -> None:
    rj = running_job
    daemon = rj.start_training("--slow-mitigation")
    train(rj, daemon, 1)
    before = rj.workers.plan()
    assert before is not None
    share = executed_by(before, "w0")
    started = time.monotonic()
    profiles(rj, "w0", lambda: rj.workers.generation() == 2 or None)
    assert time.monotonic() - started >= HOLD_SECONDS
    plan = rj.workers.plan()
    assert plan is not None and plan["cause"].startswith("w0 slow: speed 0.50")
    assert executed_by(plan, "w0") < share  # its micro-batches (part or all) moved to its peers
    status = daemon.status()
    assert abs(status["slow"]["w0"]["speed"] - 0.5) < 0.01
    decision = status["last_decision"]
    assert decision["selected"] != "keep" and decision["plan_generation"] == 2
    gains = {c["policy"]: c["gain"] for c in decision["candidates"]}
    assert gains["keep"] == 0.0 and gains[decision["selected"]] > 0
    assert "w0 slow" in rj.workers.decisions()[-1]["cause"]
    assert daemon.metric('chameleon_worker_speed{worker="w0"}') < 0.51
    assert daemon.metric('chameleon_slow_episodes_total{outcome="detected"}') == 1
    assert daemon.metric("chameleon_slow_expected_gain_samples_per_second") > 0


def test_without_mitigation_a_slow_worker_is_only_detected(running_job: RunningJob) -> None:
    rj = running_job
    daemon = rj.start_training()  # slow_mitigation is off by default
    train(rj, daemon, 1)
    profiles(rj, "w0", lambda: daemon.status()["slow"] or None)
    assert daemon.status()["slow_mitigation"] is False
    assert daemon.metric('chameleon_worker_speed{worker="w0"}') < 0.51
    time.sleep(1.0)
    assert rj.workers.generation() == 1
