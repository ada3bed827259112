"""`chameleonctl up` end to end: real redis-server, chameleond and CPU workers, real kill -9."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from cli_harness import chameleonctl

pytestmark = pytest.mark.slow

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def leftover_processes(port: str) -> list[str]:
    """Processes whose command line still names the run's Redis port."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f":{port}" in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def test_up_with_two_faults_reports_both_with_measured_numbers(tmp_path: Path) -> None:
    report_dir = tmp_path / "report"
    # A relative --report, as `make run` gives it (the default, chameleon-report/).
    proc = chameleonctl(
        "up", "--steps", "40", "--faults", "kill:w0@step=8,kill:w2@step=22",
        "--report", "report", "--timeout", "240", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert not CONTROL.search(out.replace("\n", "")), "control codes in non-terminal output"
    assert re.search(r"^step \d+/40  loss \d", out, re.M)
    assert "fault: kill -9 w0" in out and "fault: kill -9 w2" in out
    report = json.loads((report_dir / "report.json").read_text())
    assert report["completed"] and report["steps_committed"] >= 40
    faults = report["faults"]
    assert [f["worker"] for f in faults] == ["w0", "w2"]
    for f in faults:
        assert f["policy"] in ("reroute", "dynamic"), f
        for key in ("decision_seconds", "recovery_seconds", "detection_seconds"):
            assert isinstance(f[key], float) and f[key] >= 0, (key, f)
        assert f["throughput_before"] > 0 and f["throughput_after"] > 0, f
        assert f["recovery_seconds"] >= f["decision_seconds"]
        assert [c["policy"] for c in f["candidates"]] == ["reroute", "dynamic", "drop"]
        assert f["mtbf_seconds"] > 0 and f["estimated_step_seconds"] > 0
        # The policy run is the one the model scored best, from the scores the report recorded.
        usable = [c for c in f["candidates"] if c["feasible"] and c["score"] is not None]
        assert f["policy"] == max(usable, key=lambda c: c["score"])["policy"], f["why"]
    assert (report_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert "Recovery report" in out and "why:" in out
    port = re.search(r"redis redis://127\.0\.0\.1:(\d+)/", out)
    assert port and not leftover_processes(port.group(1))


def test_bad_fault_spec_is_one_clear_line(tmp_path: Path) -> None:
    proc = chameleonctl("up", "--faults", "kill:w9@step=3", "--report", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "chameleonctl up: kill:w9@step=3: no worker 'w9'"
        " (the cluster runs w0, w1, w2, w3, w4, w5, w6)"
    )


def test_up_restores_the_checkpoint_when_every_copy_of_some_layers_is_killed(
    tmp_path: Path,
) -> None:
    # 3 pipelines x 2 stages: w0, w2 and w4 hold the first stage's layers, and all three die.
    proc = chameleonctl(
        "up", "--workers", "6", "--pp", "2", "--steps", "30", "--checkpoint-every", "5",
        "--faults", "kill:w0@step=12,kill:w2@step=12,kill:w4@step=12",
        "--report", str(tmp_path / "report"), "--timeout", "200",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["completed"], report["ended"]
    restores = [f for f in report["faults"] if f["policy"] == "restore"]
    assert restores, [f["why"] for f in report["faults"]]
    assert "lost every replica" in restores[0]["why"] and "checkpoint of step" in restores[0]["why"]
    generation = restores[0]["generation"]
    before: dict[int, float] = {}
    again: dict[int, float] = {}
    for entry in report["timeline"]:
        into = again if entry["generation"] == generation else before
        into.setdefault(entry["step"], entry["loss"])
    # Training resumes right after a checkpoint (every 5 steps: step 4 or 9 is the newest), and
    # the steps trained again reproduce the losses they had before the faults.
    assert min(again) in (5, 10), sorted(again)
    retrained = sorted(set(before) & set(again))
    assert retrained and retrained[0] == min(again)
    for step in retrained:
        assert again[step] == pytest.approx(before[step], rel=1e-5), step
    assert max(again) >= 29  # trained on to the end (a step more may commit before the stop)


def test_a_restore_no_worker_can_load_falls_back_to_the_older_checkpoint(tmp_path: Path) -> None:
    # The first stage's holders all die at step 12, and their newest files (step 9) are cut short
    # first: the restore of step 9 cannot be loaded, so the daemon restores step 4 instead.
    lost = ("w0", "w2", "w4")
    faults = [f"corrupt:{w}@step=12" for w in lost] + [f"kill:{w}@step=12" for w in lost]
    proc = chameleonctl(
        "up", "--workers", "6", "--pp", "2", "--steps", "30", "--checkpoint-every", "5",
        "--faults", ",".join(faults), "--report", str(tmp_path / "report"), "--timeout", "200",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["completed"], report["ended"]
    assert "cut to half its length" in proc.stdout
    # The last kill is answered by the restore that trained (the earlier ones, when decided
    # apart, by plans it replaced): the one of step 4, decided after a worker reported it could
    # not load step 9.
    last = report["faults"][-1]
    assert last["policy"] == "restore", [f["why"] for f in report["faults"]]
    assert "cannot restore: no readable file of step 9" in last["why"], last["why"]
    assert "checkpoint of step 4" in last["why"], last["why"]
    assert last["recovery_seconds"] is not None, last
    generation = last["generation"]
    before: dict[int, float] = {}
    again: dict[int, float] = {}
    for entry in report["timeline"]:
        into = again if entry["generation"] == generation else before
        into.setdefault(entry["step"], entry["loss"])
    assert min(again) == 5, sorted(again)
    retrained = sorted(set(before) & set(again))
    assert retrained[0] == 5 and retrained[-1] >= 12
    for step in retrained:
        assert again[step] == pytest.approx(before[step], rel=1e-5), step
