"""`chameleonctl` as a user runs it: a subprocess, its output captured (a pipe, not a terminal, so
progress must come as plain lines)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def chameleonctl(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 280
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
