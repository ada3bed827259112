"""`chameleonctl bench chaos` end to end, one trial: two real daemons on a real Redis, the leader
killed with -9 mid-recovery; the standby takes over within the lease and the fault is answered
exactly once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_one_kill_trial_loses_nothing_and_decides_once() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "bench", "chaos", "--json",
         "--trials", "1", "--kinds", "kill", "--seed", "3"],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    for key in ("trials", "lost_events", "duplicate_applications", "crashes", "forged_accepted",
                "max_recovery_seconds", "max_takeover_seconds"):  # fmt: skip
        assert key in report
    assert report["trials"] == 1
    assert (report["lost_events"], report["duplicate_applications"], report["crashes"]) == (0, 0, 0)
    assert report["max_takeover_seconds"] < report["lease_seconds"], report


def test_bad_arguments_are_a_usage_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "bench", "chaos", "--kinds", "nope"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "unknown trial kinds" in out.stderr
