"""`chameleonctl up --example hf`: a user's training script (examples/hf_gpt2.py, a Hugging Face
GPT-2) as the local job's workers, end to end with a reroute and a re-partition."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from cli_harness import chameleonctl

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_example_and_spec_together_is_one_clear_line(tmp_path: Path) -> None:
    proc = chameleonctl("up", "--example", "hf", "--spec", "x.toml", "--report", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == "chameleonctl up: --example brings its own job spec: drop --spec"


def test_missing_examples_are_named(tmp_path: Path) -> None:
    proc = chameleonctl(
        "up", "--example", "hf", "--report", str(tmp_path),
        env={"CHAMELEON_EXAMPLES": str(tmp_path / "nowhere")},
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"{tmp_path / 'nowhere' / 'hf_gpt2.py'} not found" in proc.stderr
    assert "CHAMELEON_EXAMPLES" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_up_example_hf_reroutes_then_repartitions(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(EXAMPLES))
    import hf_gpt2

    # The workers read the tokenizer and token ids made here (else each trains its own).
    cache = tmp_path / "xdg"
    arch = hf_gpt2.arch_of({})
    hf_gpt2.text(arch, cache / "chameleond" / "hf-example")
    proc = chameleonctl(
        "up", "--example", "hf", "--steps", "24", "--faults", "kill:w0@step=6,kill:w5@step=14",
        "--report", "report", "--timeout", "240", cwd=tmp_path, env={"XDG_CACHE_HOME": str(cache)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fault: kill -9 w0" in proc.stdout and "fault: kill -9 w5" in proc.stdout
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["example"] == "hf" and report["model"] == "GPT2LMHeadModel"
    assert report["completed"] is True
    policies = [row["policy"] for row in report["faults"]]
    # One fault rerouted, the other re-partitioned: which first follows the model, which prices
    # plans with the links the workers measured (docs/planner.md, "Measured links").
    assert sorted(policies) == ["dynamic", "reroute"], report["faults"]
    logs = tmp_path / "report" / "run" / "logs"
    assert "profiled 6 layers of GPT2LMHeadModel" in (logs / "w1.log").read_text()
