"""chameleond.worker._ties: the two copies of a tied parameter get the same summed gradient;
replicas of one stage that hold both copies add them themselves, without a collective."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from worker_harness import tiny_spec

from chameleond.core.decide import initial_plan
from chameleond.core.spec import parse_spec
from chameleond.worker._backend import parse_device
from chameleond.worker._generation import Generation
from chameleond.worker._state import WorkerState
from chameleond.worker._ties import sync_ties
from chameleond.worker._trainable import Trainable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import sgd_tied  # six layers, the embedding tied to the head

CPU = parse_device("cpu")


def _generation(stages: int) -> tuple[Generation, WorkerState]:
    spec = parse_spec(tiny_spec("t", workers=2, stages=stages, global_batch=12, micro_batch=2))
    plan = initial_plan(spec)
    gen = Generation.for_plan(plan, "w0", CPU, "i")  # no groups: a collective would fail
    state = WorkerState(Trainable(sgd_tied.build()), CPU.torch_device)
    for i in plan.owned_layers("w0"):
        state.build_from_seed(i)
    return gen, state


def test_replicas_holding_both_copies_add_the_gradients_themselves() -> None:
    gen, state = _generation(stages=1)
    tie = state.model.ties[0]
    first = dict(state.layer(tie.first[0]).module.named_parameters())[tie.first[1]]
    second = dict(state.layer(tie.second[0]).module.named_parameters())[tie.second[1]]
    g = torch.Generator().manual_seed(0)
    first.grad = torch.randn(first.shape, generator=g)
    second.grad = torch.randn(second.shape, generator=g)
    expected = torch.zeros_like(first) + first.grad + second.grad  # the all-reduce's order
    sync_ties(gen, state)  # gen.world_group is None: no collective was issued
    assert torch.equal(first.grad, expected) and torch.equal(second.grad, expected)


def test_copies_on_different_workers_still_take_the_all_reduce() -> None:
    gen, state = _generation(stages=2)
    for i in state.layers:
        for p in state.layer(i).params():
            p.grad = torch.ones_like(p)
    with pytest.raises(AttributeError):  # it reaches for the world group: there is none here
        sync_ties(gen, state)
