"""The metrics: exactly the names of the interface, one registry per service, promtool-clean."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from chameleond.core.machine import Phase
from chameleond.daemon.metrics import Metrics

DASHBOARDS = Path(__file__).resolve().parents[1] / "dashboards"
NAMES = {
    "chameleon_events": "counter",
    "chameleon_decision_seconds": "histogram",
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
}


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
