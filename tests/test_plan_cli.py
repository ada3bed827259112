"""`chameleonctl plan` and `chameleonctl bench planner`: output keys, errors as exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chameleond.cli.ctl import main

ROOT = Path(__file__).resolve().parent.parent
CANDIDATE_KEYS = {
    "policy", "step_seconds", "transition_seconds", "score", "peak_memory_bytes", "feasible",
    "reason",
}  # fmt: skip


def test_plan_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    spec = ROOT / "examples" / "gpt-32.toml"
    assert main(["plan", "--spec", str(spec), "--fail", "w5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"selected", "candidates", "search_seconds"}
    assert out["selected"] in ("reroute", "dynamic")
    assert [c["policy"] for c in out["candidates"]] == ["reroute", "dynamic"]
    assert all(set(c) == CANDIDATE_KEYS for c in out["candidates"])
    assert out["search_seconds"] >= 0


def test_plan_text_and_policy_override(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--fail", "w1", "--mtbf", "1e9", "--policy", "reroute"]) == 0
    text = capsys.readouterr().out
    assert "selected: reroute" in text and "search_seconds" in text and "D (mtbf_seconds)" in text


def test_unrecoverable_is_a_result(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--fail", "w0,w2,w4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["selected"] is None
    assert "lost every replica" in out["candidates"][0]["reason"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--fail", "w99"], "unknown worker(s) w99"),
        (["plan", "--spec", "/nonexistent.toml", "--fail", "w1"], "No such file"),
        (["plan", "--fail", "w1", "--mtbf", "-5"], "--mtbf"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_malformed_spec_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[workers]]\nid = "w0"\n')
    assert main(["plan", "--spec", str(bad), "--fail", "w0"]) == 2
    assert "memory_bytes" in capsys.readouterr().err


def test_bench_planner_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "planner", "--sizes", "8", "--repeat", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    assert set(rows[0]) == {
        "devices", "p50_seconds", "p99_seconds", "plans_considered", "optimality_gap",
    }  # fmt: skip
    assert rows[0]["devices"] == 8 and rows[0]["optimality_gap"] == 0.0


def test_bench_checkpoint_rejects_a_layout_or_count_it_cannot_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "checkpoint", "--workers", "3", "--pp", "2"]) == 2
    assert "--pp 2 does not divide --workers 3" in capsys.readouterr().err
    assert main(["bench", "checkpoint", "--every", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
