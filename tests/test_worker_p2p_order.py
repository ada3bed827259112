"""Point-to-point traffic matches by order alone. Every op carries tag 0 (NCCL and HCCL ignore
tags), so between any two workers the sends of one side, in issue order, must be the receives of
the other side, in issue order, message for message, for every plan: uniform, rerouted,
asymmetric after a re-partition, and a re-partition of those. Each worker's wire ops are derived
here as the worker derives them (its own `Generation`, its own migration rounds), from the plan
alone, and compared pair by pair. A step's messages all have one shape, so there the message's
identity is what must agree; a migration's buffers differ from layer to layer."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from functools import cache

import pytest
import torch

from chameleond.cli.up import build_spec_document
from chameleond.core.decide import decide, initial_plan
from chameleond.core.plan import Plan
from chameleond.core.schedule import Op
from chameleond.core.spec import JobSpec, parse_spec
from chameleond.jobs import load_default_spec
from chameleond.worker import _builtin as builtin
from chameleond.worker import _generation as generation
from chameleond.worker._backend import DeviceChoice
from chameleond.worker._generation import Generation
from chameleond.worker._layer import LayerState
from chameleond.worker._migrate import Move, plan_moves, round_order, round_transfers
from chameleond.worker._model import Arch
from chameleond.worker._trainable import Trainable

GLOO = DeviceChoice("cpu", 0, "gloo")
ABSENT = -2.0

# What one worker puts on the wire, in issue order: (send?, peer, message, shape).
Wire = tuple[bool, str, object, tuple[int, ...]]

# (workers, stages, global batch, micro-batch): from 1 to 8 micro-batches per pipeline, some
# fewer than the stages (a 1F1B warm-up cut short).
JOBS = [(6, 2, 12, 2), (6, 3, 24, 2), (8, 4, 8, 2), (9, 3, 18, 3), (12, 3, 24, 1), (12, 4, 48, 3)]


def job_spec(workers: int, stages: int, global_batch: int, micro_batch: int) -> JobSpec:
    doc = build_spec_document(
        load_default_spec(), job="t", workers=workers, pp=stages, bind_addresses=[],
        mtbf_prior_seconds=None,
    )  # fmt: skip
    doc["training"] = {"global_batch": global_batch, "micro_batch": micro_batch}
    return parse_spec(doc)


@cache
def job_plans(job: tuple[int, int, int, int]) -> tuple[JobSpec, tuple[tuple[Plan, Plan], ...]]:
    """(the plan before, the plan after) for every plan made from the initial one: each single
    failure and every 4th double failure, rerouted and re-partitioned; then one more failure on
    each re-partitioned plan."""
    spec = job_spec(*job)
    first = initial_plan(spec)
    ids = list(first.workers)
    failures = [[w] for w in ids] + [list(p) for p in itertools.combinations(ids, 2)][::4]
    out = [(first, first)]
    for failed, force in itertools.product(failures, ("reroute", "dynamic")):
        d = decide(spec, first, failed, mtbf_seconds=1e5, generation=2, force=force)
        if d.plan is None:
            continue
        out.append((first, d.plan))
        if force != "dynamic" or len(failed) > 1:
            continue
        for more, again in itertools.product(d.plan.workers[::2], ("reroute", "dynamic")):
            d2 = decide(spec, d.plan, [*failed, more], mtbf_seconds=1e5, generation=3, force=again)
            if d2.plan is not None:
                out.append((d.plan, d2.plan))
    return spec, tuple(out)


@pytest.fixture(autouse=True)
def one_op_order_per_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker computes the op order of the whole plan; here it is computed once per plan
    (the plans live in `job_plans`' cache) and shared by the workers derived from it."""
    real = generation.op_order
    orders: dict[int, tuple[Plan, dict[str, list[Op]]]] = {}

    def op_order(plan: Plan) -> dict[str, list[Op]]:
        if id(plan) not in orders or orders[id(plan)][0] is not plan:
            orders[id(plan)] = (plan, real(plan))
        return orders[id(plan)][1]

    monkeypatch.setattr(generation, "op_order", op_order)


def step_wire(plan: Plan, worker: str, shape: tuple[int, ...]) -> list[Wire]:
    """The step's ops of `worker` in the order its StepRunner issues them: its batches, each in
    its endpoints' order (chameleond.worker._step, `_issue`)."""
    gen = Generation.for_plan(plan, worker, GLOO, "i")
    return [(e.send, e.peer, e.message, shape) for b in gen.batches for e in b.endpoints]


def mismatches(wire: Mapping[str, Sequence[Wire]]) -> list[str]:
    """Every ordered pair whose sender's sends differ from its receiver's receives."""
    out = []
    for a, b in itertools.permutations(sorted(wire), 2):
        sent = [(m, shape) for send, peer, m, shape in wire[a] if send and peer == b]
        received = [(m, shape) for send, peer, m, shape in wire[b] if not send and peer == a]
        if sent != received:
            out.append(f"{a} -> {b}: sends {sent} / receives {received}")
    return out


def busiest_pair(wire: Mapping[str, Sequence[Wire]]) -> int:
    return max(
        sum(1 for send, peer, *_ in ops if send and peer == b)
        for a, ops in wire.items()
        for b in wire
    )


