"""The decisions stream's records: one definition per kind writes and reads it, and reading an
entry Redis holds never fails on what the daemon did not write."""

from __future__ import annotations

import json

from chameleond.core.machine import Phase, Transition
from chameleond.records import (
    DecisionRecord,
    TransitionRecord,
    entry_seconds,
    read_decisions,
    read_record,
)

CANDIDATES = (
    {"policy": "reroute", "feasible": True, "step_seconds": 0.31, "score": 1.0},
    {"policy": "dynamic", "feasible": True, "step_seconds": 0.24, "score": 1.2},
)
DECIDED = DecisionRecord(
    generation=3, selected="dynamic", cause="fault w1", at=1_700_000_000.25,
    mtbf_seconds=3600.0, failed=("w1", "w4"), faults=("w1",), joined=("w9",),
    candidates=CANDIDATES, search_seconds=0.0123, decision_seconds=0.5, step_seconds=0.24,
    detail={"w1": "gloo: connection reset by peer"}, note="forced dynamic",
)  # fmt: skip


def test_a_decision_reads_back_as_written() -> None:
    fields = DECIDED.to_fields()
    assert all(isinstance(v, str) for v in fields.values())
    assert fields["kind"] == "decision"
    assert json.loads(fields["failed"]) == ["w1", "w4"]
    assert fields["mtbf_seconds"] == "3600.000" and fields["at"] == "1700000000.250000"
    back = read_record("1700000000300-0", fields)
    assert back == DECIDED
    assert isinstance(back, DecisionRecord) and back.stored_at == 1_700_000_000.3
    assert back.received_at == 1_699_999_999.75


def test_a_record_that_scored_nothing_writes_no_empty_figures() -> None:
    kept = DecisionRecord(0, "", "initial plan", 5.0, unrecoverable="no initial plan: too big")
    fields = kept.to_fields()
    assert "search_seconds" not in fields and "step_seconds" not in fields
    assert "note" not in fields and "detail" not in fields
    assert DecisionRecord.from_fields(fields) == kept


def test_the_estimate_is_the_records_else_the_selected_candidates() -> None:
    assert DECIDED.estimate == 0.24
    without = DecisionRecord(3, "reroute", "fault w1", 1.0, candidates=CANDIDATES)
    assert without.estimate == 0.31
    assert DecisionRecord(3, "", "kept", 1.0, candidates=CANDIDATES).estimate is None


def test_a_transition_reads_back_as_written() -> None:
    t = TransitionRecord.of(Transition(Phase.TRAINING, Phase.PLANNING, 2, "fault w1", 9.5))
    fields = t.to_fields()
    assert fields == {"kind": "transition", "from": "training", "to": "planning",
                      "generation": "2", "cause": "fault w1", "at": "9.500000"}  # fmt: skip
    assert read_record("9500-1", fields) == t


def test_what_the_daemon_did_not_write_reads_as_absent() -> None:
    assert read_record("1-0", {"kind": "something else"}) is None
    assert read_record("1-0", {"type": "fault"}) is None
    loose = read_record("1-0", {"kind": "decision", "generation": "x", "failed": "[not json",
                                "mtbf_seconds": "inf", "candidates": '{"a": 1}'})  # fmt: skip
    assert loose == DecisionRecord(0, "", "", 0.0)
    # `faults` absent (a record with only `failed`): the failed workers are the faults
    assert DecisionRecord.from_fields({"failed": '["w2"]'}).faults == ("w2",)
    assert DecisionRecord.from_fields({"failed": '["w2"]', "faults": "[]"}).faults == ()


def test_read_decisions_keeps_the_decisions_in_order() -> None:
    t = TransitionRecord("training", "planning", 2, "fault", 1.0).to_fields()
    entries = [("1000-0", DECIDED.to_fields()), ("1001-0", t),
               ("1002-0", DecisionRecord(4, "", "kept", 2.0).to_fields())]  # fmt: skip
    assert [d.generation for d in read_decisions(entries)] == [3, 4]
    assert entry_seconds("1002-0") == 1.002
