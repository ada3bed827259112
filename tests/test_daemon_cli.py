"""The command line: every setting is a documented flag, settings layer file < env < flags,
`chameleond check` exits 0/1, and with no --redis-url an embedded Redis starts and the printed
redis-cli line works as pasted."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from daemon_harness import RunningJob, wait_for

from chameleond.daemon.cli import build_parser, main
from chameleond.daemon.config import FIELDS, ConfigError, load
from chameleond.redis_server import RedisServer, free_port

CLI = [sys.executable, "-m", "chameleond.daemon.cli"]
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = (ROOT / "chameleond" / "jobs" / "cpu-small.toml").read_text()


def test_run_help_documents_every_flag() -> None:
    out = subprocess.run([*CLI, "run", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for name in FIELDS:
        assert f"--{name.replace('_', '-')}" in text
        assert f"CHAMELEON_{name.upper()}" in text
    assert "--config" in text


def test_settings_layer_file_then_environment_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('job = "from-file"\npolicy = "reroute"\nbatch_count = 7\n')
    env = {"CHAMELEON_POLICY": "dynamic", "CHAMELEON_BATCH_COUNT": "9"}
    cfg = load(str(f), env, {"batch_count": 11})
    assert (cfg.job, cfg.policy, cfg.batch_count) == ("from-file", "dynamic", 11)
    args = build_parser().parse_args(["run", "--policy", "reroute", "--min-workers", "4"])
    assert (args.policy, args.min_workers) == ("reroute", 4)
    with pytest.raises(ConfigError, match="policy"):
        load(None, {"CHAMELEON_POLICY": "sometimes"}, {})
    with pytest.raises(ConfigError, match="block_ms"):
        load(None, {}, {"block_ms": 5000, "socket_timeout_seconds": 5.0})
    with pytest.raises(ConfigError, match="unknown setting"):
        f.write_text('colour = "blue"\n')
        load(str(f), {}, {})


def test_lease_seconds_must_outlast_a_renewal(tmp_path: Path) -> None:
    assert load(None, {}, {}).lease_seconds == 10.0
    f = tmp_path / "c.toml"
    f.write_text("lease_seconds = 20.0\n")
    assert load(str(f), {}, {}).lease_seconds == 20.0
    assert load(None, {"CHAMELEON_LEASE_SECONDS": "8"}, {}).lease_seconds == 8.0
    args = build_parser().parse_args(["run", "--lease-seconds", "3"])
    short = {"lease_seconds": args.lease_seconds, "socket_timeout_seconds": 1.5, "block_ms": 500}
    assert load(None, {}, short).lease_seconds == 3.0
    # Renewed every third of the lease, a renewal taking the whole 5 s socket timeout must
    # finish before the lease lapses: more than 7.5 s.
    with pytest.raises(ConfigError, match=r"lease_seconds: 7.5 must be more than 1.5 x"):
        load(None, {"CHAMELEON_LEASE_SECONDS": "7.5"}, {})
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match="lease_seconds"):
            load(None, {}, {"lease_seconds": bad})
    with pytest.raises(ConfigError, match="lease_seconds must be a finite number"):
        load(None, {"CHAMELEON_LEASE_SECONDS": "inf"}, {})


def test_check_exits_0_when_healthy_and_1_otherwise(
    redis_server: RedisServer, running_job: RunningJob, tmp_path: Path
) -> None:
    ok = subprocess.run([*CLI, "check", "--config-only"], capture_output=True, timeout=60)
    assert ok.returncode == 0
    bad = subprocess.run(
        [*CLI, "check", "--config-only", "--spec", str(tmp_path / "missing.toml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 1 and "missing.toml" in bad.stdout
    daemon = running_job.start()
    args = ["--redis-url", redis_server.url, "--http", f"127.0.0.1:{daemon.port}"]
    live = subprocess.run([*CLI, "check", *args], capture_output=True, text=True, timeout=60)
    assert live.returncode == 0, live.stdout
    daemon.stop()
    dead = subprocess.run([*CLI, "check", *args], capture_output=True, text=True, timeout=60)
    assert dead.returncode == 1 and "no daemon answering" in dead.stdout


def test_embedded_redis_and_the_printed_redis_cli_line(tmp_path: Path) -> None:
    port, http = free_port(), free_port()
    proc = subprocess.Popen(
        [*CLI, "run", "--state-dir", str(tmp_path / "state"), "--embedded-redis-port", str(port),
         "--http", f"127.0.0.1:{http}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "CHAMELEON_LOG_LEVEL": "warning"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert f"redis://127.0.0.1:{port}/0" in lines[0]
        paste = lines[2].strip()
        assert "redis-cli" in paste and "XADD chameleon:default:events" in paste
        client = redis.Redis(port=port, decode_responses=True)
        wait_for(lambda: _group_exists(client), 20, "the consumer group")
        out = subprocess.run(paste, shell=True, capture_output=True, text=True, timeout=10)
        assert out.returncode == 0 and "-" in out.stdout  # the new entry's id
        # A fault before any plan: the daemon keeps it for the first decision (not dead-lettered).
        wait_for(lambda: client.xpending("chameleon:default:events", "chameleond")["pending"], 10)
        assert client.xlen("chameleon:default:dead") == 0
        assert (tmp_path / "state" / "redis" / "appendonly.aof").exists()
        client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        time.sleep(0.2)
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=port, socket_timeout=1).ping()  # the embedded server is stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _group_exists(client: redis.Redis) -> bool:
    try:
        return bool(client.xinfo_groups("chameleon:default:events"))
    except redis.ResponseError:
        return False


@pytest.mark.parametrize(
    "old, new, reason",
    [
        # Parses, but no worker can hold its stage: the daemon would fail at its first plan.
        ("memory_bytes = 2_147_483_648", "memory_bytes = 1000", "does not fit in memory"),
        ("rebuild_seconds = 0.5", "rebuild_seconds = -1", "job.rebuild_seconds: must be >= 0"),
        ("mtbf_prior_seconds = 600.0", "mtbf_prior_seconds = 0", "job.mtbf_prior_seconds"),
        ("micro_batch = 2", "micro_batch = 0.5", "training.micro_batch"),
        ("stages = 2 ", 'stages = "two" ', "plan.stages"),
    ],
)
def test_check_config_only_rejects_a_job_it_cannot_run(
    old: str, new: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "job.toml"
    assert old in DEFAULT_TEXT
    spec.write_text(DEFAULT_TEXT.replace(old, new))
    assert main(["check", "--config-only", "--spec", str(spec)]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith("chameleond check: job spec: ") and reason in out
    spec.write_text(DEFAULT_TEXT)
    assert main(["check", "--config-only", "--spec", str(spec)]) == 0


def test_check_config_only_names_the_pipeline_that_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two workers of 1000 bytes each for a model of 12 KB of state."""
    layer = (
        "[[model.layers]]\nforward_seconds = 0.001\nbackward_seconds = 0.002\n"
        "param_bytes = 2000\noptimizer_bytes = 4000\nactivation_bytes = 10\noutput_bytes = 10\n"
    )
    workers = "".join(f'[[workers]]\nid = "w{i}"\nmemory_bytes = 1000\n' for i in range(2))
    links = "".join(
        f"[links.{k}]\nbandwidth_bytes_per_second = 1e9\nlatency_seconds = 0.0\n"
        for k in ("intra_host", "inter_host")
    )
    spec = tmp_path / "tiny.toml"
    spec.write_text(
        workers + links + layer * 2 + "[training]\nglobal_batch = 2\nmicro_batch = 1\n"
        "[plan]\nstages = 2\n"
    )
    assert main(["check", "--config-only", "--spec", str(spec)]) == 1
    assert "pipeline 0 (2 stages) does not fit in memory" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