@pytest.mark.parametrize("job", JOBS, ids=lambda j: "x".join(map(str, j)))
def test_every_pair_receives_in_order_what_its_peer_sends(job: tuple[int, int, int, int]) -> None:
    spec, made = job_plans(job)
    plans = [after for _, after in made]
    arch = spec.arch
    kinds = {p.policy for p in plans}
    assert {"initial", "reroute", "dynamic"} <= kinds, kinds
    assert any(  # a re-partition left pipelines of different lengths
        len({len(pipe.stages) for pipe in p.pipelines}) > 1 for p in plans
    ), "no asymmetric plan"
    for plan in plans:
        shape = (plan.micro_batch, int(arch["seq_len"]), int(arch["d_model"]))
        wire = {w: step_wire(plan, w, shape) for w in plan.workers}
        assert not mismatches(wire), (plan.policy, plan.generation, mismatches(wire)[:3])
        if plan.pipelines[0].micro_batches > 1 and len(plan.pipelines[0].stages) > 1:
            assert busiest_pair(wire) > 1  # several messages per pair: their order matters


def test_a_pair_out_of_order_is_a_mismatch() -> None:
    """The check above fails when two pending ops between one pair swap places on one side."""
    _, made = job_plans(JOBS[0])
    plan = made[0][1]
    wire = {w: step_wire(plan, w, (1,)) for w in plan.workers}
    assert not mismatches(wire)
    receiver = plan.pipelines[0].stages[1].worker
    sender = plan.pipelines[0].stages[0].worker
    ops = list(wire[receiver])
    i, j = [k for k, (send, peer, *_) in enumerate(ops) if not send and peer == sender][:2]
    ops[i], ops[j] = ops[j], ops[i]
    (found,) = mismatches({**wire, receiver: ops})
    assert found.startswith(f"{sender} -> {receiver}: ")


def rows_for(
    world: tuple[str, ...], n_layers: int, held: Mapping[str, Mapping[int, int]], committed: int
) -> torch.Tensor:
    """The reconcile rows (chameleond.worker._migrate) of workers holding `held` (layer ->
    version)."""
    rows = torch.zeros((len(world), 2, n_layers + 2), dtype=torch.float64)
    for r, w in enumerate(world):
        rows[r, 0, 0] = committed
        rows[r, 0, 1] = -1
        rows[r, 0, 2:] = ABSENT
        for layer, version in held.get(w, {}).items():
            rows[r, 0, 2 + layer] = version
    return rows


@cache
def state_numel(arch: Arch, layer: int) -> int:
    """The serialized state's size of a fresh layer (the length a migration sends first)."""
    model = Trainable(builtin.training(arch, global_batch=4, micro_batch=1))
    return int(LayerState(model, layer, torch.device("cpu")).state_buffer().numel())


def migration_wire(moves: Sequence[Move], world: Sequence[str], arch: Arch) -> list[dict]:
    """Per round, each worker's transfers as it issues them (chameleond.worker._migrate,
    `_execute`), with
    the flat state buffer's size of each layer."""
    numel = {i: (state_numel(arch, i),) for i in range(arch.n_layers)}
    rounds = []
    for r in round_order(moves):
        ops = {w: round_transfers(r, w) for w in world}
        rounds.append({w: [(s, p, i, numel[i]) for s, p, i in ops[w]] for w in world})
    return rounds


def test_migration_rounds_match_pair_by_pair() -> None:
    """Every re-partition's moves, as planned and as repaired when the planned sources are stale
    (several layers between one pair in one round, both ways), issued in one order by both
    ends of every pair."""
    spec, made = job_plans((6, 3, 12, 2))
    arch = Arch.from_mapping(spec.arch)
    step = 5
    many = 0
    checked = 0
    for before, after in made:
        if not after.migration:
            continue
        world = after.workers
        held = {
            w: dict.fromkeys(before.owned_layers(w), step) for w in world if w in before.workers
        }
        stale = {w: {i: step - 1 for i in layers} for w, layers in held.items()}
        holder = min(world, key=lambda w: (-len(held.get(w, {})), w))
        for view in (held, {**stale, holder: {i: step for i in range(arch.n_layers)}}):
            moves = plan_moves(after, rows_for(world, arch.n_layers, view, step), world).moves
            assert any(m.src is not None for m in moves)
            rounds = migration_wire(moves, world, arch)
            for wire in rounds:
                assert not mismatches(wire), mismatches(wire)[:3]
                many += busiest_pair(wire) > 1
            checked += 1
    assert checked >= 4 and many >= 1, (checked, many)
    # One side out of order: a pair's layers (and their buffers' sizes) differ, a mismatch.
    wire = next(wire for wire in rounds if busiest_pair(wire) > 1)
    a, ops = next(
        (a, ops)
        for a, ops in wire.items()
        if busiest_pair({a: ops, **wire}) > 1
        and any(sum(1 for s, p, *_ in ops if s and p == b) > 1 for b in wire)
    )
    ops.reverse()
    assert any(found.startswith(f"{a} -> ") for found in mismatches(wire))
