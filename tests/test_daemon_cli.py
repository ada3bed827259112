"""The command line: every setting is a documented flag, settings layer file < env < flags,
`chameleond check` exits 0/1, and with no --redis-url an embedded Redis starts and the printed
redis-cli line works as pasted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from daemon_harness import Daemon, wait_for

from chameleond.daemon.cli import build_parser
from chameleond.daemon.config import FIELDS, ConfigError, load
from chameleond.redis_server import RedisServer, free_port

CLI = [sys.executable, "-m", "chameleond.daemon.cli"]


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


def test_check_exits_0_when_healthy_and_1_otherwise(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    ok = subprocess.run([*CLI, "check", "--config-only"], capture_output=True, timeout=60)
    assert ok.returncode == 0
    bad = subprocess.run(
        [*CLI, "check", "--config-only", "--spec", str(tmp_path / "missing.toml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 1 and "missing.toml" in bad.stdout
    daemon = Daemon(redis_server.url, tmp_path).start()
    try:
        daemon.wait_ready()
        args = ["--redis-url", redis_server.url, "--http", f"127.0.0.1:{daemon.port}"]
        live = subprocess.run([*CLI, "check", *args], capture_output=True, text=True, timeout=60)
        assert live.returncode == 0, live.stdout
    finally:
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
