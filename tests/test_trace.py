"""Trace replay: parsing `time_ms,add|remove,nodeN`, mapping onto local workers, compression."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from chameleond.traces import packaged_traces
from chameleond.traces.replay import (
    ReplayStep,
    TraceError,
    TraceEvent,
    load_trace,
    parse_trace,
    plan_replay,
)

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
            "10000,remove,node3",
            "12000,add,node5",
            "13000,add,node99",
            "14000,add,node100",
            "15000,add,node101",
        ]
    )
    replay = plan_replay(events, WORKERS, time_scale=2.0)
    assert replay.steps == (
        ReplayStep(2.0, "kill", "w4", "node5", 4000),
        ReplayStep(4.5, "kill", "w1", "node2", 9000),
        ReplayStep(5.0, "kill", "w2", "node3", 10000),
        ReplayStep(6.0, "start", "w4", "node5", 12000),  # its own slot again
        ReplayStep(6.5, "start", "w1", "node99", 13000),  # new nodes: the first free slot
        ReplayStep(7.0, "start", "w2", "node100", 14000),
    )
    assert replay.mapping == {
        **{f"node{i + 1}": w for i, w in enumerate(WORKERS)},
        "node99": "w1",
        "node100": "w2",
    }
    # node7 (beyond six workers: its add and its remove) and node101 (every worker runs again)
    assert replay.skipped == 3


def test_a_returning_node_takes_a_free_slot_when_its_own_is_taken() -> None:
    events = parse_trace(["0,add,a", "0,add,b", "1,remove,a", "2,remove,b", "3,add,c", "4,add,a"])
    replay = plan_replay(events, ["w0", "w1"], time_scale=1.0)
    assert [(s.action, s.worker, s.node) for s in replay.steps] == [
        ("kill", "w0", "a"),
        ("kill", "w1", "b"),
        ("start", "w0", "c"),
        ("start", "w1", "a"),
    ]


def test_the_first_nodes_added_take_the_workers_whenever_they_come() -> None:
    events = parse_trace(["500,add,a", "900,remove,a", "1000,add,b", "1200,add,c", "1300,add,d"])
    replay = plan_replay(events, ["w0", "w1"], time_scale=1.0)
    # a takes w0 (no action: the workers start with the job); b restarts w0 rather than take
    # the unheld w1; c takes w1; d finds every worker held.
    assert [(s.action, s.worker, s.node) for s in replay.steps] == [
        ("kill", "w0", "a"),
        ("start", "w0", "b"),
    ]
    assert replay.mapping == {"a": "w0", "b": "w0", "c": "w1"}
    assert replay.skipped == 1


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


def test_published_trace_maps_onto_six_workers() -> None:
    replay = plan_replay(load_trace("oobleck-10m"), WORKERS, time_scale=600.0)
    # node5 (w4) is removed at 601.2 s and node1 (w0) at 3006 s; other nodes are beyond six.
    assert [(s.worker, s.action, round(s.seconds, 3)) for s in replay.steps] == [
        ("w4", "kill", 1.002),
        ("w0", "kill", 5.01),
    ]


def test_a_packaged_trace_is_found_by_name_and_a_file_wins_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "oobleck-p3-trace" in packaged_traces()
    events = load_trace("oobleck-p3-trace")  # AWS p3 spot availability, about 11 hours
    assert (sum(e.action == "add" for e in events), sum(e.action == "remove" for e in events)) == (
        177,
        167,
    )
    assert load_trace("oobleck-p3-trace") == load_trace("oobleck-p3-trace.csv")
    monkeypatch.chdir(tmp_path)
    Path("oobleck-10m.csv").write_text("0,add,mine\n")
    assert load_trace("oobleck-10m.csv") == (TraceEvent(0, "add", "mine"),)
    with pytest.raises(TraceError, match=r"packaged traces: .*oobleck-10m"):
        load_trace("oobleck-11m")


@pytest.mark.parametrize(
    "name", ["oobleck-p3-trace", "oobleck-g4dn-trace", "oobleck-scaled-gcp-trace"]
)
def test_a_real_spot_trace_replays_removals_and_rejoins(name: str) -> None:
    # AWS p3 / g4dn and GCP spot availability, about 11 hours each; the g4dn and GCP traces add
    # their first node minutes in.
    events = load_trace(name)
    replay = plan_replay(events, WORKERS, time_scale=3600.0)
    assert sorted(set(replay.mapping.values())) == sorted(WORKERS)
    # Per worker, kills and starts alternate, beginning with a kill: a worker starts again only
    # once it is down, and a new node takes its slot.
    for w in WORKERS:
        actions = [s.action for s in replay.steps if s.worker == w]
        assert actions == ["kill", "start"] * (len(actions) // 2) + ["kill"] * (len(actions) % 2)
    starts = [s for s in replay.steps if s.action == "start"]
    assert len(starts) >= 10 and len({s.node for s in starts}) == len(starts)
    assert all(a.seconds <= b.seconds for a, b in itertools.pairwise(replay.steps))
    held = len(WORKERS)  # the first six adds take the workers without an action
    assert len(replay.steps) + replay.skipped == len(events) - held


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
    # The restarted w0 registered again and the daemon decided about taking it back: a new plan
    # with it, or the current plan kept (no generation: w0 then waits on standby).
    assert rejoin["why"] != "no decision recorded", rejoin
    assert (rejoin["policy"] is None) == (rejoin["generation"] is None), rejoin
