"""The metrics: exactly the names of the interface, one registry per service, promtool-clean."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from job_harness import WORKERS, send, training_job
from prometheus_client.parser import text_string_to_metric_families

from chameleond.core.machine import Phase
from chameleond.daemon import views
from chameleond.daemon.config import load
from chameleond.daemon.metrics import Metrics, TrainingFigures
from chameleond.jobstate.job import Job

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
NAMES = {
    "chameleon_events": "counter",
    "chameleon_worker_speed": "gauge",
    "chameleon_slow_episodes": "counter",
    "chameleon_peer_notices": "counter",
    "chameleon_slow_decisions": "counter",
    "chameleon_slow_expected_gain_samples_per_second": "gauge",
    "chameleon_decision_seconds": "histogram",
    "chameleon_heap_settle_seconds": "histogram",
    "chameleon_prepare_seconds": "histogram",
    "chameleon_recovery_seconds": "histogram",
    "chameleon_fault_waiting_seconds": "histogram",
    "chameleon_last_decision_seconds": "gauge",
    "chameleon_last_recovery_seconds": "gauge",
    "chameleon_policy_decisions": "counter",
    "chameleon_training_throughput_samples_per_second": "gauge",
    "chameleon_estimated_throughput_samples_per_second": "gauge",
    "chameleon_model_throughput_samples_per_second": "gauge",
    "chameleon_expected_fault_seconds": "gauge",
    "chameleon_decision_window_seconds": "gauge",
    "chameleon_workers": "gauge",
    "chameleon_plan_generation": "gauge",
    "chameleon_generation_attempt": "gauge",
    "chameleon_redis_up": "gauge",
    "chameleon_job_state": "gauge",
    "chameleon_checkpoint_step": "gauge",
    "chameleon_leader": "gauge",
    "chameleon_forged_messages": "counter",
    "chameleon_training_loss": "gauge",
    "chameleon_training_grad_norm": "gauge",
    "chameleon_training_learning_rate": "gauge",
    "chameleon_training_loss_scale": "gauge",
    "chameleon_eval_loss": "gauge",
    "chameleon_training_throughput_tokens_per_second": "gauge",
    "chameleon_trained_samples": "counter",
    "chameleon_trained_tokens": "counter",
    "chameleon_skipped_samples": "counter",
    "chameleon_overflow_steps": "counter",
}
# The figures the workers may leave out of a step (an older worker, fp32, no evaluation): no
# series until a step names them.
OPTIONAL = {
    "chameleon_training_loss", "chameleon_training_grad_norm", "chameleon_training_learning_rate",
    "chameleon_training_loss_scale", "chameleon_eval_loss",
    "chameleon_training_throughput_tokens_per_second",
}  # fmt: skip


def populated() -> Metrics:
    m = Metrics()
    m.events.labels("fault", "handled").inc()
    m.events.labels("unknown", "invalid").inc(3)
    m.decided(0.02)
    m.recovered("reroute", 0.8)
    m.policy_decisions.labels("dynamic").inc()
    m.training_throughput.set(280.5)
    m.estimated_throughput.set(290.0)
    m.model_throughput.set(285.0)
    m.expected_fault_seconds.set(11160.0)
    m.decision_window_seconds.set(1067.0)
    m.set_workers({"w0": "active", "w1": "fenced", "w2": "failed"})
    m.generation.set(3)
    m.attempt.set(2)
    m.set_phase(Phase.TRANSITIONING)
    m.checkpoint_step.set(19)
    m.set_speeds(["w0", "w1", "w2"], {"w2": 0.5})
    m.set_training(
        TrainingFigures(
            loss=2.31, grad_norm=0.82, learning_rate=3e-4, loss_scale=65536.0, eval_loss=2.45,
            tokens_per_second=71_800.0, trained_samples=1200, trained_tokens=153_600,
            skipped_samples=48, overflow_steps=2,
        )
    )  # fmt: skip
    return m


def test_exactly_the_documented_metrics() -> None:
    text = populated().exposition().decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    # prometheus_client adds a `_created` timestamp beside each counter and histogram.
    assert {n: t for n, t in families.items() if not n.endswith("_created")} == NAMES
    text = populated().exposition().decode()
    assert 'chameleon_events_total{outcome="invalid",type="unknown"} 3.0' in text
    assert 'chameleon_job_state{state="transitioning"} 1.0' in text
    assert 'chameleon_job_state{state="training"} 0.0' in text
    assert 'chameleon_workers{state="fenced"} 1.0' in text


def test_each_service_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.generation.set(7)
    assert b"chameleon_plan_generation 0.0" in b.exposition()


def test_promtool_check_metrics_passes() -> None:
    result = subprocess.run(
        ["/usr/bin/promtool", "check", "metrics"],
        input=populated().exposition().decode(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def _exported() -> set[str]:
    return {
        s.name for f in text_string_to_metric_families(populated().exposition().decode())
        for s in f.samples
    }  # fmt: skip


def test_dashboard_queries_only_exported_series() -> None:
    text = json.dumps(json.loads((DASHBOARDS / "chameleond.json").read_text()))
    used = set(re.findall(r"chameleon_[a-z_]+", text))
    assert used and used <= _exported(), used - _exported()


def test_alerts_use_only_exported_series_and_phases() -> None:
    text = (DASHBOARDS / "alerts.yml").read_text()
    used = set(re.findall(r"chameleon_[a-z_]+", text))
    assert used and used <= _exported(), used - _exported()
    states = {s for m in re.findall(r'state=~?"([a-z_|]+)"', text) for s in m.split("|")}
    assert states and states <= {p.value for p in Phase}, states


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    """tests/alerts_test.yml: each alert fires on the series it is for, after its `for`, and
    stays quiet on the ones it is not (promtool's own rule evaluation)."""
    check = subprocess.run(
        ["/usr/bin/promtool", "check", "rules", str(DASHBOARDS / "alerts.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    tests = Path(__file__).resolve().parent / "alerts_test.yml"
    result = subprocess.run(
        ["/usr/bin/promtool", "test", "rules", tests.name],
        cwd=tests.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def _samples(m: Metrics) -> dict[str, float]:
    """Every sample of the exposition without labels: name -> value."""
    text = m.exposition().decode()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels and not s.name.endswith("_created")
    }


def _step(j: Job, step: int, seconds: tuple[float, ...], **figures: object) -> None:
    """Step `step` of generation 1 as every worker of the plan reports it: its own seconds, the
    step's figures (the same in every report)."""
    for entry, (w, sec) in enumerate(zip(WORKERS, seconds, strict=True)):
        fields = {"worker": w, "generation": 1, "step": step, "seconds": sec, **figures}
        send(j, f"{step}-{entry}", type="step", vote_seconds=0.01, at=1.0, **fields)


def test_training_figures_count_each_step_once_whoever_reports_it() -> None:
    """Real step events through the handlers: six workers report each step, and what it trained
    counts once; the gauges show the newest step, the eval loss the newest evaluation; a figure
    no step named is no series (not a zero)."""
    j, m, cfg = training_job(), Metrics(), load(None, {}, {})
    views.refresh_gauges(j, m, cfg)
    before = _samples(m)
    assert not OPTIONAL & set(before)
    assert before["chameleon_trained_samples_total"] == 0
    assert before["chameleon_overflow_steps_total"] == 0

    figures = dict(samples=12, loss=2.5, grad_norm=1.25, lr=3e-4, tokens=1536, skipped=0,
                   overflow=0, loss_scale=65536.0)  # fmt: skip
    _step(j, 0, (0.1, 0.2, 0.3, 0.1, 0.2, 0.4), **figures)
    # fp16 overflowed: the norm of inf gradients is none; the loss scale halves.
    _step(j, 1, (0.3,) * 6, **{**figures, "loss": 2.4, "grad_norm": "inf", "overflow": 1,
                               "loss_scale": 32768.0, "eval_loss": 2.75})  # fmt: skip
    views.refresh_gauges(j, m, cfg)
    mid = _samples(m)
    assert "chameleon_training_grad_norm" not in mid  # the overflowed step had none
    assert mid["chameleon_overflow_steps_total"] == 1
    assert mid["chameleon_training_loss_scale"] == 32768.0
    assert mid["chameleon_eval_loss"] == 2.75

    # A drop plan's step: 8 of the 12 samples trained. A late copy of step 0 changes nothing.
    dropped = {**figures, "samples": 8, "skipped": 4, "tokens": 1024, "loss": 2.2, "lr": 2e-4}
    _step(j, 2, (0.2, 0.2, 0.2, 0.2, 0.2, 0.25), **dropped)
    late = send(j, "9-0", type="step", worker="w0", generation=1, step=0, seconds=0.1,
                **figures)  # fmt: skip
    assert late.duplicate
    views.refresh_gauges(j, m, cfg)
    after = _samples(m)
    assert after["chameleon_trained_samples_total"] == 12 + 12 + 8
    assert after["chameleon_trained_tokens_total"] == 1536 * 2 + 1024
    assert after["chameleon_skipped_samples_total"] == 4
    assert after["chameleon_overflow_steps_total"] == 1
    assert after["chameleon_training_loss"] == 2.2
    assert after["chameleon_training_grad_norm"] == 1.25
    assert after["chameleon_training_learning_rate"] == 2e-4
    assert after["chameleon_eval_loss"] == 2.75  # the newest evaluation, two steps back
    assert after["chameleon_training_throughput_samples_per_second"] == pytest.approx(8 / 0.25)
    assert after["chameleon_training_throughput_tokens_per_second"] == pytest.approx(1024 / 0.25)

    progress = views.status(j, cfg)["progress"]
    assert {k: progress[k] for k in ("step", "loss", "grad_norm", "learning_rate", "eval_loss",
                                     "eval_step", "loss_scale")} == {
        "step": 2, "loss": 2.2, "grad_norm": 1.25, "learning_rate": 2e-4, "eval_loss": 2.75,
        "eval_step": 1, "loss_scale": 65536.0,
    }  # fmt: skip
    assert progress["tokens_per_second"] == pytest.approx(1024 / 0.25)
    assert progress["samples_per_second"] == pytest.approx(8 / 0.25)


def test_steps_from_older_workers_leave_their_figures_out() -> None:
    """A worker that sends only the loss (before these figures existed) still counts its samples;
    the figures it did not send are no series."""
    j, m, cfg = training_job(), Metrics(), load(None, {}, {})
    _step(j, 0, (0.5,) * 6, samples=12, loss=3.0)
    views.refresh_gauges(j, m, cfg)
    got = _samples(m)
    assert got["chameleon_training_loss"] == 3.0
    assert got["chameleon_trained_samples_total"] == 12
    assert got["chameleon_trained_tokens_total"] == 0
    assert not (OPTIONAL - {"chameleon_training_loss"}) & set(got)
    progress = views.status(j, cfg)["progress"]
    assert progress["grad_norm"] is progress["tokens_per_second"] is progress["eval_loss"] is None
