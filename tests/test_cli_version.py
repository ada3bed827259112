"""`--version` on every command: chameleonctl, chameleond and chameleon-worker print their name and
the installed package's version, and exit 0 (before any required argument is asked for)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest


@pytest.mark.parametrize(
    ("prog", "module"),
    [
        ("chameleonctl", "chameleond.cli.ctl"),
        ("chameleond", "chameleond.daemon.cli"),
        ("chameleon-worker", "chameleond.worker._main"),
    ],
)
def test_version(prog: str, module: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{prog} {version('chameleond')}\n"


def test_top_level_help_speaks_to_operators() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "Operate chameleond training jobs" in proc.stdout
    assert "examples:" in proc.stdout and "chameleonctl status --job" in proc.stdout
    assert "add_arguments" not in proc.stdout and "dispatches" not in proc.stdout
