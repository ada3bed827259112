"""Every command line refuses a Redis URL it cannot use with exit 2 and one line that names the
problem, never the password in it, and never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PASSWORD = "s3cret-pa55word"
BAD_URLS = [
    f"redis://job:{PASSWORD}@redis.internal:port/0",  # a port that is no number
    f"redis://redis.internal:6379/0?password={PASSWORD}&socket_timeout=soon",
]
COMMANDS = {
    "chameleond run": ["chameleond.daemon.cli", "run", "--redis-url"],
    "chameleonctl status": ["chameleond.cli.ctl", "status", "--redis-url"],
    "chameleonctl inject": ["chameleond.cli.ctl", "inject", "--worker", "w1", "--redis-url"],
    "chameleonctl steps": ["chameleond.cli.ctl", "steps", "--redis-url"],
    "chameleonctl up": ["chameleond.cli.ctl", "up", "--redis-url"],
    "chameleon-worker": ["chameleond.worker._main", "--worker-id", "w0", "--redis-url"],
}


@pytest.mark.parametrize("url", BAD_URLS)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_url_is_a_one_line_usage_error_without_the_password(
    command: str, url: str, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", *COMMANDS[command], url]
    if command == "chameleonctl up":
        argv += ["--report", str(tmp_path / "report")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert PASSWORD not in out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and "redis" in lines[0].lower(), out


@pytest.mark.parametrize(
    "argv",
    [
        ["chameleond.daemon.cli"],
        ["chameleond.daemon.cli", "run", "--block-ms", "soon"],
        ["chameleond.cli.ctl", "status", "--bogus"],
        ["chameleond.cli.ctl", "inject"],
        ["chameleond.cli.ctl", "steps", "--last", "many"],
        ["chameleond.cli.ctl", "bench", "nothing"],
        ["chameleond.worker._main", "--group-timeout", "x"],
    ],
)
def test_a_bad_argument_is_a_one_line_usage_error(argv: list[str], tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and ": error: " in r.stderr, r.stderr
