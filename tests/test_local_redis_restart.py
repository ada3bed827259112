"""Redis restarts under a training job: chameleond and six workers (gloo, CPU), the job's Redis
stopped (SIGTERM) for three seconds and started again on the same port and data directory.

Training does not need Redis between plans, so it must go on through the outage: no worker exits,
nobody is declared failed (neither by a survivor nor by the daemon's heartbeat detector), the plan
stays the same, every step is committed by every worker, and the events kept during the outage
arrive afterwards in order. Then a real kill -9 proves failure handling works again: the survivors
find the dead peer by its connections (which every live worker re-opened) and training resumes on
a new plan."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from chameleond.cli.up import build_spec_document
from chameleond.jobs import load_default_spec
from chameleond.local.cluster import LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
JOB = "rr"
OUTAGE_SECONDS = 3.0


def api_status(cluster: LocalCluster) -> dict[str, Any]:
    with urllib.request.urlopen(cluster.http_url + "/api/v1/status", timeout=5) as r:
        return dict(json.loads(r.read()))


def test_training_rides_through_a_redis_restart(tmp_path: Path) -> None:
    doc = build_spec_document(
        load_default_spec(), job=JOB, workers=6, pp=2, bind_addresses=[],
        mtbf_prior_seconds=None,
    )  # fmt: skip
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    workers = [f"w{i}" for i in range(6)]
    with LocalCluster(
        tmp_path / "run", job=JOB, workers=workers, spec_path=spec, policy="reroute"
    ) as cluster:
        cluster.start_daemon()
        cluster.start_workers()
        assert cluster.redis is not None
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        mon = StreamMonitor(client, JOB)
        made: dict[int, list[float]] = {}  # step -> when each worker reported it (its clock)

        def poll() -> None:
            before = len(mon.events)
            mon.poll(block_ms=50)
            cluster.check_daemon()
            for _, f in mon.events[before:]:
                if f.get("type") == "step":
                    made.setdefault(int(f["step"]), []).append(float(f["at"]))

        def committed(n: int) -> bool:
            poll()
            return len(mon.commits) >= n

        wait_for(lambda: committed(40), 150, "40 committed steps", 0)
        client.close()

        cluster.redis.stop()  # SIGTERM: Redis writes its append-only file and exits
        stopped = time.time()
        time.sleep(OUTAGE_SECONDS)
        assert all(c.alive for c in cluster.workers.values()), "a worker exited with Redis away"
        cluster.redis.start()
        started = time.time()

        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        mon.client = client

        def after_restart(n: int) -> bool:
            poll()
            return sum(1 for ts in made.values() if min(ts) > started) >= n

        wait_for(lambda: after_restart(10), 60, "10 steps after Redis came back", 0)
        time.sleep(4)  # past the daemon's heartbeat timeout (3 s): nobody may be suspected
        poll()

        assert all(c.alive for c in cluster.workers.values())
        events = [f for _, f in mon.events]
        assert [f for f in events if f.get("type") == "fault"] == []
        assert client.get(f"chameleon:{JOB}:plan") is not None
        assert mon.generation == 1
        # Steps went on while Redis was away: reported (worker clock) inside the outage.
        during = sorted(s for s, ts in made.items() if stopped < min(ts) < started)
        assert len(during) >= 3, f"steps made during the outage: {during}"
        window = started - stopped
        before = [s for s, ts in made.items() if stopped - window < min(ts) <= stopped]
        print(f"\nsteps made in {window:.2f} s: {len(before)} before Redis stopped, "
              f"{len(during)} while it was away")  # fmt: skip
        # Every step committed by every worker (a commit needs all six reports), none missing,
        # and each worker's kept events arrived in the order it made them.
        assert [c.step for c in mon.commits] == list(range(len(mon.commits)))
        assert len(mon.commits) >= len(made) - 1  # the newest step may still be reporting
        for w in workers:
            mine = [int(f["step"]) for f in events if f.get("type") == "step" and f["worker"] == w]
            assert mine == sorted(mine), f"{w}'s kept events arrived out of order"
        s = api_status(cluster)
        assert s["state"] == "training" and s["generation"] == 1, s
        daemon_log = (tmp_path / "run" / "logs" / "chameleond.log").read_text()
        assert "Redis reachable again" in daemon_log and "suspect" not in daemon_log
        for w in workers:
            log = (tmp_path / "run" / "logs" / f"{w}.log").read_text()
            assert "keeping events, training goes on" in log and "Redis reachable again" in log

        # Failure handling works again after the restart.
        cluster.kill_worker("w3")

        def on_new_plan() -> bool:
            poll()
            return any(c.generation > 1 for c in mon.commits)

        wait_for(on_new_plan, 90, "a step on a new plan after kill -9 of w3", 0)
        faults = [f for _, f in mon.events if f.get("type") == "fault"]
        assert {f["worker"] for f in faults} == {"w3"}, faults
        assert any(f.get("reporter") for f in faults), "no survivor named the dead peer"
        client.close()
