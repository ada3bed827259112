"""`profile` events: measured cores and per-step CPU folded into the spec; the model's view of the
running plan follows them."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from typing import Any

import pytest

from chameleond.core.decide import decide, initial_plan
from chameleond.core.estimator import Estimator
from chameleond.core.machine import PolicyMachine
from chameleond.core.spec import parse_spec
from chameleond.daemon.config import Config
from chameleond.daemon.dispatch import dispatch
from chameleond.daemon.views import status
from chameleond.handlers.outcome import Outcome
from chameleond.jobs import load_default_spec
from chameleond.jobstate.job import MODEL_VIEW_SECONDS, Job
from chameleond.jobstate.jobspec import spec_document
from chameleond.protocol import EventError, parse_event

SPEC = load_default_spec()
LAYERS = [asdict(layer) for layer in SPEC.layers]


def send(j: Job, data: object, worker: str = "w0") -> Outcome:
    fields = {"type": "profile", "worker": worker, "data": json.dumps(data)}
    return dispatch(j, parse_event(fields), "1-0", 1.0)


def test_host_reports_move_the_cores_and_step_cpu_toward_the_measurements() -> None:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    declared = SPEC.hosts["localhost"]
    host: dict[str, object] = {"name": "localhost", "cores": 2, "busy_cores": 1.4}
    assert send(j, {"layers": LAYERS, "host": host}).label == "handled"
    after_one = j.spec.hosts["localhost"]
    # Six workers share the host: one report moves the value a sixth of the way.
    assert after_one.cpu_cores == pytest.approx(declared.cpu_cores + (1.4 - 2) / 6)
    assert after_one.step_cpu_seconds == declared.step_cpu_seconds  # a start-up report has none
    for w in ("w0", "w1", "w2", "w3", "w4", "w5") * 20:
        report: dict[str, object] = {**host, "step_cpu_seconds": 0.01}
        send(j, {"layers": LAYERS, "host": report}, worker=w)
    assert j.spec.hosts["localhost"].cpu_cores == pytest.approx(1.4, rel=1e-3)
    assert j.spec.hosts["localhost"].step_cpu_seconds == pytest.approx(0.01, rel=1e-3)
    # The spec stored for the workers round-trips the measured host.
    assert parse_spec(spec_document(j.spec)).hosts == j.spec.hosts


def test_busy_cores_are_capped_by_the_host_cores() -> None:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    for _ in range(50):
        send(j, {"layers": LAYERS, "host": {"name": "h9", "cores": 4, "busy_cores": 7.5}})
    assert j.spec.hosts["h9"].cpu_cores == 4


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ({"cores": 2, "busy_cores": 1}, "'name'"),
        ({"name": "localhost", "cores": 0, "busy_cores": 1}, "host.cores"),
        ({"name": "localhost", "cores": 2, "busy_cores": "lots"}, "host.busy_cores"),
        ({"name": "localhost", "cores": 2, "busy_cores": 1, "step_cpu_seconds": -1}, "step_cpu"),
    ],
)
def test_bad_host_reports_are_rejected_with_a_reason(host: dict[str, object], reason: str) -> None:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    with pytest.raises(EventError, match=reason):
        send(j, {"layers": LAYERS, "host": host})


def slowed(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`layers` measured twice as slow."""
    return [{**layer, "forward_seconds": 2 * layer["forward_seconds"],
             "backward_seconds": 2 * layer["backward_seconds"]} for layer in layers]  # fmt: skip


def train_at(j: Job, layers: list[dict[str, Any]]) -> None:
    """Every worker reports `layers` from training."""
    for w in ("w0", "w1", "w2", "w3", "w4", "w5"):
        send(j, {"layers": layers, "source": "training"}, worker=w)


def test_the_model_view_of_the_running_plan_follows_newer_profiles() -> None:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    j.plan = initial_plan(j.spec)
    published = j.plan.estimates.step_seconds
    assert j.model_step_seconds() == pytest.approx(published)
    # Every worker measures its layers twice as slow in training (the host got busier).
    train_at(j, slowed(LAYERS))
    model = j.model_step_seconds()
    assert model is not None and model > 1.3 * published
    assert j.plan.estimates.step_seconds == published  # the decision's forecast stays as it was
    view = status(j, Config())
    assert view["estimated_samples_per_second"] == pytest.approx(12 / published)
    assert view["model_samples_per_second"] == pytest.approx(12 / model)


def test_the_gauges_model_view_takes_up_new_profiles_at_most_every_ten_seconds() -> None:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    j.plan = initial_plan(j.spec)
    published = j.plan.estimates.step_seconds
    assert j.model_step_seconds(now=100.0) == pytest.approx(published)
    train_at(j, slowed(LAYERS))
    assert j.model_step_seconds(now=105.0) == pytest.approx(published)  # within MODEL_VIEW
    model = j.model_step_seconds(now=100.0 + MODEL_VIEW_SECONDS)
    assert model is not None and model > 1.3 * published
    train_at(j, slowed(slowed(LAYERS)))
    assert j.model_step_seconds(now=101.0 + MODEL_VIEW_SECONDS) == pytest.approx(model)
    j.plan = replace(j.plan, generation=j.plan.generation + 1)  # a new plan: taken up at once
    newest = j.model_step_seconds(now=101.0 + MODEL_VIEW_SECONDS)
    assert newest is not None and newest > 1.3 * model


def test_cores_measured_on_a_plan_that_leaves_some_idle_count_what_it_could_have_used() -> None:
    """The dynamic plan after w3's loss (one worker holding every layer beside two 2-stage
    pipelines) keeps a fraction of the shared cores busy; the cores its workers measure are that
    fraction of what they share, and the daemon folds in the cores, not the fraction."""
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    d = decide(j.spec, initial_plan(j.spec), ["w3"], mtbf_seconds=1e6, generation=2,
               force="dynamic")  # fmt: skip
    assert d.plan is not None
    j.plan = d.plan
    host = {"name": "localhost", "cores": 2, "busy_cores": 1.5}
    for w in d.plan.workers * 20:
        send(j, {"layers": LAYERS, "host": host, "generation": 2}, worker=w)
    # The plan keeps `fraction` of the folded cores busy: 1.5 of them, as measured.
    cores = j.spec.hosts["localhost"].cpu_cores
    fraction = Estimator(j.spec).busy_fraction(d.plan.pipelines, d.plan.routing)["localhost"]
    assert 0.5 < fraction < 0.99
    assert cores * fraction == pytest.approx(1.5, rel=1e-3)
    # Reports from another plan (an older generation, a start-up profile) are taken as they are.
    for w in d.plan.workers * 20:
        send(j, {"layers": LAYERS, "host": host, "generation": 1}, worker=w)
    assert j.spec.hosts["localhost"].cpu_cores == pytest.approx(1.5, rel=1e-3)
