"""Reconciliation at the start of a generation (pure part): committed step, late commits, moves."""

from __future__ import annotations

import pytest
import torch
from worker_harness import tiny_spec

from chameleond.core.decide import decide, initial_plan
from chameleond.core.plan import Plan
from chameleond.core.spec import parse_spec
from chameleond.worker._migrate import Move, StateLost, plan_moves

N_LAYERS = 6
ABSENT = -2.0


def rows_for(
    world: tuple[str, ...],
    held: dict[str, dict[int, int]],
    committed: dict[str, int],
    pending: dict[str, tuple[int, tuple[int, ...]]] | None = None,
) -> torch.Tensor:
    rows = torch.zeros((len(world), 2, N_LAYERS + 2), dtype=torch.float64)
    for r, w in enumerate(world):
        rows[r, 0, 0] = committed.get(w, -1)
        step, layers = (pending or {}).get(w, (-1, ()))
        rows[r, 0, 1] = step
        rows[r, 0, 2:] = ABSENT
        for layer, version in held.get(w, {}).items():
            rows[r, 0, 2 + layer] = version
        for layer in layers:
            rows[r, 1, 2 + layer] = 1.0
    return rows


@pytest.fixture
def plans() -> tuple[Plan, Plan]:
    spec = parse_spec(tiny_spec("m", memory_bytes=1_200_000))
    first = initial_plan(spec, generation=1, mtbf_seconds=3600.0)
    dynamic = decide(spec, first, ["w3"], mtbf_seconds=3600.0, generation=2, force="dynamic")
    assert dynamic.plan is not None
    return first, dynamic.plan


def holdings(plan: Plan, version: int) -> dict[str, dict[int, int]]:
    return {w: {layer: version for layer in plan.owned_layers(w)} for w in plan.workers}


def test_nothing_committed_builds_from_the_seed(plans: tuple[Plan, Plan]) -> None:
    first, _ = plans
    rec = plan_moves(first, rows_for(first.workers, {}, {}), first.workers)
    assert rec.committed_step == -1
    assert all(m.src is None for m in rec.moves)
    assert {(m.dst, m.layer) for m in rec.moves} == {
        (w, layer) for w in first.workers for layer in first.owned_layers(w)
    }


def test_steady_state_moves_nothing(plans: tuple[Plan, Plan]) -> None:
    first, _ = plans
    committed = dict.fromkeys(first.workers, 9)
    rec = plan_moves(first, rows_for(first.workers, holdings(first, 9), committed), first.workers)
    assert rec.committed_step == 9 and rec.moves == ()


def test_dynamic_plan_moves_its_manifest(plans: tuple[Plan, Plan]) -> None:
    first, dynamic = plans
    world = dynamic.workers
    held = {w: h for w, h in holdings(first, 4).items() if w in world}
    rec = plan_moves(dynamic, rows_for(world, held, dict.fromkeys(world, 4)), world)
    expected = {(t.src, t.dst, layer, t.round) for t in dynamic.migration for layer in t.layers}
    assert {(m.src, m.dst, m.layer, m.round) for m in rec.moves} == expected


def test_a_vote_seen_by_some_only_commits_everywhere(plans: tuple[Plan, Plan]) -> None:
    """w0 saw step 5's vote complete; the others hold step 5 pending: all of it counts as step 5."""
    first, _ = plans
    world = first.workers
    held = holdings(first, 4)
    held["w0"] = dict.fromkeys(first.owned_layers("w0"), 5)
    committed = {w: 5 if w == "w0" else 4 for w in world}
    pending = {w: (5, first.owned_layers(w)) for w in world if w != "w0"}
    rec = plan_moves(first, rows_for(world, held, committed, pending), world)
    assert rec.committed_step == 5 and rec.moves == ()


def test_a_vote_seen_by_nobody_is_discarded(plans: tuple[Plan, Plan]) -> None:
    first, _ = plans
    world = first.workers
    pending = {w: (5, first.owned_layers(w)) for w in world}
    rec = plan_moves(
        first, rows_for(world, holdings(first, 4), dict.fromkeys(world, 4), pending), world
    )
    assert rec.committed_step == 4 and rec.moves == ()


