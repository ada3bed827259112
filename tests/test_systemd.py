"""systemd integration: the unit file verifies, and Type=notify readiness, watchdog pings and the
SIGTERM drain arrive on a real unix datagram NOTIFY_SOCKET created here."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import Daemon

from chameleond.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "chameleond.service"


def test_unit_file_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is required (Debian package systemd)")
    text = UNIT.read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "StateDirectory=" in text
    # The shipped ExecStart points at /usr/local/bin; verify against this install's script.
    script = Path(sys.executable).parent / "chameleond"
    unit = tmp_path / "chameleond.service"
    unit.write_text(text.replace("/usr/local/bin/chameleond", str(script)))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "chameleond.service" not in result.stderr, result.stderr


def receive(sock: socket.socket, want: str, timeout: float) -> list[str]:
    """Datagrams until one holds `want`; returns every line received."""
    sock.settimeout(timeout)
    lines: list[str] = []
    while True:
        try:
            data = sock.recv(4096).decode()
        except TimeoutError:
            raise AssertionError(f"no {want!r} on NOTIFY_SOCKET; got {lines}") from None
        lines += data.splitlines()
        if want in data.splitlines():
            return lines


def test_notify_readiness_watchdog_and_sigterm_drain(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        daemon = Daemon(redis_server.url, tmp_path)
        daemon.start(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000"})
        try:
            lines = receive(sock, "READY=1", timeout=30)
            assert any(line.startswith("STATUS=") for line in lines)
            # READY means Redis, the group and HTTP are up: nothing more to wait for.
            assert daemon.get("/readyz")[0] == 200
            groups = [g["name"] for g in _groups(redis_server)]
            assert "chameleond" in groups
            receive(sock, "WATCHDOG=1", timeout=5)
            receive(sock, "WATCHDOG=1", timeout=5)  # keeps coming from the event loop
            _, metrics = daemon.get("/metrics")
            promtool = _promtool(str(metrics))
            assert promtool.returncode == 0, promtool.stdout + promtool.stderr
            assert daemon.proc is not None
            daemon.proc.terminate()  # SIGTERM
            receive(sock, "STOPPING=1", timeout=10)
            assert daemon.proc.wait(timeout=20) == 0
        finally:
            daemon.stop()


def _groups(server: RedisServer) -> list[dict[str, str]]:
    import redis

    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        return list(client.xinfo_groups("chameleon:default:events"))
    finally:
        client.close()


def _promtool(text: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/usr/bin/promtool", "check", "metrics"], input=text, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
