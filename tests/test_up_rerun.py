"""Two `chameleonctl up` runs in a row into one report directory: each trains a fresh job and
writes its own report; the second never resumes the first's finished job from the embedded Redis's
append-only file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow


def up(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "up", "--workers", "4", "--pp", "2",
         "--steps", "10", "--checkpoint-every", "0", "--report", "out", "--timeout", "200", *args],
        capture_output=True, text=True, timeout=280, check=False, cwd=cwd,
    )  # fmt: skip


def report(cwd: Path) -> dict[str, Any]:
    return dict(json.loads((cwd / "out" / "report.json").read_text()))


def test_a_second_up_trains_a_fresh_job_and_reports_it(tmp_path: Path) -> None:
    first = up(tmp_path, "--faults", "none")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    one = report(tmp_path)
    assert one["completed"] and one["faults"] == []
    second = up(tmp_path, "--faults", "kill:w1@step=4")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    two = report(tmp_path)
    assert two["run_id"] != one["run_id"]
    assert f"run {two['run_id']}" in second.stdout
    # The second run trained every step itself, after the first had ended.
    assert two["completed"] and two["steps_committed"] >= 10
    assert min(e["at"] for e in two["timeline"]) > max(e["at"] for e in one["timeline"])
    assert min(e["step"] for e in two["timeline"]) == 0
    assert [f["worker"] for f in two["faults"]] == ["w1"]
    assert two["faults"][0]["policy"] in ("reroute", "dynamic")
    # Every plan carries the model's estimate (the chart draws it beside the measured throughput).
    assert two["plans"][0]["policy"] == "initial" and len(two["plans"]) >= 2
    assert all(p["estimated_step_seconds"] > 0 for p in two["plans"]), two["plans"]
    # One run's logs only: the first run's chameleond log is gone with its Redis data.
    assert "fault: kill -9 w1" in second.stdout
    log = (tmp_path / "out" / "run" / "logs" / "chameleond.log").read_text()
    assert log.count("published generation=1 ") == 1


def test_up_on_a_redis_that_holds_the_job_refuses_to_resume_it(tmp_path: Path) -> None:
    from chameleond.protocol import Keys
    from chameleond.redis_server import RedisServer

    with RedisServer(tmp_path / "redis") as server:
        import redis

        with redis.Redis.from_url(server.url) as client:
            client.hset(Keys("done").state, "generation", "3")
        proc = subprocess.run(
            [sys.executable, "-m", "chameleond.cli.ctl", "up", "--redis-url", server.url,
             "--job", "done", "--report", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "job 'done' already has state in that Redis" in proc.stderr
    assert not (tmp_path / "out").exists()
