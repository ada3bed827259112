"""The report chart's series: per-step throughput with gaps at plan changes, its rolling median
restarted after each gap, and the model's estimate as a step line per plan."""

from __future__ import annotations

import math
from pathlib import Path

from chameleond.local.chart import draw_chart, estimated, measured, smoothed


def step(t: float, generation: int, loss: float = 1.0) -> dict[str, float]:
    return {"t": t, "at": 1000.0 + t, "generation": generation, "loss": loss, "step": 0}


def test_series_break_at_a_new_plan_and_the_median_restarts() -> None:
    tl = [step(0, 1), step(1, 1), step(1.5, 1), step(4, 2), step(4.5, 2), step(5, 2)]
    points = measured(tl, batch=8)
    values = [v for _, v in points]
    assert math.isnan(values[0]) and values[1:3] == [8.0, 16.0]
    assert math.isnan(values[3]) and math.isnan(values[4])  # the gap, then the plan's first step
    assert values[5:] == [16.0, 16.0]
    med = smoothed(points, window=3)
    assert med[1:3] == [8.0, 12.0] and math.isnan(med[4]) and med[5] == 16.0


def test_the_estimate_is_drawn_per_plan_until_the_next() -> None:
    plans = [
        {"generation": 1, "t": -0.5, "estimated_step_seconds": 0.1, "policy": "initial"},
        {"generation": 2, "t": 3.0, "estimated_step_seconds": 0.2, "policy": "reroute"},
    ]
    xs, ys = estimated(plans, batch=8, end=9.0)
    assert xs[:2] == [0.0, 3.0] and ys[:2] == [80.0, 80.0] and math.isnan(ys[2])
    assert xs[3:5] == [3.0, 9.0] and ys[3:5] == [40.0, 40.0]


def test_the_chart_is_written(tmp_path: Path) -> None:
    tl = [step(i * 0.5, 1 if i < 6 else 2, 3 - i * 0.1) for i in range(12)]
    report = {
        "job": "j", "global_batch": 8, "timeline": tl, "steps_committed": 12,
        "plans": [{"generation": 1, "t": 0.0, "estimated_step_seconds": 0.4}],
        "faults": [{"at_seconds": 2.8, "worker": "w3", "action": "kill", "policy": "reroute",
                    "recovery_seconds": 0.4}],
    }  # fmt: skip
    draw_chart(report, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