@pytest.mark.parametrize(
    "name", ["heartbeat_timeout_seconds", "ready_timeout_seconds", "claim_idle_seconds"]
)
def test_settings_must_be_finite(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(f"CHAMELEON_{name.upper()}", value)
    assert main(["check", "--config-only"]) == 1
    assert main(["run"]) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert f"environment: {name} must be a finite number, got {value!r}" in err
    monkeypatch.delenv(f"CHAMELEON_{name.upper()}")
    with pytest.raises(ConfigError, match=f"flags: {name} must be a finite number"):
        load(None, {}, {name: float(value)})
    with pytest.raises(ConfigError, match="batch_count must be a whole number"):
        load(None, {"CHAMELEON_BATCH_COUNT": "7.5"}, {})


def test_the_example_config_names_every_setting() -> None:
    example = ROOT / "deploy" / "chameleond.toml"
    text = example.read_text()
    assert [n for n in FIELDS if not re.search(rf"^{n} = ", text, re.M)] == []
    load(str(example), {}, {})


def test_every_dashboard_query_is_filtered_by_the_chosen_instance(tmp_path: Path) -> None:
    board = json.loads((ROOT / "dashboards" / "chameleond.json").read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["instance"]["query"]["query"] == "label_values(chameleon_job_state, instance)"
    exprs = [a["expr"] for a in board["annotations"]["list"]] + [
        t["expr"] for p in board["panels"] for t in p.get("targets", [])
    ]
    assert len(exprs) > 10
    for expr in exprs:
        selectors = re.findall(r"chameleon_[a-z_]+(\{[^}]*\})?", expr)
        assert selectors and all(s.startswith('{instance=~"$instance"') for s in selectors), expr
    # Each query, with Grafana's variables filled in, is valid PromQL.
    grafana = {"$instance": "127.0.0.1:9464", "$__rate_interval": "1m", "$__range": "1h"}
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, expr in enumerate(exprs):
        for var, value in grafana.items():
            expr = expr.replace(var, value)
        rules += [f"      - record: dashboard:query{i}", f"        expr: {json.dumps(expr)}"]
    path = tmp_path / "queries.yml"
    path.write_text("\n".join(rules) + "\n")
    check = subprocess.run(
        ["/usr/bin/promtool", "check", "rules", str(path)], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_ctrl_c_stops_the_daemon_before_its_embedded_redis(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole foreground process group. The embedded redis-server
    is not in it: the daemon drains with Redis still there, then stops it, and exits 0 at once
    instead of retrying its commits against a Redis that the same Ctrl-C had stopped."""
    port, http = free_port(), free_port()
    proc = subprocess.Popen(
        [*CLI, "run", "--state-dir", str(tmp_path / "state"), "--embedded-redis-port", str(port),
         "--http", f"127.0.0.1:{http}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert f"redis://127.0.0.1:{port}/0" in proc.stdout.readline()  # Redis is up
        client = redis.Redis(port=port, decode_responses=True)
        wait_for(lambda: _group_exists(client), 30, "the consumer group")
        client.close()
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out[-3000:]
        assert time.monotonic() - t0 < 5, out[-3000:]
        assert "failed" not in out and "not released" not in out, out[-3000:]
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=port, socket_timeout=1).ping()  # stopped by the daemon
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
