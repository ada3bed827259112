"""The sample-id and divisor rules of a plan's steps (chameleond.worker._samples): ids laid out by
the job's B whatever the plan trains, a drop plan's steps dividing by the samples they train, and
the core's batch check (`core.plan.check_batch`, tested in test_drop.py) accepting both."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from worker_harness import TINY_ARCH, builtin_model, drop_pipelines, tiny_spec

from chameleond.core.decide import initial_plan
from chameleond.core.plan import Pipeline, Plan, check_batch
from chameleond.core.policy import Policy
from chameleond.core.spec import parse_spec
from chameleond.worker._samples import sample_ids, trained_micro_batches
from chameleond.worker._state import WorkerState
from chameleond.worker._trainable import Trainable
from chameleond.worker.api import Factory, Training

JOB_BATCH, MICRO_BATCH = 8, 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def full() -> Plan:
    return initial_plan(parse_spec(_spec()), generation=1, mtbf_seconds=3600.0)


def _spec(**training: int) -> dict[str, Any]:
    spec = tiny_spec("s", workers=4, stages=2, global_batch=JOB_BATCH, micro_batch=MICRO_BATCH)
    spec["training"].update(training)
    return spec


def test_a_drop_plan_trains_its_kept_micro_batches_at_their_job_ids(full: Plan) -> None:
    drop = drop_pipelines(full, [0], failed=["w1"])
    training = parse_spec(_spec(min_global_batch=JOB_BATCH // 2)).training
    assert check_batch(full, training) == check_batch(drop, training) == []
    assert drop.policy is Policy.DROP and drop.global_batch == JOB_BATCH // 2
    assert trained_micro_batches(full) == [0, 1, 2, 3]
    assert trained_micro_batches(drop) == [2, 3]  # pipeline 1's, not renumbered
    # Step 5's micro-batch 3 is the same samples under either plan.
    assert sample_ids(5, 3, JOB_BATCH, MICRO_BATCH) == range(46, 48)
    model = builtin_model(TINY_ARCH, JOB_BATCH, MICRO_BATCH)
    assert model.sample_ids(5, 3, JOB_BATCH, MICRO_BATCH) == range(46, 48)
    # Steps 0-2 full, 3-5 dropped, 6-7 full again: no sample twice, none of the dropped ones.
    plans = [full] * 3 + [drop] * 3 + [full] * 2
    ids = [
        i
        for step, plan in enumerate(plans)
        for g in trained_micro_batches(plan)
        for i in sample_ids(step, g, JOB_BATCH, MICRO_BATCH)
    ]
    assert len(ids) == len(set(ids)) == 5 * JOB_BATCH + 3 * (JOB_BATCH // 2)
    assert set(range(8 * JOB_BATCH)) - set(ids) == {
        i for step in (3, 4, 5) for i in range(step * JOB_BATCH, step * JOB_BATCH + 4)
    }


def _linear(_: int) -> torch.nn.Module:
    layer = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(layer.weight, 1.0)
    return layer


def test_an_update_divides_by_the_samples_its_step_trained() -> None:
    """SGD with lr 1: the weight moves by exactly gradient sum / divisor. A step of a drop plan
    (4 samples) applied late, under a later full plan (8), still divides by its own 4."""
    training = Training(
        model=Factory(1, _linear),
        loss=lambda out, batch: out.sum(dim=1),
        dataset=[torch.zeros(1)] * 64,
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
        global_batch=JOB_BATCH,
        micro_batch=MICRO_BATCH,
    )
    state = WorkerState(Trainable(training), CPU)
    layer = state.build_from_seed(0)
    state.global_batch = JOB_BATCH // 2  # the drop plan's
    (weight,) = layer.params()
    weight.grad = torch.full_like(weight, 2.0)
    state.mark_pending(3, [0])
    state.global_batch = JOB_BATCH  # a full plan comes before the commit reaches this worker
    assert state.apply_pending() == 3
    assert weight.item() == pytest.approx(1.0 - 2.0 / 4)
    weight.grad = torch.full_like(weight, 2.0)
    state.mark_pending(4, [0])
    state.apply_pending(JOB_BATCH)
    assert weight.item() == pytest.approx(0.5 - 2.0 / 8)


def test_the_pipeline_helper_keeps_pipelines_unchanged(full: Plan) -> None:
    drop = drop_pipelines(full, [0], failed=["w1"])
    assert drop.pipelines == (full.pipelines[1],)
    assert isinstance(drop.pipelines[0], Pipeline)
    assert drop.routing == (full.routing[1],) and drop.migration == ()
    assert drop.workers == ("w2", "w3") and drop.excluded == ("w1",)
    assert {w for g in drop.sync_groups for w in g.workers} == {"w2", "w3"}
