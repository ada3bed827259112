"""Each transition and step cost term against a hand-computed case (docs/planner.md, "Costs")."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from chameleond.core.decide import decide, initial_plan
from chameleond.core.estimator import Estimator, overlapped_sync_end, stage_finishes
from chameleond.core.plan import Pipeline, Stage
from chameleond.core.restorer import nic_bound_seconds, sync_groups
from chameleond.core.search import search
from chameleond.core.spec import CostSpec, JobSpec, SpecError, parse_spec
from chameleond.jobstate.jobspec import spec_document


def two_hosts(costs: dict[str, Any] | None = None, **training: Any) -> JobSpec:
    """2 pipelines x 2 stages, one stage layer each; pipeline p on host h{p}."""
    return parse_spec(
        {
            "workers": [{"id": f"w{i}", "host": f"h{i // 2}", "memory_bytes": 10**13}
                        for i in range(4)],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 0.0},
                "inter_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 0.0},
            },
            "model": {"layers": [
                {"forward_seconds": 1.0, "backward_seconds": 2.0, "param_bytes": 15 * 10**8,
                 "optimizer_bytes": 0, "activation_bytes": 0, "output_bytes": 0},
                {"forward_seconds": 1.0, "backward_seconds": 2.0, "param_bytes": 6 * 10**9,
                 "optimizer_bytes": 0, "activation_bytes": 0, "output_bytes": 0},
            ]},
            "training": {"global_batch": 4, "micro_batch": 1, **training},
            "plan": {"stages": 2},
            "costs": costs or {},
        }
    )  # fmt: skip


def test_stage_finishes_by_hand() -> None:
    # 2 stages, 2 micro-batches, f = 1, b = 2, no wire time. Stage 1: F0 1-2, B0 2-4, F1 4-5,
    # B1 5-7. Stage 0: F0 0-1, F1 1-2, B0 4-6 (after stage 1's B0), B1 7-9.
    assert stage_finishes([1, 1], [2, 2], [0], 2) == [9.0, 7.0]


def test_sync_after_the_pipeline_without_overlap() -> None:
    spec = two_hosts()
    plan = initial_plan(spec)
    # Makespan 9; stage groups {w0, w2} (1.5e9 bytes) and {w1, w3} (6e9) in one round across
    # hosts: a ring of 2 moves 2(n-1)/n x bytes = bytes over 1e9 B/s: 1.5 s and 6 s.
    assert plan.estimates.step_seconds == pytest.approx(9 + 6)


def test_sync_overlapped_with_backward() -> None:
    spec = two_hosts(overlap_sync=True)
    plan = initial_plan(spec)
    # Stage 1 ends at 7 and syncs for 6 (ends 13); stage 0 ends at 9 and syncs 1.5 (10.5).
    assert plan.estimates.step_seconds == pytest.approx(13)
    assert overlapped_sync_end([9, 7], [1.5, 6], [0, 0]) == pytest.approx(13)
    # Rounds stay in order: round 1 waits for round 0 (7 + 6 = 13), then 13 + 1.5.
    assert overlapped_sync_end([9, 7], [1.5, 6], [1, 0]) == pytest.approx(14.5)


def test_overlap_is_never_slower_and_the_search_agrees() -> None:
    plain, overlap = two_hosts(), two_hosts(overlap_sync=True)
    fast = initial_plan(overlap).estimates.step_seconds
    assert fast <= initial_plan(plain).estimates.step_seconds
    # The search prices a symmetric layout exactly as the plan's estimate does.
    found = search(overlap, [w.id for w in overlap.workers]).layout
    assert found is not None and found.seconds == pytest.approx(fast)


def test_migration_round_bounded_by_the_host_interface() -> None:
    spec = two_hosts()
    host = {w.id: w.host for w in spec.workers}
    # Two transfers in one round, both from h0 to h1, 1e9 bytes each, 1 s each on its own link:
    # the host's interface (1e9 B/s by default, the inter-host link's) carries 2e9 bytes: 2 s.
    pairs = [("w0", "w2"), ("w1", "w3")]
    t = nic_bound_seconds(spec, host, pairs, [10**9, 10**9], [1.0, 1.0], [0, 0])
    assert t == pytest.approx(2.0)
    # A faster interface leaves the per-transfer time as the bound.
    fast = replace(spec, costs=CostSpec(host_nic_bytes_per_second=4e9))
    assert nic_bound_seconds(fast, host, pairs, [10**9, 10**9], [1.0, 1.0], [0, 0]) == 1.0
    # Same host: no interface involved; separate rounds add up.
    same = [("w0", "w1"), ("w2", "w3")]
    assert nic_bound_seconds(spec, host, same, [10**9, 10**9], [1.0, 1.0], [0, 1]) == 2.0


def test_search_time_is_modelled_not_measured() -> None:
    spec = replace(two_hosts(), costs=CostSpec(search_seconds_per_plan=0.5))
    plan = initial_plan(spec)
    a = decide(spec, plan, ["w3"], mtbf_seconds=1e6, generation=2)
    b = decide(spec, plan, ["w3"], mtbf_seconds=1e6, generation=2)
    assert a == b  # a pure function of its inputs
    assert a.search_seconds == pytest.approx(a.plans_considered * 0.5)
    dyn = a.candidates[1]
    assert dyn.plan is not None
    assert dyn.transition_seconds >= a.search_seconds + spec.rebuild_seconds
    free = replace(spec, costs=CostSpec(search_seconds_per_plan=0.0))
    assert decide(free, plan, ["w3"], mtbf_seconds=1e6, generation=2).search_seconds == 0.0


def test_restore_is_checkpoint_load_plus_lost_work_plus_rebuild() -> None:
    spec = replace(two_hosts(), costs=CostSpec(checkpoint_read_bytes_per_second=1e9))
    plan = initial_plan(spec)
    # w1 and w3 held layer 1 (6e9 bytes of state each: 2 x param + optimizer = 1.2e10).
    d = decide(spec, plan, ["w1", "w3"], mtbf_seconds=1e6, generation=2, checkpoint_step=10,
               step=14)  # fmt: skip
    assert d.selected == "restore" and d.plan is not None
    largest = max(
        2 * sum(spec.layers[x].param_bytes for x in st.layers)
        for p in d.plan.pipelines
        for st in p.stages
    )
    expected = largest / 1e9 + 4 * plan.estimates.step_seconds + spec.rebuild_seconds
    assert d.plan.estimates.transition_seconds == pytest.approx(expected)
    # Without the job's step nothing is known lost: load + rebuild.
    d0 = decide(spec, plan, ["w1", "w3"], mtbf_seconds=1e6, generation=2, checkpoint_step=10)
    assert d0.plan is not None
    load = largest / 1e9
    assert d0.plan.estimates.transition_seconds == pytest.approx(load + spec.rebuild_seconds)


def test_costs_round_trip_and_reject_nonsense() -> None:
    spec = two_hosts({"host_nic_bytes_per_second": 5e10, "search_seconds_per_plan": 0.0})
    assert spec.nic_bytes_per_second() == 5e10
    assert parse_spec(spec_document(spec)) == spec
    assert parse_spec(spec_document(two_hosts(overlap_sync=True))).training.overlap_sync
    with pytest.raises(SpecError, match="costs: unknown field"):
        two_hosts({"nic": 1})
    with pytest.raises(SpecError, match="checkpoint_read_bytes_per_second"):
        two_hosts({"checkpoint_read_bytes_per_second": 0})
    with pytest.raises(SpecError, match="overlap_sync"):
        two_hosts(overlap_sync="yes")


def test_sync_groups_of_the_example_are_one_round() -> None:
    spec = two_hosts()
    pipes = initial_plan(spec).pipelines
    assert {g.round for g in sync_groups(pipes, ())} == {0}
    est = Estimator(spec)
    p = Pipeline((Stage("w0", 0, 1), Stage("w1", 1, 2)), 0, 2)
    assert est.finishes([p], [[("w0",) * 2, ("w1",) * 2]]) == {"w0": 9.0, "w1": 7.0}
    assert math.isfinite(est.makespan([p], [[("w0",) * 2, ("w1",) * 2]]))
