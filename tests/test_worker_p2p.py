"""Backends without tags (NCCL, HCCL) match a pair's messages in issue order: every plan the
planner makes must give each ordered pair of workers one sequence on both sides."""

from __future__ import annotations

import itertools

import pytest

from chameleond.cli.up import build_spec_document
from chameleond.core.decide import decide, initial_plan
from chameleond.core.plan import Plan
from chameleond.core.schedule import FORWARD
from chameleond.core.spec import parse_spec
from chameleond.jobs import load_default_spec
from workers import generation
from workers.backend import DeviceChoice
from workers.generation import Generation, op_order
from workers.p2p import pair_order_mismatch

SHAPES = [(6, 2), (6, 3), (8, 4), (12, 3), (16, 4)]


def plans(workers: int, stages: int) -> list[Plan]:
    doc = build_spec_document(
        load_default_spec(), job="t", workers=workers, pp=stages, bind_addresses=[],
        mtbf_prior_seconds=None,
    )  # fmt: skip
    spec = parse_spec(doc)
    first = initial_plan(spec)
    out = [first]
    ids = list(first.workers)
    failures = [[w] for w in ids] + [list(p) for p in itertools.combinations(ids, 2)][::5]
    for failed, force in itertools.product(failures, ("reroute", "dynamic")):
        d = decide(spec, first, failed, mtbf_seconds=1e5, generation=2, force=force)
        if d.plan is not None:
            out.append(d.plan)
    return out


@pytest.mark.parametrize(("workers", "stages"), SHAPES)
def test_every_pair_sends_and_receives_in_one_order(workers: int, stages: int) -> None:
    made = plans(workers, stages)
    assert len(made) > workers  # reroute and dynamic plans, not only the initial one
    rerouted = [p for p in made if p.policy == "reroute"]
    assert any(  # micro-batches run on a peer of another pipeline: messages cross pipelines
        w != pipe.stages[s].worker
        for p in rerouted
        for pipe, rt in zip(p.pipelines, p.routing, strict=True)
        for s, executors in enumerate(rt)
        for w in executors
    )
    for plan in made:
        assert pair_order_mismatch(plan, op_order(plan)) is None, plan.policy


def test_a_receiver_out_of_order_is_found_and_refused_on_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = initial_plan(parse_spec(build_spec_document(
        load_default_spec(), job="t", workers=6, pp=2, bind_addresses=[], mtbf_prior_seconds=None,
    )))  # fmt: skip
    order = op_order(plan)
    receiver = plan.pipelines[0].stages[1].worker
    forwards = [i for i, op in enumerate(order[receiver]) if op.kind == FORWARD][:2]
    ops = list(order[receiver])
    ops[forwards[0]], ops[forwards[1]] = ops[forwards[1]], ops[forwards[0]]
    why = pair_order_mismatch(plan, {**order, receiver: ops})
    sender = plan.pipelines[0].stages[0].worker
    assert why is not None and why.startswith(f"{sender} sends to {receiver} tags")
    # The plan as made starts on NCCL; with that order a worker on NCCL (not on gloo) refuses it.
    nccl, gloo = DeviceChoice("cuda", 0, "nccl"), DeviceChoice("cpu", 0, "gloo")
    assert Generation.for_plan(plan, receiver, nccl, "i").ops == order[receiver]
    monkeypatch.setattr(generation, "op_order", lambda _plan: {**order, receiver: ops})
    with pytest.raises(ValueError, match="cannot run on nccl, which matches messages by order"):
        Generation.for_plan(plan, receiver, nccl, "i")
    assert Generation.for_plan(plan, receiver, gloo, "i").ops == ops
