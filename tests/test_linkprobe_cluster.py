"""Measured links end to end: two workers of one pipeline on two loopback hosts (gloo) probe their
link after building the generation, send it in their training profiles, and the daemon's status
shows the measured inter-host figure the planner now uses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from worker_harness import tiny_spec

from chameleond.local.cluster import LocalCluster, wait_for
from chameleond.protocol import REDIS_URL_ENV, Keys

pytestmark = pytest.mark.slow
HOSTS = {"w0": "127.0.0.2", "w1": "127.0.0.3"}
LARGE = 1 << 20


def http_status(cluster: LocalCluster) -> dict[str, Any]:
    with urllib.request.urlopen(f"{cluster.http_url}/api/v1/status", timeout=5) as r:
        return dict(json.loads(r.read()))


def ctl_links(cluster: LocalCluster) -> dict[str, Any]:
    """The links of `chameleonctl status --json`: read from Redis, the daemon's snapshot."""
    proc = subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "status", "--job", "lp", "--json"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, REDIS_URL_ENV: cluster.redis_url},
    )  # fmt: skip
    return dict(json.loads(proc.stdout)["state"]["snapshot"]["links"])


def profiles_with_links(client: redis.Redis, job: str) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for _, f in client.xrange(Keys(job).events):
        if f.get("type") == "profile":
            data = json.loads(f["data"])
            if "links" in data:
                out[f["worker"]] = data["links"]
    return out


def test_two_hosts_measure_their_link_and_the_daemon_plans_with_it(tmp_path: Path) -> None:
    doc = tiny_spec("lp", workers=2, stages=2)
    for w in doc["workers"]:
        w["host"] = HOSTS[w["id"]]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    declared = doc["links"]["inter_host"]
    with LocalCluster(
        tmp_path / "run", job="lp", workers=list(HOSTS), spec_path=spec, bind_addresses=HOSTS,
    ) as cluster:  # fmt: skip
        cluster.start_daemon()
        cluster.start_workers()
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)

        def measured() -> bool:
            cluster.check_daemon()
            return set(profiles_with_links(client, "lp")) == set(HOSTS)

        wait_for(measured, 120, "training profiles with links from both workers", 0)
        links = profiles_with_links(client, "lp")
        # Each side names the other, with the same figures (the leader shares its result).
        assert [x["peer"] for x in links["w0"]] == ["w1"]
        assert [x["peer"] for x in links["w1"]] == ["w0"]
        assert links["w0"][0] == {**links["w1"][0], "peer": "w1"}
        figure = links["w0"][0]
        # Loopback: at least 10 MB/s, at most the bound; a round trip under 50 ms.
        assert 1e7 <= figure["bandwidth_bytes_per_second"] <= 1e13
        assert 0 < figure["latency_seconds"] < 0.05

        def shown() -> dict[str, Any] | None:
            view = http_status(cluster)["links"]
            return view if view["inter_host"]["measured"] else None

        wait_for(lambda: shown() is not None, 30, "the measured inter-host link in status", 0)
        view = shown()
        assert view is not None
        assert view["inter_host"]["bandwidth_bytes_per_second"] == pytest.approx(
            figure["bandwidth_bytes_per_second"]
        )
        assert view["inter_host"]["latency_seconds"] == pytest.approx(figure["latency_seconds"])
        assert (
            view["inter_host"]["bandwidth_bytes_per_second"]
            != declared["bandwidth_bytes_per_second"]
        )
        assert view["intra_host"]["measured"] is False  # no pair on one host
        assert {(p["worker"], p["peer"]) for p in view["pairs"]} == {("w0", "w1"), ("w1", "w0")}
        assert all(p["inter_host"] for p in view["pairs"])
        wait_for(lambda: ctl_links(cluster)["inter_host"]["measured"], 30, "ctl status", 0)
        assert ctl_links(cluster)["inter_host"]["bandwidth_bytes_per_second"] == pytest.approx(
            figure["bandwidth_bytes_per_second"]
        )
        # What the probe added to the generation's build, as the workers logged it.
        log = (tmp_path / "run" / "logs" / "w0.log").read_text()
        took = re.search(r"links to w1 \(.*\) measured in ([0-9.]+)s", log)
        assert took is not None and float(took.group(1)) < 1.0, log[-2000:]
