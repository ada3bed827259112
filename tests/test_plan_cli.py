"""`chameleonctl plan` and `chameleonctl bench planner`: output keys, errors as exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chameleond.bench import BENCHES
from chameleond.cli.ctl import main
from chameleond.core.plan import plan_from_dict
from chameleond.core.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
CANDIDATE_KEYS = {
    "policy", "step_seconds", "transition_seconds", "score", "peak_memory_bytes", "feasible",
    "reason", "at_risk", "generation", "global_batch",
}  # fmt: skip
DECISION_KEYS = {
    "selected", "candidates", "search_seconds", "generation", "plan_generation", "cause",
    "unrecoverable", "mtbf_seconds", "window_seconds", "plans_considered", "follow_up", "note",
    "plan",
}  # fmt: skip


def test_plan_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    spec = ROOT / "examples" / "gpt-32.toml"
    assert main(["plan", "--spec", str(spec), "--fail", "w5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == DECISION_KEYS
    assert out["selected"] in ("reroute", "dynamic")
    assert [c["policy"] for c in out["candidates"]] == ["reroute", "dynamic", "drop"]
    assert all(set(c) == CANDIDATE_KEYS for c in out["candidates"])
    assert out["search_seconds"] >= 0
    assert (
        out["unrecoverable"] is None and out["mtbf_seconds"] == load_spec(spec).mtbf_prior_seconds
    )
    plan = plan_from_dict(out["plan"])
    assert plan.policy == out["selected"] and plan.generation == out["plan_generation"] == 2
    assert plan.excluded == ("w5",)


def test_plan_json_carries_the_follow_up(capsys: pytest.CaptureFixture[str]) -> None:
    spec = ROOT / "examples" / "gpt-32.toml"
    argv = ["plan", "--spec", str(spec), "--fail", "w5", "--policy", "reroute", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["selected"] == "reroute" and out["note"] == ""
    assert out["follow_up"]["generation"] == 3 and out["follow_up"]["after_seconds"] > 0


@pytest.mark.parametrize(
    "spec",
    ["chameleond/jobs/cpu-small.toml", "chameleond/jobs/cpu-mixed.toml", "examples/cpu-small.toml"],
)
def test_unrecoverable_is_a_result_with_exit_3(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--spec", str(ROOT / spec), "--fail", "w0,w2,w4", "--json"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert out["selected"] is None and out["plan"] is None
    assert "lost every replica" in out["candidates"][0]["reason"]
    assert "lost every replica (workers w0, w2, w4 failed)" in out["unrecoverable"]
    assert main(["plan", "--spec", str(ROOT / spec), "--fail", "w0,w2,w4"]) == 3
    assert "unrecoverable: layers" in capsys.readouterr().out


def test_plan_help_documents_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "3 when no plan can continue training" in text and "2 on a bad spec" in text


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


DEFAULT_TEXT = (ROOT / "chameleond" / "jobs" / "cpu-small.toml").read_text()


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("micro_batch = 2", "micro_batch = 0.5", "training.micro_batch"),
        ('[job]\nname = "cpu-small"', 'job = "x"\n[other]\nname = "a"', "job: expected a table"),
        ("stages = 2 ", 'stages = "two" ', "plan.stages"),
        ("rebuild_seconds = 0.5", 'rebuild_seconds = "slow"', "job.rebuild_seconds"),
        ("rebuild_seconds = 0.5", "rebuild_seconds = -1", "job.rebuild_seconds: must be >= 0"),
        ("mtbf_prior_seconds = 600.0", 'mtbf_prior_seconds = "x"', "job.mtbf_prior_seconds"),
        ("mtbf_prior_seconds = 600.0", "mtbf_prior_seconds = 0", "job.mtbf_prior_seconds"),
        ("global_batch = 12", "global_batch = 7.9", "training.global_batch"),
        ("min_stages = 1", "min_stages = 9", "search: min_stages 9 is above max_stages 6"),
    ],
)
def test_malformed_spec_values_exit_2_naming_the_field(
    old: str, new: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(DEFAULT_TEXT.replace(old, new, 1))
    assert main(["plan", "--spec", str(bad), "--fail", "w1"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert "--mtbf" not in err
    assert main(["up", "--spec", str(bad), "--report", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_layout_that_cannot_be_built_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    small = tmp_path / "small.toml"
    small.write_text(DEFAULT_TEXT.replace("memory_bytes = 2_147_483_648", "memory_bytes = 1000"))
    assert main(["plan", "--spec", str(small), "--fail", "w1"]) == 2
    assert "does not fit in memory" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["status"], ["inject", "--worker", "w1"],
                                     ["inject", "--worker", "w1", "--print-only"]])  # fmt: skip
@pytest.mark.parametrize("url", ["http://x", "redis://h:port/0"])
def test_a_bad_redis_url_exits_2_with_one_line(
    command: list[str], url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, "--redis-url", url]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"chameleonctl {command[0]}: bad --redis-url") and len(err.splitlines()) == 1
    )


def test_bench_help_names_every_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in BENCHES)


def test_bench_planner_json_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "planner", "--sizes", "8", "--repeat", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1
    assert set(rows[0]) == {
        "devices", "p50_seconds", "p99_seconds", "plans_considered", "optimality_gap",
        "p50_cpu_seconds", "p99_cpu_seconds", "exact_cpu_seconds", "first_seconds",
        "first_cpu_seconds", "unprepared_p50_seconds", "unprepared_p99_seconds",
        "unprepared_p99_cpu_seconds",
    }  # fmt: skip
    assert rows[0]["devices"] == 8 and rows[0]["optimality_gap"] == 0.0
    assert 0 < rows[0]["unprepared_p50_seconds"] <= rows[0]["unprepared_p99_seconds"]


def test_bench_checkpoint_rejects_a_layout_or_count_it_cannot_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "checkpoint", "--workers", "3", "--pp", "2"]) == 2
    assert "--pp 2 does not divide --workers 3" in capsys.readouterr().err
    assert main(["bench", "checkpoint", "--every", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
