"""`chameleonctl bench sim-check`: the simulated step times are the plans' own estimates (bubble
checkpoints off), before the fault and on the plan chosen at it; one real run end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chameleond.bench.simcheck import simulated
from chameleond.core.decide import decide, initial_plan
from chameleond.jobs import load_default_spec


def test_simulated_step_times_are_the_plans_estimates() -> None:
    spec = load_default_spec()
    sim = simulated(spec, "w3", 30.0)
    start = initial_plan(spec)
    assert sim["initial"] == pytest.approx(start.estimates.step_seconds)
    # The daemon's decision for the same cluster state (D from one fault after 30 s).
    d = decide(spec, start, ["w3"], mtbf_seconds=(spec.mtbf_prior_seconds + 30.0) / 2,
               generation=2)  # fmt: skip
    assert sim["selected"][0] == d.selected
    final = d.follow_up or d.plan
    assert final is not None and sim["plan"] is not None
    assert sim["plan"].pipelines == final.pipelines
    assert sim["after_fault"] == pytest.approx(final.estimates.step_seconds)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_run_measures_and_simulates_the_same_plans() -> None:
    """Real workers, a real kill -9: the simulator, fed the profiles the workers reported,
    chooses the daemon's layout, and both periods get a simulated and a measured step."""
    out = subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "bench", "sim-check", "--json",
         "--warmup", "12", "--after", "12"],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    (run,) = report["runs"]
    assert run["same_layout"], run
    assert run["simulated_selected"] == [run["daemon_policy"]]
    for period in ("initial", "after_fault"):
        simulated, measured = (
            run["simulated_step_seconds"][period],
            run["measured_step_seconds"][period],
        )
        assert simulated > 0 and measured > 0
        assert run["errors"][period] == pytest.approx(
            abs(simulated - measured) / measured, abs=1e-3
        )
    assert report["simulated_step_error"] == max(run["errors"].values())


def test_too_few_steps_are_a_usage_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "bench", "sim-check", "--after", "2"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "--after" in out.stderr
