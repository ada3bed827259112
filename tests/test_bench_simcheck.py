"""`chameleonctl bench sim-check`'s simulation side: the simulated step times are the plans' own
estimates (bubble checkpoints off), before the fault and on the plan chosen at it."""

from __future__ import annotations

import pytest

from chameleond.cli.bench_simcheck import simulated
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
