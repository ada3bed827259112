"""Backends without tags (NCCL, HCCL) match a pair's messages in issue order, and a large send
waits until its receive runs: the batches every plan's step is issued in must work under those
rules, where issuing the messages one by one in op order does not. Every worker derives its own
batches (and its migration rounds) from the plan alone; between any two workers the sends of one
side must be the receives of the other, in order, message for message."""

from __future__ import annotations

import itertools

import pytest

from chameleond.cli.up import build_spec_document
from chameleond.core.decide import decide, initial_plan
from chameleond.core.plan import Plan
from chameleond.core.schedule import BACKWARD, FORWARD
from chameleond.core.spec import parse_spec
from chameleond.jobs import load_default_spec
from chameleond.worker import _generation as generation
from chameleond.worker._backend import DeviceChoice
from chameleond.worker._generation import Generation, op_order
from chameleond.worker._p2p import (
    Batch,
    Endpoint,
    MessageId,
    op_messages,
    rendezvous_fault,
    step_batches,
)

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


def one_by_one(plan: Plan) -> dict[str, list[Batch]]:
    """Each message alone, in op order: a receive before its op, a send right after it."""
    out: dict[str, list[Batch]] = {}
    for worker, ops in op_order(plan).items():
        seq = out.setdefault(worker, [])
        for i, op in enumerate(ops):
            ins, outs = op_messages(plan, op)
            if ins is not None and ins[0] != worker:
                seq.append(Batch(i, (Endpoint(False, *ins),)))
            if outs is not None and outs[0] != worker:
                seq.append(Batch(i + 1, (Endpoint(True, *outs),)))
    return out


@pytest.mark.parametrize(("workers", "stages"), SHAPES)
def test_every_plan_runs_in_batches_without_tags(workers: int, stages: int) -> None:
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
    stuck_one_by_one = 0
    for plan in made:
        order = op_order(plan)
        batches = step_batches(plan, order)
        assert rendezvous_fault(batches) is None, plan.policy
        for worker, seq in batches.items():
            assert [b.before for b in seq] == sorted(b.before for b in seq)
            for batch in seq:  # a send after the op that makes it, a receive before its op
                for end in batch.endpoints:
                    i = next(
                        i for i, op in enumerate(order[worker])
                        if op_messages(plan, op)[end.send] == (end.peer, end.message)
                    )  # fmt: skip
                    assert batch.before > i if end.send else batch.before <= i
        stuck_one_by_one += rendezvous_fault(one_by_one(plan)) is not None
    assert stuck_one_by_one > len(made) // 3  # the batches are what makes them safe


def test_one_by_one_1f1b_waits_in_a_cycle() -> None:
    """Two stages: stage 0 sends F1 before it receives B0, stage 1 sends B0 before it receives F1.
    In the step's batches stage 1 posts its receive of F1 when F1 is sent, before its send of B0,
    and in the steady state each send goes with a receive, in one batch."""
    plan = initial_plan(parse_spec(build_spec_document(
        load_default_spec(), job="t", workers=2, pp=2, bind_addresses=[], mtbf_prior_seconds=None,
    )))  # fmt: skip
    why = rendezvous_fault(one_by_one(plan))
    assert why == (
        "a cycle of waits: w0 waits to send F1@p0:0 to w1 (batch before op 2); "
        "w1 waits to send B0@p0:0 to w0 (batch before op 2)"
    )  # F of micro-batch 1 and B of micro-batch 0, across boundary 0 of pipeline 0
    batches = step_batches(plan, op_order(plan))
    assert rendezvous_fault(batches) is None
    w0, w1 = batches["w0"], batches["w1"]
    f1, b0 = MessageId(1, 0, 0, FORWARD), MessageId(0, 0, 0, BACKWARD)
    assert w0[1] == Batch(2, (Endpoint(True, "w1", f1),))  # after F1, its op 1
    assert w1[1] == Batch(1, (Endpoint(False, "w0", f1),))  # after F0, before B0
    assert w1[2] == Batch(2, (Endpoint(True, "w0", b0),))  # after B0
    # F of micro-batch 2 goes out with the receive of B1's gradient
    b1, f2 = MessageId(1, 0, 0, BACKWARD), MessageId(2, 0, 0, FORWARD)
    assert w0[3] == Batch(4, (Endpoint(False, "w1", b1), Endpoint(True, "w1", f2)))


def test_a_receiver_out_of_order_is_found_and_refused_on_nccl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = initial_plan(parse_spec(build_spec_document(
        load_default_spec(), job="t", workers=6, pp=2, bind_addresses=[], mtbf_prior_seconds=None,
    )))  # fmt: skip
    batches = step_batches(plan, op_order(plan))
    receiver = plan.pipelines[0].stages[1].worker
    sender = plan.pipelines[0].stages[0].worker
    seq = list(batches[receiver])
    first, second = [i for i, b in enumerate(seq) if any(not e.send for e in b.endpoints)][:2]
    seq[first], seq[second] = (
        Batch(seq[first].before, seq[second].endpoints),
        Batch(seq[second].before, seq[first].endpoints),
    )
    swapped = {**batches, receiver: seq}
    why = rendezvous_fault(swapped)
    assert why is not None and why.startswith(f"{sender} sends to {receiver} [")
    # The plan as made starts on NCCL; with those batches a worker on NCCL (not gloo) refuses it.
    nccl, gloo = DeviceChoice("cuda", 0, "nccl"), DeviceChoice("cpu", 0, "gloo")
    assert Generation.for_plan(plan, receiver, nccl, "i").batches == batches[receiver]
    monkeypatch.setattr(generation, "step_batches", lambda _plan, _order, _only: swapped)
    with pytest.raises(ValueError, match="cannot run on nccl, which matches messages by order"):
        Generation.for_plan(plan, receiver, nccl, "i")
    assert Generation.for_plan(plan, receiver, gloo, "i").batches == seq
