"""The recovery report is built from recorded stream entries only, and is null where it has none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chameleond.local.report import Injection, build_report, print_table, write_report
from chameleond.local.timeline import committed_steps
from chameleond.records import DecisionRecord

T0 = 1_700_000_000_000  # ms


def eid(ms: float) -> str:
    return f"{int(T0 + ms)}-0"


def step_events(
    gen: int, step: int, ms: float, workers: list[str]
) -> list[tuple[str, dict[str, str]]]:
    return [
        (
            eid(ms + i),
            {
                "type": "step",
                "worker": w,
                "generation": str(gen),
                "step": str(step),
                "samples": "12",
                "seconds": "0.190",
                "loss": str(5.0 - 0.1 * step) if i == len(workers) - 1 else "0",
            },
        )
        for i, w in enumerate(workers)
    ]


def decision(ms: float, gen: int, failed: list[str], selected: str) -> tuple[str, dict[str, str]]:
    cands: list[dict[str, Any]] = [
        {
            "policy": "reroute",
            "feasible": True,
            "reason": "",
            "step_seconds": 0.3,
            "transition_seconds": 0.0,
            "score": 40.0,
        },
        {
            "policy": "dynamic",
            "feasible": True,
            "reason": "",
            "step_seconds": 0.25,
            "transition_seconds": 2.0,
            "score": 30.0,
        },
    ]
    estimate = 0.3 if selected == "reroute" else 0.25
    record = DecisionRecord(gen, selected, "fault", (T0 + ms) / 1000, mtbf_seconds=60.0,
                            failed=tuple(failed), faults=tuple(failed), candidates=tuple(cands),
                            step_seconds=estimate)  # fmt: skip
    return eid(ms), record.to_fields()


def recorded() -> tuple[list[tuple[str, dict[str, str]]], list[tuple[str, dict[str, str]]]]:
    six = ["w0", "w1", "w2", "w3", "w4", "w5"]
    five = [w for w in six if w != "w4"]
    events: list[tuple[str, dict[str, str]]] = []
    for s in range(5):  # generation 1: a commit every 200 ms
        events += step_events(1, s, 200.0 * s, six)
    events += step_events(1, 5, 1000.0, six[:3])  # w4 died: step 5 never commits
    events.append((eid(1150), {"type": "fault", "worker": "w4", "cause": "peer lost"}))
    for s in range(5, 10):  # generation 2 from 1400 ms, a commit every 300 ms
        events += step_events(2, s, 1400.0 + 300.0 * (s - 5), five)
    return events, [decision(1200, 2, ["w4"], "reroute")]


def test_committed_steps_need_every_reporter() -> None:
    events, _ = recorded()
    steps = committed_steps(events)
    assert [(s.generation, s.step) for s in steps] == [(1, i) for i in range(5)] + [
        (2, i) for i in range(5, 10)
    ]
    assert steps[0].loss == 5.0 and steps[0].seconds == 0.19


def test_report_rows_are_measured(tmp_path: Path) -> None:
    events, decisions = recorded()
    kill_at = (T0 + 1100) / 1000
    report = build_report(
        job="default",
        global_batch=48,
        injections=[Injection(kill_at, "w4", "kill", "kill -9 (injected)", "step=4")],
        events=events,
        decisions=decisions,
    )
    [row] = report["faults"]
    assert row["worker"] == "w4" and row["policy"] == "reroute" and row["generation"] == 2
    assert row["detection_seconds"] == 0.05
    assert row["decision_seconds"] == 0.05
    assert row["recovery_seconds"] == 0.304  # first commit of generation 2: the last reporter
    assert row["throughput_before"] == 240.0  # 48 samples / 0.2 s
    assert row["throughput_after"] == 160.0  # 48 samples / 0.3 s
    assert row["estimated_step_seconds"] == 0.3 and row["measured_step_seconds"] == 0.19
    assert "reroute score 40.00" in row["why"] and "D=60s" in row["why"]
    assert report["steps_committed"] == 10
    json_path, png_path = write_report(report, tmp_path)
    assert json.loads(json_path.read_text())["faults"][0]["worker"] == "w4"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_restore_decided_again_is_the_recovery_of_the_fault() -> None:
    # Generation 2 restores a checkpoint no worker can load; generation 3, decided on w0's
    # report, restores an older one and trains.
    events, _ = recorded()
    events = [e for e in events if e[1].get("generation") != "2"]
    five = ["w0", "w1", "w2", "w3", "w5"]
    for s in range(5, 8):
        events += step_events(3, s, 1600.0 + 300.0 * (s - 5), five)
    first = decision(1200, 2, ["w4"], "restore")
    again = decision(1300, 3, ["w4"], "restore")
    again[1].update(faults="[]", unrestorable='["w0"]')
    report = build_report(
        job="default",
        global_batch=48,
        injections=[Injection((T0 + 1100) / 1000, "w4", "kill", "kill", "step=4")],
        events=events,
        decisions=[first, again],
    )
    [row] = report["faults"]
    assert row["generation"] == 3 and row["policy"] == "restore"
    assert row["recovery_seconds"] == 0.504  # first commit of generation 3: the last reporter


def test_missing_measurements_are_null_not_guessed() -> None:
    events, _ = recorded()
    report = build_report(
        job="default",
        global_batch=48,
        injections=[Injection((T0 + 1100) / 1000, "w4", "kill", "kill", "step=4")],
        events=[e for e in events if e[1]["type"] != "fault"],
        decisions=[],
    )
    [row] = report["faults"]
    assert row["policy"] is None and row["decision_seconds"] is None
    assert row["detection_seconds"] is None and row["recovery_seconds"] is None
    assert row["throughput_before"] == 240.0


def test_table_prints_each_fault(tmp_path: Path) -> None:
    import io

    events, decisions = recorded()
    report = build_report(
        job="default",
        global_batch=48,
        injections=[Injection((T0 + 1100) / 1000, "w4", "kill", "kill -9", "step=4")],
        events=events,
        decisions=decisions,
    )
    out = io.StringIO()
    print_table(report, out)
    text = out.getvalue()
    assert "w4" in text and "reroute" in text and "why:" in text


def test_a_second_loss_of_a_worker_is_matched_to_the_decision_that_answers_it() -> None:
    """w4 is lost (generation 2), comes back and is kept out on standby, then, a second time,
    is lost while on standby; w1 is lost later. The cumulative `failed` of w1's decision names
    w4 too: only the decision whose new `faults` name w4 answers a loss of w4."""
    events, decisions = recorded()
    kept = decision(2000, 2, ["w4"], "")
    kept[1].update(joined=json.dumps(["w4"]), faults="[]", generation="2")
    later = decision(3000, 3, ["w1", "w4"], "dynamic")
    later[1]["faults"] = json.dumps(["w1"])
    decisions[0][1]["faults"] = json.dumps(["w4"])
    events += step_events(3, 12, 3200.0, ["w0", "w2", "w3", "w5"])
    at = [(T0 + ms) / 1000 for ms in (1100, 1900, 2500, 2900)]
    report = build_report(
        job="default",
        global_batch=48,
        injections=[
            Injection(at[0], "w4", "kill", "kill", "step=4"),
            Injection(at[1], "w4", "start", "trace: node9 added", "trace"),
            Injection(at[2], "w4", "kill", "kill", "trace"),
            Injection(at[3], "w1", "kill", "kill", "trace"),
        ],
        events=events,
        decisions=[*decisions, kept, later],
    )
    first, second, w1 = report["faults"]
    assert first["generation"] == 2 and first["recovery_seconds"] == 0.304
    # The spare's loss changed no plan: no decision, nothing recovered, never a negative time.
    assert second["policy"] is None and second["recovery_seconds"] is None
    assert w1["policy"] == "dynamic" and w1["generation"] == 3 and w1["recovery_seconds"] > 0
    [rejoin] = report["rejoins"]
    # Kept out: the current plan was kept, so no "back to training" time.
    assert rejoin["policy"] is None and rejoin["recovery_seconds"] is None
