"""Trace replay: parsing `time_ms,add|remove,nodeN`, mapping onto local workers, compression."""

from __future__ import annotations

from pathlib import Path

import pytest

from chameleond.local.trace import (
    ReplayStep,
    TraceError,
    load_trace,
    parse_trace,
    plan_replay,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces" / "oobleck-10m.csv"
WORKERS = ["w0", "w1", "w2", "w3", "w4", "w5"]


def test_removals_kill_and_a_later_add_rejoins() -> None:
    events = parse_trace(
        [
            "0,add,node1",
            "0,add,node2",
            "0,add,node3",
            "0,add,node4",
            "0,add,node5",
            "0,add,node6",
            "0,add,node7",
            "4000,remove,node5",
            "6000,remove,node7",
            "9000,remove,node2",
            "12000,add,node5",
            "13000,add,node99",
        ]
    )
    replay = plan_replay(events, WORKERS, time_scale=2.0)
    assert replay.mapping == {f"node{i + 1}": w for i, w in enumerate(WORKERS)}
    assert replay.steps == (
        ReplayStep(2.0, "kill", "w4", "node5", 4000),
        ReplayStep(4.5, "kill", "w1", "node2", 9000),
        ReplayStep(6.0, "start", "w4", "node5", 12000),
    )
    assert replay.skipped == 3  # node7 (beyond six workers: add, remove) and node99 (added late)


def test_double_remove_and_double_add_are_no_ops() -> None:
    events = parse_trace(["0,add,a", "1,remove,a", "2,remove,a", "3,add,a", "4,add,a"])
    replay = plan_replay(events, ["w0"], time_scale=1.0)
    assert [s.action for s in replay.steps] == ["kill", "start"]
    assert replay.skipped == 2


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("10,remove", "expected time_ms"),
        ("ten,remove,node1", "time_ms must be an integer"),
        ("-5,remove,node1", "must be >= 0"),
        ("10,fail,node1", "add or remove"),
        ("10,remove,node 1", "without spaces"),
    ],
)
def test_bad_lines_name_the_line(line: str, fragment: str) -> None:
    with pytest.raises(TraceError, match=f"t:2: .*{fragment}"):
        parse_trace(["0,add,node1", line], source="t")


def test_out_of_order_and_bad_scale() -> None:
    with pytest.raises(TraceError, match="time order"):
        parse_trace(["5,add,a", "1,remove,a"])
    with pytest.raises(TraceError, match="time scale"):
        plan_replay((), WORKERS, time_scale=0)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="No such file"):
        load_trace(tmp_path / "nope.csv")


@pytest.mark.skipif(not SHARED.exists(), reason="shared traces not checked out beside the repo")
def test_published_trace_maps_onto_six_workers() -> None:
    replay = plan_replay(load_trace(SHARED), WORKERS, time_scale=600.0)
    # node5 (w4) is removed at 601.2 s and node1 (w0) at 3006 s; other nodes are beyond six.
    assert [(s.worker, s.action, round(s.seconds, 3)) for s in replay.steps] == [
        ("w4", "kill", 1.002),
        ("w0", "kill", 5.01),
    ]


@pytest.mark.slow
def test_trace_replay_with_removals_and_a_rejoin_completes(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    trace = tmp_path / "trace.csv"
    lines = [f"0,add,node{i}" for i in range(1, 7)]
    # Time scale 1: node1 (w0) fails 1 s into training, is back at 2 s; node3 (w2) fails at 3 s.
    lines += ["1000,remove,node1", "2000,add,node1", "3000,remove,node3", "4000,remove,node42"]
    trace.write_text("\n".join(lines) + "\n")
    report_dir = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable, "-m", "chameleond.cli.ctl", "up", "--trace", str(trace),
            "--time-scale", "1", "--steps", "200", "--report", str(report_dir), "--timeout", "240",
        ],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 events skipped" not in proc.stdout  # node42's remove is the one skipped event
    assert "1 events skipped" in proc.stdout
    report = json.loads((report_dir / "report.json").read_text())
    assert [(f["worker"], f["action"]) for f in report["faults"]] == [
        ("w0", "kill"),
        ("w2", "kill"),
    ]
    assert all(f["policy"] in ("reroute", "dynamic") for f in report["faults"])
    [rejoin] = report["rejoins"]
    assert rejoin["worker"] == "w0" and rejoin["action"] == "start"
    # The restarted w0 registered again and the daemon decided about taking it back.
    assert rejoin["generation"] is not None, rejoin
