"""Real workers under chameleond (gloo, CPU): one is killed with -9 and is named dead; one is
stopped with SIGTERM and has left (taken out of the plans, never failed); the others finish their
--max-steps, say so, exit 0 and stay `finished`, never suspected, however long they stay silent
afterwards."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_harness import tiny_spec

from chameleond.local.cluster import LocalCluster, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
JOB = "fin"
MAX_STEPS = 40


def api_status(cluster: LocalCluster) -> dict[str, Any]:
    with urllib.request.urlopen(cluster.http_url + "/api/v1/status", timeout=5) as r:
        return dict(json.loads(r.read()))


def test_finished_workers_are_finished_and_a_killed_one_is_dead(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(tiny_spec(JOB, workers=4, stages=2)))
    workers = [f"w{i}" for i in range(4)]
    with LocalCluster(
        tmp_path / "run", job=JOB, workers=workers, spec_path=spec, policy="reroute",
        worker_args=["--max-steps", str(MAX_STEPS)],
    ) as cluster:  # fmt: skip
        cluster.start_daemon()
        cluster.start_workers()

        def step() -> int:
            cluster.check_daemon()
            try:
                return int(api_status(cluster)["progress"]["step"])
            except OSError:
                return -1

        wait_for(lambda: step() >= 3, 180, "3 committed steps", 0.2)
        cluster.kill_worker("w3")
        wait_for(lambda: api_status(cluster)["generation"] >= 2, 60, "a plan without w3", 0.2)
        leaving = cluster.workers["w2"]
        assert leaving.proc is not None and leaving.alive
        leaving.proc.send_signal(signal.SIGTERM)
        assert leaving.proc.wait(timeout=30) == 0
        wait_for(lambda: api_status(cluster)["generation"] >= 3, 60, "a plan without w2", 0.2)
        survivors = [cluster.workers[w] for w in workers[:2]]
        wait_for(lambda: not any(c.alive for c in survivors), 150, "the survivors finishing", 0.2)
        assert [c.proc.returncode for c in survivors if c.proc] == [0, 0]
        generation = api_status(cluster)["generation"]
        time.sleep(5.0)  # past the heartbeat timeout (3 s): nobody may be suspected
        status = api_status(cluster)
        for w in workers[:2]:
            assert status["workers"][w]["state"] == "finished", status["workers"][w]
            assert status["workers"][w]["liveness"] == "stopped"
        assert status["workers"]["w2"]["state"] == "left", status["workers"]["w2"]
        assert status["workers"]["w3"]["state"] == "failed"
        assert status["workers"]["w3"]["liveness"] == "dead"
        assert status["generation"] == generation
        assert sorted(status["failed"]) == ["w2", "w3"]  # out of the plans, both
        assert list(status["last_decision"]["faults"]) == ["w2"]  # when it left
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        faults = {f["worker"] for _, f in client.xrange(f"chameleon:{JOB}:events")
                  if f.get("type") == "fault"}  # fmt: skip
        client.close()
        assert faults <= {"w2", "w3"} and "w3" in faults  # peers may name w2 after it left
        log = (tmp_path / "run" / "logs" / "chameleond.log").read_text()
        assert "w3 is dead" in log and "fenced w3" not in log