def test_stale_or_missing_source_is_repaired_from_a_holder(plans: tuple[Plan, Plan]) -> None:
    """The planned source lost its copy (an earlier migration was cut): another holder sends."""
    first, dynamic = plans
    world = dynamic.workers
    held = {w: h for w, h in holdings(first, 4).items() if w in world}
    t = dynamic.migration[0]
    layer = t.layers[0]
    held[t.src][layer] = 3  # stale: one step behind
    rec = plan_moves(dynamic, rows_for(world, held, dict.fromkeys(world, 4)), world)
    repaired = [m for m in rec.moves if m.dst == t.dst and m.layer == layer]
    holders = [w for w in world if held[w].get(layer) == 4]
    repair_round = 1 + max(x.round for x in dynamic.migration)
    assert repaired == [Move(holders[0], t.dst, layer, repair_round)]


def test_a_layer_without_any_current_copy_is_lost(plans: tuple[Plan, Plan]) -> None:
    first, _ = plans
    world = first.workers
    held = holdings(first, 4)
    for w in world:
        held[w].pop(0, None)
    with pytest.raises(StateLost, match="layer 0 has no copy at step 4"):
        plan_moves(first, rows_for(world, held, dict.fromkeys(world, 4)), world)


def test_a_trained_job_never_restarts_from_the_seed(plans: tuple[Plan, Plan]) -> None:
    """Nobody in the world holds committed state, but the job has trained: the state is lost."""
    first, _ = plans
    rows = rows_for(first.workers, {}, {})
    with pytest.raises(StateLost, match="holds committed state"):
        plan_moves(first, rows, first.workers, job_trained=True)


def test_a_late_commit_divides_by_the_batch_its_step_was_summed_over() -> None:
    """Step 5's vote reached w0 only; w1 holds it pending when a plan with another global batch
    arrives. w1 applies it at that plan's reconcile with the batch of step 5's plan (12), as w0
    did; the new plan's 8 would scale the update, and AdamW's moments, by 12/8."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from chameleond.worker._backend import new_group, parse_device
    from chameleond.worker._generation import Generation
    from chameleond.worker._migrate import reconcile
    from chameleond.worker._state import WorkerState

    def spec(batch: int) -> dict[str, object]:
        return tiny_spec("m", workers=2, stages=2, global_batch=batch, micro_batch=2)

    old = initial_plan(parse_spec(spec(12)), generation=1, mtbf_seconds=3600.0)
    new = initial_plan(parse_spec(spec(8)), generation=2, mtbf_seconds=3600.0)
    assert all(old.owned_layers(w) == new.owned_layers(w) for w in old.workers)
    from worker_harness import builtin_model

    arch = builtin_model(parse_spec(spec(12)).arch, 12, 2)
    cpu = parse_device("cpu")

    def at_step_4_with_step_5_summed(worker: str) -> WorkerState:
        state = WorkerState(arch, cpu.torch_device)
        state.global_batch = old.global_batch  # as generation 1's reconcile left it
        state.committed_step = 4
        gen = torch.Generator().manual_seed(5)
        for i in old.owned_layers(worker):
            layer = state.build_from_seed(i)
            layer.version = 4
            for p in layer.params():
                p.grad = torch.randn(p.shape, generator=gen)
        state.mark_pending(5, old.owned_layers(worker))
        return state

    states = {w: at_step_4_with_step_5_summed(w) for w in new.workers}
    states["w0"].apply_pending(old.global_batch)  # its vote completed
    expected = at_step_4_with_step_5_summed("w1")
    expected.apply_pending(old.global_batch)
    store = dist.HashStore()
    errors: list[BaseException] = []

    def run(worker: str) -> None:
        try:
            gen = Generation.for_plan(new, worker, cpu, "i")
            gen.world_group = new_group(store, gen.rank, 2, cpu, bind_address="127.0.0.1",
                                        timeout=timedelta(seconds=30))  # fmt: skip
            rec = reconcile(gen, states[worker])
            assert rec.committed_step == 5 and rec.moves == ()
            assert rec.applied_pending == (5 if worker == "w1" else None)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in new.workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    w1 = states["w1"]
    assert w1.committed_step == 5 and w1.global_batch == new.global_batch
    for i, layer in expected.layers.items():
        assert torch.equal(w1.layer(i).state_buffer(), layer.state_buffer())
