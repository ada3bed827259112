"""The Grafana dashboard's queries through a real Prometheus (Debian's `prometheus`) scraping a real
chameleond with real CPU workers, with the shipped scrape configuration and alert rules: a worker
is killed (kill -9) while Prometheus watches, and then every panel, annotation and variable query
returns a series, with no NaN in it. No Grafana server is installable from the reachable registries
(Debian, PyPI, npm), so this is what proves the dashboard has data to draw."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from chameleond.cli.up import build_spec_document
from chameleond.jobs import load_default_spec
from chameleond.local.cluster import LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor
from chameleond.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
JOB = "dash"
# What Grafana substitutes, for a dashboard showing the last 10 minutes.
GRAFANA = {"$__rate_interval": "1m", "$__range": "10m"}
# The built-in training declares no held-out evaluation: its eval loss is no series at all (a
# zero would claim a perfect model), so a query over it must come back empty, not with a zero.
NOT_REPORTED = ("chameleon_eval_loss",)


def prometheus() -> str:
    found = shutil.which("prometheus")
    if found is None:
        pytest.fail("prometheus not installed: run scripts/test-peers.sh (Debian package)")
    return found


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def scrape_config(target: str, tmp: Path) -> Path:
    """dashboards/prometheus.yml as shipped, pointed at this daemon, scraping every second."""
    text = (DASHBOARDS / "prometheus.yml").read_text()
    for old, new in (
        ("127.0.0.1:9464", target),
        ("scrape_interval: 15s", "scrape_interval: 1s"),
        ("evaluation_interval: 15s", "evaluation_interval: 1s"),
        ("  - alerts.yml", f"  - {DASHBOARDS / 'alerts.yml'}"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp / "prometheus.yml"
    path.write_text(text)
    check = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    return path


def test_every_dashboard_query_returns_series_from_a_real_prometheus(tmp_path: Path) -> None:
    doc = build_spec_document(
        load_default_spec(), job=JOB, workers=4, pp=2, bind_addresses=[], mtbf_prior_seconds=None
    )
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    workers = [f"w{i}" for i in range(4)]
    board = json.loads((DASHBOARDS / "chameleond.json").read_text())
    with LocalCluster(tmp_path / "run", job=JOB, workers=workers, spec_path=spec) as cluster:
        cluster.start_daemon()
        cluster.start_workers()
        target = f"127.0.0.1:{cluster.http_port}"
        port = free_port()
        prom_url = f"http://127.0.0.1:{port}"
        prom = subprocess.Popen(
            [prometheus(), f"--config.file={scrape_config(target, tmp_path)}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"),
        )  # fmt: skip
        try:

            def query(expr: str) -> list[dict[str, Any]]:
                url = f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
                body = get(url)
                assert body["status"] == "success", (expr, body)
                return list(body["data"]["result"])

            def ok(expr: str) -> bool:
                try:
                    return bool(query(expr))
                except OSError:
                    return False

            wait_for(lambda: ok('up{job="chameleond"} == 1'), 60, "the first scrape", 0.5)
            client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
            mon = StreamMonitor(client, JOB)

            def committed(n: int) -> bool:
                mon.poll(block_ms=50)
                cluster.check_daemon()
                return len(mon.commits) >= n

            wait_for(lambda: committed(5), 150, "5 committed steps", 0)
            cluster.kill_worker("w1")  # w3 holds the same stage: training goes on
            wait_for(
                lambda: ok(f'sum(chameleon_recovery_seconds_count{{instance="{target}"}}) >= 1'),
                150, "a recovery scraped", 0.5,
            )  # fmt: skip
            wait_for(lambda: committed(len(mon.commits) + 2), 60, "steps after the fault", 0)
            client.close()

            exprs = [(a["name"], a["expr"]) for a in board["annotations"]["list"]]
            exprs += [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]
            assert len(exprs) >= 20
            empty, unreported = [], []
            for title, expr in exprs:
                filled = expr.replace("$instance", target)
                for var, value in GRAFANA.items():
                    filled = filled.replace(var, value)
                result = query(filled)
                if any(name in filled for name in NOT_REPORTED):
                    unreported += [f"{title}: {filled}"] if result else []
                elif not result:
                    empty.append(f"{title}: {filled}")
                for series in result:
                    assert math.isfinite(float(series["value"][1])), (title, filled, series)
            assert empty == [], empty
            assert unreported == [], unreported
            # The $instance variable: label_values(chameleon_job_state, instance).
            series = get(
                f"{prom_url}/api/v1/series?"
                + urllib.parse.urlencode({"match[]": "chameleon_job_state"})
            )["data"]
            assert {s["instance"] for s in series} == {target}
            # The alert rules load and evaluate on the live metrics; none fires on a healthy job.
            groups = get(f"{prom_url}/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) >= 9 and all(r["health"] == "ok" for r in rules), rules
            assert [r["name"] for r in rules if r["state"] == "firing"] == []
        finally:
            prom.terminate()
            prom.wait(timeout=30)


def test_grafana_provisioning_selects_the_dashboard_datasource_by_its_fixed_uid() -> None:
    board = json.loads((DASHBOARDS / "chameleond.json").read_text())
    variable = next(v for v in board["templating"]["list"] if v["name"] == "datasource")
    uid = variable["current"]["value"]
    datasource = (DASHBOARDS / "provisioning" / "datasources" / "chameleond.yml").read_text()
    assert f"    uid: {uid}\n" in datasource and "    type: prometheus\n" in datasource
    provider = (DASHBOARDS / "provisioning" / "dashboards" / "chameleond.yml").read_text()
    assert "    type: file\n" in provider and "      path: /" in provider
    assert board["uid"] == "chameleond"
    # Every panel and annotation queries through the chosen data source.
    sources = [p["datasource"] for p in board["panels"]]
    sources += [t["datasource"] for p in board["panels"] for t in p["targets"]]
    sources += [a["datasource"] for a in board["annotations"]["list"]]
    assert all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources)
