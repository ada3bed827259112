"""Several hosts rehearsed on one machine: workers bound to 127.0.0.2 and 127.0.0.3 (two hosts in
the spec), one chameleond; `chameleonctl status` and `chameleonctl inject` against the live job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from chameleond.cli.up import build_spec_document
from chameleond.jobs import load_default_spec
from chameleond.local.cluster import LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor

pytestmark = pytest.mark.slow
ADDRESSES = ["127.0.0.2", "127.0.0.3"]


def chameleonctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def status(url: str) -> dict[str, Any]:
    proc = chameleonctl("status", "--redis-url", url, "--job", "mh", "--json")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def test_workers_on_two_loopback_hosts_train_and_recover(tmp_path: Path) -> None:
    doc = build_spec_document(
        load_default_spec(), job="mh", workers=4, pp=2, bind_addresses=ADDRESSES,
        mtbf_prior_seconds=None,
    )  # fmt: skip
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    workers = [f"w{i}" for i in range(4)]
    bind = {w: ADDRESSES[i % 2] for i, w in enumerate(workers)}
    with LocalCluster(
        tmp_path / "run", job="mh", workers=workers, spec_path=spec, bind_addresses=bind
    ) as cluster:
        cluster.start_daemon()
        cluster.start_workers()
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        try:
            mon = StreamMonitor(client, "mh")

            def commits(n: int, after_generation: int = 0) -> bool:
                mon.poll(block_ms=50)
                cluster.check_daemon()
                return sum(c.generation > after_generation for c in mon.commits) >= n

            wait_for(lambda: commits(3), 150, "3 committed steps", 0)
            hosts = {
                f["worker"]: f.get("address") for _, f in mon.events if f.get("type") == "register"
            }
            s = status(cluster.redis_url)
            plan = s["plan"]
            assert plan["generation"] == 1 and len(plan["pipelines"]) == 2
            assert {st["worker"] for p in plan["pipelines"] for st in p["stages"]} == set(workers)

            proc = chameleonctl(
                "inject", "--worker", "w3", "--cause", "ECC error", "--redis-url",
                cluster.redis_url, "--job", "mh",
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            assert (
                "XADD chameleon:mh:events '*' type fault worker w3 cause 'ECC error'" in proc.stdout
            )
            wait_for(lambda: commits(2, after_generation=1), 120, "steps on the new plan", 0)
            s = status(cluster.redis_url)
        finally:
            client.close()
    assert hosts == bind, "each worker registers with the address it is bound to"
    d = s["decisions"][0]
    assert d["failed"] == ["w3"] and d["selected"] in ("reroute", "dynamic")
    assert {c["policy"] for c in d["candidates"]} == {"reroute", "dynamic"}
    assert s["plan"]["generation"] >= 2 and "w3" in s["plan"]["excluded"]
    assert s["phase"] in ("training", "transitioning") and s["workers"]["w3"] == "excluded"
