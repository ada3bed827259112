"""systemd integration: the unit files verify and expose little, and Type=notify readiness,
watchdog pings and the SIGTERM drain arrive on a real unix datagram NOTIFY_SOCKET created here."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import Daemon

from chameleond.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "deploy" / "systemd"
DAEMON_UNIT = UNITS / "chameleond@.service"
WORKER_UNIT = UNITS / "chameleon-worker@.service"
AGENT_UNIT = UNITS / "chameleon-agent@.service"
UNIT_FILES = (DAEMON_UNIT, WORKER_UNIT, AGENT_UNIT)
REQUIRED = (
    "Type=notify", "WatchdogSec=", "SystemCallFilter=@system-service", "CapabilityBoundingSet=\n",
    "ProtectClock=yes", "ProtectKernelTunables=yes", "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes", "RestrictAddressFamilies=", "MemoryDenyWriteExecute=",
    "DevicePolicy=closed", "NoNewPrivileges=yes", "ProtectSystem=strict",
)  # fmt: skip
# The daemon keeps nothing but its embedded Redis's file: a dynamic user and a state directory.
# A worker writes the job's checkpoints, which the job's other workers read on other hosts: one
# fixed user everywhere, and the shared directory writable.
REQUIRED_OF = {
    DAEMON_UNIT: ("Restart=on-failure", "DynamicUser=yes", "StateDirectory="),
    WORKER_UNIT: ("Restart=on-failure", "User=chameleon\n", "LimitMEMLOCK=infinity",
                  "ReadWritePaths=-/var/lib/chameleon/checkpoints\n",
                  "DeviceAllow=char-infiniband_verbs rw", "DeviceAllow=/dev/davinci0 rw"),
    AGENT_UNIT: ("Restart=always", "KillMode=control-group", "User=chameleon\n",
                 "LimitMEMLOCK=infinity", "ReadWritePaths=-/var/lib/chameleon/checkpoints\n",
                 "DeviceAllow=char-infiniband_verbs rw", "DeviceAllow=/dev/davinci0 rw"),
}  # fmt: skip
MAX_EXPOSURE = 2.5  # systemd-analyze security's scale: 0 (locked down) to 10 (unprotected)


def analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.fail("systemd-analyze is required (Debian package systemd)")
    return found


def installed(unit: Path, tmp: Path) -> Path:
    """The unit as installed next to this environment's console scripts (the shipped ExecStart
    points at /usr/local/bin, where `pip install` into the system puts them)."""
    scripts = Path(sys.executable).parent
    text = unit.read_text().replace("/usr/local/bin/", f"{scripts}/")
    (command,) = re.findall(rf"^ExecStart={re.escape(str(scripts))}/(\S+)", text, re.MULTILINE)
    assert (scripts / command).exists(), f"{command} is not installed in {scripts}"
    path = tmp / unit.name
    path.write_text(text)
    return path


@pytest.mark.parametrize("unit", UNIT_FILES, ids=lambda u: u.name)
def test_unit_files_verify(unit: Path, tmp_path: Path) -> None:
    text = unit.read_text()
    for key in (*REQUIRED, *REQUIRED_OF[unit]):
        assert key in text, key
    template = installed(unit, tmp_path)
    # The template and an instance of it (the instance is the job, or the worker id).
    instance = template.with_name(template.name.replace("@.", "@demo."))
    shutil.copy(template, instance)
    for path in (template, instance):
        result = subprocess.run(
            [analyze(), "verify", str(path)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert unit.name.split("@")[0] not in result.stderr, result.stderr


def exposure(unit: Path) -> float:
    result = subprocess.run(
        [analyze(), "security", "--offline=true", str(unit)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    found = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?) ", result.stdout)
    assert found, result.stdout + result.stderr
    return float(found.group(1))


@pytest.mark.parametrize("unit", UNIT_FILES, ids=lambda u: u.name)
def test_the_units_expose_little(unit: Path, tmp_path: Path) -> None:
    # The worker's and the agent's leave MemoryDenyWriteExecute off (torch needs it off, below)
    # and admit the accelerators' and InfiniBand's device nodes.
    level = exposure(installed(unit, tmp_path))
    assert level <= MAX_EXPOSURE, level
    print(f"systemd-analyze security exposure: {unit.name} {level}")


def test_a_worker_stays_down_for_the_exit_codes_a_restart_cannot_mend() -> None:
    """The worker unit leaves down exactly the codes chameleon-agent leaves down (docs/deploy.md):
    a configuration error or a failed device does not loop; fenced (9) and crashes restart."""
    from chameleond.exits import PERMANENT, WorkerExit

    (line,) = re.findall(r"^RestartPreventExitStatus=(.*)$", WORKER_UNIT.read_text(), re.M)
    assert {int(code) for code in line.split()} == set(PERMANENT)
    assert WorkerExit.FENCED not in PERMANENT


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


# What MemoryDenyWriteExecute=yes enforces, applied by the kernel itself (PR_SET_MDWE, Linux 6.3+,
# inherited by children): no mapping may become both writable and executable. Then exec argv.
MDWE = """
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:
    sys.exit("PR_SET_MDWE: " + os.strerror(ctypes.get_errno()))
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_the_daemon_decides_under_memory_deny_write_execute_and_torch_cannot(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    import redis
    from daemon_harness import WORKERS, Workers, wait_for

    daemon = Daemon(redis_server.url, tmp_path)  # its port and HTTP client; started under MDWE:
    log = (tmp_path / "mdwe-daemon.log").open("wb")
    cmd = [sys.executable, "-c", MDWE, sys.executable, "-m", "chameleond.daemon.cli", "run",
           "--redis-url", redis_server.url, "--http", f"127.0.0.1:{daemon.port}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is None and daemon.get("/readyz")[0] == 200, 60, "ready")
        client = redis.Redis.from_url(redis_server.url)
        workers = Workers(client)
        workers.register()
        wait_for(lambda: workers.generation() == 1, 60, "generation 1")
        workers.ready(1, WORKERS)
        workers.send(type="fault", worker="w1", cause="ECC error")
        wait_for(lambda: workers.generation() == 2, 60, "a decision under MDWE")
        assert daemon.get("/")[0] == 200
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert proc.returncode == 0, (tmp_path / "mdwe-daemon.log").read_text()[-3000:]
    # The worker's training kernels are generated at run time: why its unit leaves MDWE off.
    gelu = "import torch; print(torch.nn.functional.gelu(torch.randn(8, 8)).sum())"
    torch_run = subprocess.run(
        [sys.executable, "-c", MDWE, sys.executable, "-c", gelu],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert torch_run.returncode != 0 and "could not create a primitive" in torch_run.stderr


def test_the_worker_notifies_readiness_and_pings_the_watchdog(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    path = tmp_path / "worker-notify.sock"
    env = {**os.environ, "NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000",
           "CHAMELEON_REDIS_URL": redis_server.url}  # fmt: skip
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        worker = subprocess.Popen(
            [sys.executable, "-m", "chameleond.worker._main", "--worker-id", "w0"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            lines = receive(sock, "READY=1", timeout=120)
            assert any(line.startswith("STATUS=worker w0 of job default") for line in lines)
            receive(sock, "WATCHDOG=1", timeout=5)
            receive(sock, "WATCHDOG=1", timeout=5)
            worker.terminate()
            assert worker.wait(timeout=30) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
