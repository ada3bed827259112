"""Reroute first, switch later: with policy adaptive, a fault the planner answers with a reroute
plan plus a prepared dynamic follow-up. The daemon publishes the reroute, and once every worker
runs it (ready + a committed step) publishes the dynamic plan as the next generation. kill -9 of
the daemon in between neither loses nor repeats the switch (the follow-up is persisted)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import redis
from daemon_harness import Daemon, Generations, RunningJob, Workers, wait_for

from chameleond.core.decide import decide, initial_plan
from chameleond.core.spec import parse_spec
from chameleond.redis_server import RedisServer

# 2 pipelines x 4 stages; times scaled so the window where reroute wins but a later switch pays
# is about (1360 s, 1840 s) of D: the switch itself costs its migration and rebuild, so only
# the search (priced at 1 s per plan considered, about 230 s) is saved by switching later. With
# one fault T seconds after the initial plan the daemon's D is (prior + T) / 2 = 1550 + T / 2:
# inside it for any T under a few minutes.
S = 1000.0
PRIOR = 3100.0
WORKERS = tuple(f"w{i}" for i in range(8))


def spec_document() -> dict[str, Any]:
    return {
        # restart_seconds 0: the paper's score. Its risk term (the rerouted plan holds layers
        # 2-3 once) is tested in test_decide.py.
        "job": {"name": "default", "rebuild_seconds": 0.1 * S, "mtbf_prior_seconds": PRIOR,
                "restart_seconds": 0},
        "workers": [{"id": w, "host": f"h{i // 4}", "memory_bytes": 10**12}
                    for i, w in enumerate(WORKERS)],
        "links": {
            "intra_host": {"bandwidth_bytes_per_second": 1e9 / S, "latency_seconds": 1e-5 * S},
            "inter_host": {"bandwidth_bytes_per_second": 1e8 / S, "latency_seconds": 1e-4 * S},
        },
        "model": {"layers": [{"forward_seconds": 0.01 * S, "backward_seconds": 0.02 * S,
                              "param_bytes": 10**6, "optimizer_bytes": 2 * 10**6,
                              "activation_bytes": 10**5, "output_bytes": 10**4, "count": 8}]},
        "training": {"global_batch": 32, "micro_batch": 2},
        "plan": {"stages": 4},
        "costs": {"search_seconds_per_plan": 0.001 * S},
    }  # fmt: skip


def test_the_planner_offers_a_follow_up_for_this_job() -> None:
    """The premise of the daemon test below, checked against the planner directly."""
    spec = parse_spec(spec_document())
    current = initial_plan(spec)
    for d_seconds in (PRIOR / 2, PRIOR / 2 + 30):
        d = decide(spec, current, ["w1"], mtbf_seconds=d_seconds, generation=2)
        assert d.selected == "reroute" and d.follow_up is not None
        assert d.follow_up.policy == "dynamic"
        assert d.follow_up_after_seconds is not None and d.follow_up_after_seconds < d_seconds


def snapshot(client: redis.Redis) -> dict[str, Any]:
    return dict(json.loads(client.hget("chameleon:default:state", "snapshot") or "{}"))


def steps(workers: Workers, generation: int, plan_workers: list[str], step: int) -> None:
    for w in plan_workers:
        workers.send(type="step", worker=w, generation=generation, step=step, samples=32,
                     seconds=1.0, loss=4.0)  # fmt: skip


def test_reroute_then_switch_survives_kill_9_without_loss_or_repeat(
    redis_server: RedisServer, redis_client: redis.Redis, running_job: RunningJob, tmp_path: Path
) -> None:
    spec_file = tmp_path / "followup.json"
    spec_file.write_text(json.dumps(spec_document()))
    workers = running_job.workers
    published = Generations(redis_server.url)

    def start() -> Daemon:
        return running_job.start("--spec", str(spec_file))

    try:
        first = start()
        workers.register(WORKERS)
        wait_for(lambda: workers.generation() == 1, 15, "generation 1")
        workers.ready(1, WORKERS)
        wait_for(lambda: first.status()["state"] == "training", 15, "training")

        workers.send(type="fault", worker="w1", cause="ECC error")
        wait_for(lambda: workers.generation() == 2, 15, "the reroute plan")
        reroute = workers.plan()
        assert reroute is not None and reroute["policy"] == "reroute"
        record = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
        assert record["selected"] == "reroute" and record["generation"] == "2"
        # The prepared plan went into Redis with the reroute plan, in the same commit.
        stored = snapshot(redis_client)["follow_up"]
        assert stored["after_generation"] == 2 and stored["plan"]["policy"] == "dynamic"
        assert first.status()["follow_up"]["after_generation"] == 2
        first.kill()  # kill -9 before any worker runs the reroute plan

        second = start()
        assert second.status()["follow_up"]["after_generation"] == 2  # restored, not lost
        running = [w for w in WORKERS if w != "w1"]
        workers.ready(2, running)
        wait_for(lambda: second.status()["state"] == "training", 15, "training generation 2")
        time.sleep(0.5)
        assert workers.generation() == 2, "no switch before every worker committed a step"
        steps(workers, 2, running[:-1], 0)
        time.sleep(0.5)
        assert workers.generation() == 2, "no switch before every worker committed a step"
        steps(workers, 2, running[-1:], 0)
        wait_for(lambda: workers.generation() == 3, 15, "the switch to the prepared plan")
        switched = workers.plan()
        assert switched is not None and switched["policy"] == "dynamic"
        assert "switch to the prepared plan" in switched["cause"] and "w1" in switched["excluded"]
        assert snapshot(redis_client)["follow_up"] is None  # dropped in the switch's commit
        wait_for(lambda: second.status()["state"] == "transitioning", 5, "transitioning")
        second.kill()

        third = start()
        steps(workers, 2, running, 1)  # late steps of the old generation change nothing
        workers.ready(3, running)
        wait_for(lambda: third.status()["state"] == "training", 15, "training generation 3")
        steps(workers, 3, running, 0)
        time.sleep(1.0)
        status = third.status()
        assert status["generation"] == 3 and status["follow_up"] is None
        assert workers.generation() == 3
    finally:
        running_job.stop()
        published.close()
    plans = [d for d in workers.decisions() if d["kind"] == "decision" and d.get("selected")]
    assert [(d["generation"], d["selected"]) for d in plans] == [
        ("1", "initial"), ("2", "reroute"), ("3", "dynamic"),
    ]  # fmt: skip
    # Repeats of the current generation are fencing nudges (w1 counts as alive after a restart).
    assert published.seen == sorted(published.seen) and set(published.seen) == {1, 2, 3}
