"""A slow worker in the model and in the decision: speeds in the estimator, the weighted reroute,
and decide_slow's four candidates (keep, weighted reroute, re-partition, exclude)."""

from __future__ import annotations

import dataclasses

import pytest

from chameleond.core.decide import initial_plan
from chameleond.core.decision import decision_to_dict, same_layout
from chameleond.core.estimator import Estimator, ring_allreduce_seconds
from chameleond.core.plan import Plan, check_batch, plan_from_dict, plan_to_dict
from chameleond.core.policy import SLOW_CANDIDATES, Policy
from chameleond.core.reroute import reroute
from chameleond.core.schedule import FORWARD, build_schedule
from chameleond.core.slowdecide import decide_slow
from chameleond.core.slowroute import weighted_reroute
from chameleond.core.spec import JobSpec, SpecError, WorkerSpec, parse_spec
from chameleond.jobstate.jobspec import spec_document

F, B = 0.01, 0.02  # one layer's forward and backward seconds per micro-batch
BANDWIDTH = 1e9


def job(pipes: int, stages: int, layers: int, micro: int, rebuild: float = 0.1) -> JobSpec:
    """`pipes` pipelines of `stages` stages, `micro` micro-batches each; nothing on the wire
    costs time but the commit vote, and the search keeps pipelines of `stages` stages."""
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i // 4}", "memory_bytes": 10**12}
                for i in range(pipes * stages)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": BANDWIDTH, "latency_seconds": 0.0},
                "inter_host": {"bandwidth_bytes_per_second": BANDWIDTH, "latency_seconds": 0.0},
            },
            "model": {"layers": [{"forward_seconds": F, "backward_seconds": B,
                                  "param_bytes": 0, "optimizer_bytes": 0,
                                  "activation_bytes": 10**5, "output_bytes": 0,
                                  "count": layers}]},
            "training": {"global_batch": pipes * micro * 2, "micro_batch": 2},
            "plan": {"stages": stages},
            "search": {"min_stages": stages, "max_stages": stages, "spares": False},
            "job": {"rebuild_seconds": rebuild, "restart_seconds": 0.0},
        }
    )  # fmt: skip


def vote(n: int) -> float:
    """The commit vote over n executing workers: 24 bytes each, a ring (docs/planner.md)."""
    return ring_allreduce_seconds(n, 24 * n, job(1, 1, 1, 1).intra_host)


def valid(spec: JobSpec, plan: Plan, generation: int) -> None:
    assert plan.generation == generation
    assert check_batch(plan, spec.training) == []
    assert plan_from_dict(plan_to_dict(plan)) == plan
    for pipe, rows in zip(plan.pipelines, plan.routing, strict=True):
        for st, row in zip(pipe.stages, rows, strict=True):
            same = {(x.first_layer, x.end_layer) for p in plan.pipelines for x in p.stages
                    if x.worker in row}  # fmt: skip
            assert same == {(st.first_layer, st.end_layer)}  # executors hold the slot's layers


def test_full_speed_gives_the_same_numbers_and_document() -> None:
    spec = job(2, 4, 8, 8)
    ones = spec.with_speeds({w.id: 1.0 for w in spec.workers})
    plan = initial_plan(spec)
    routed = reroute(spec, plan, {"w1"}).routing
    assert routed is not None
    for routing in (plan.routing, routed):
        args = (plan.pipelines, routing, plan.sync_groups)
        assert Estimator(ones).step_seconds(*args) == Estimator(spec).step_seconds(*args)
        assert Estimator(ones).peak_memory(plan.pipelines, routing) == Estimator(spec).peak_memory(
            plan.pipelines, routing
        )
    doc = spec_document(spec)
    assert all("speed" not in w for w in doc["workers"])
    slow = spec.with_speeds({"w1": 0.5})
    slow_doc = spec_document(slow)
    assert [w.get("speed") for w in slow_doc["workers"]][:3] == [None, 0.5, None]
    assert list(slow_doc["workers"][1]) == [f.name for f in dataclasses.fields(WorkerSpec)]
    assert parse_spec(slow_doc) == slow and parse_spec(doc) == spec
    for bad in (0, -1, 1e3 + 1):
        workers = [{**w, "speed": bad} if w["id"] == "w0" else w for w in doc["workers"]]
        with pytest.raises(SpecError, match=r"workers\[0\]\.speed"):
            parse_spec({**doc, "workers": workers})


def test_ops_slow_down_on_the_worker_that_executes_them() -> None:
    """The estimator's step equals the workers' schedule timed with each op's compute divided by
    its executor's speed, on the current layout and on the weighted reroute."""
    spec = job(2, 4, 8, 8).with_speeds({"w1": 0.5})
    est, plan = Estimator(spec), initial_plan(spec)
    speed = {w.id: w.speed for w in spec.workers}
    layers_of = [[s.end_layer - s.first_layer for s in pipe.stages] for pipe in plan.pipelines]

    def op_seconds(p: int, s: int, kind: str, w: str) -> float:
        return layers_of[p][s] * (F if kind == FORWARD else B) / speed[w]

    weighted = weighted_reroute(est, plan, set())
    assert weighted.routing is not None
    for routing in (plan.routing, weighted.routing):
        truth = build_schedule(plan.pipelines, routing, op_seconds, lambda *_: 0.0).makespan
        assert est.makespan(plan.pipelines, routing) == pytest.approx(truth, rel=1e-12)
    assert 0 < weighted.moved[(0, 1)] < plan.pipelines[0].micro_batches
    assert weighted.step_seconds < est.step_seconds(plan.pipelines, plan.routing, plan.sync_groups)


def test_half_speed_weighted_share_beats_keep() -> None:
    """Two single-stage pipelines of m micro-batches, w0 at speed v: keep steps m t / v; moving
    k micro-batches to w1 steps max((m - k) t / v, (m + k) t): the best k, found by hand."""
    m, v = 8, 0.5
    spec = job(2, 1, 2, m)
    t = 2 * (F + B)
    current = initial_plan(spec)
    d = decide_slow(spec, current, {"w0": v}, duration_seconds=3600.0, generation=2,
                    mtbf_seconds=36000.0)  # fmt: skip
    keep, weighted, dyn, excl = d.candidates
    assert [c.policy for c in d.candidates] == list(SLOW_CANDIDATES)
    assert keep.step_seconds == pytest.approx(m * t / v + vote(2), rel=1e-9)  # 2x full speed
    assert keep.step_seconds == pytest.approx(2 * current.estimates.step_seconds, rel=1e-6)
    best_k = min(range(m), key=lambda k: max((m - k) / v, m + k))
    assert best_k == 3
    share = weighted.plan.routing[0][0] if weighted.plan else ()
    assert share.count("w1") == best_k and share.count("w0") == m - best_k
    assert weighted.step_seconds == pytest.approx(
        max((m - best_k) / v, m + best_k) * t + vote(2), rel=1e-9
    )
    assert excl.step_seconds == pytest.approx(2 * m * t, rel=1e-9)  # w1 alone, no vote
    # Re-partitioned: the same single-stage pipelines, best_k micro-batches moved to w1's (the
    # same step as the weighted share, and the same transition: a rebuild, nothing to move).
    assert dyn.plan is not None
    assert [p.micro_batches for p in dyn.plan.pipelines] == [m - best_k, m + best_k]
    assert dyn.step_seconds == pytest.approx(weighted.step_seconds, rel=1e-9)
    assert dyn.score == pytest.approx(weighted.score, rel=1e-12)
    assert d.selected == Policy.REROUTE and d.plan is weighted.plan  # ties go to the reroute
    assert d.gains[1] == pytest.approx(weighted.score - keep.score) and d.gains[1] > 0
    # Scores as the model says: B / step * (D - transition) / D, over the slowness's duration.
    batch = spec.training.global_batch
    for c in d.candidates:
        expected = batch / c.step_seconds * (3600.0 - c.transition_seconds) / 3600.0
        assert c.score == pytest.approx(expected, rel=1e-12)
    assert weighted.score > excl.score and weighted.score > keep.score
    for c in d.candidates:
        assert c.plan is not None
        valid(spec, c.plan, 2)
    summary = decision_to_dict(d)
    assert [c["gain"] for c in summary["candidates"]] == list(d.gains)


def test_slight_slowness_pays_a_rebuild_only_over_a_long_window() -> None:
    """v = 0.9, m = 20: one micro-batch moved steps max(19 / v, 21) t against keep's 20 / v t;
    the rebuild pays after D* = rebuild * keep / (keep - weighted)."""
    m, v, rebuild = 20, 0.9, 1.0
    spec = job(2, 1, 2, m, rebuild=rebuild)
    t = 2 * (F + B)
    current = initial_plan(spec)
    keep_step = m * t / v + vote(2)
    weighted_step = max((m - 1) / v, m + 1) * t + vote(2)
    assert weighted_step < keep_step
    break_even = rebuild * keep_step / (keep_step - weighted_step)
    short = decide_slow(spec, current, {"w0": v}, duration_seconds=break_even / 2, generation=2,
                        mtbf_seconds=1e6)  # fmt: skip
    long = decide_slow(spec, current, {"w0": v}, duration_seconds=break_even * 2, generation=2,
                       mtbf_seconds=1e6)  # fmt: skip
    for d in (short, long):
        assert d.candidates[0].step_seconds == pytest.approx(keep_step, rel=1e-9)
        assert d.candidates[1].step_seconds == pytest.approx(weighted_step, rel=1e-9)
        assert d.candidates[1].transition_seconds == rebuild
    assert short.selected == Policy.KEEP and short.plan is not None
    assert same_layout(short.plan, current) and short.plan.generation == 2
    assert long.selected == Policy.REROUTE


def test_very_slow_worker_gives_its_work_away() -> None:
    """v = 0.1 on a 2 x 4 job: keep is ten times slower at that stage; the winner leaves w1 at
    most a fifth of its work (layers x micro-batches it executes): a re-partition that gives it
    one layer and its pipeline few micro-batches, exclude, or the weighted reroute."""
    spec = job(2, 4, 8, 8)
    current = initial_plan(spec)
    d = decide_slow(spec, current, {"w1": 0.1}, duration_seconds=3600.0, generation=2,
                    mtbf_seconds=36000.0)  # fmt: skip
    keep, weighted, dyn, excl = d.candidates
    assert excl.feasible and excl.plan is not None and "w1" in excl.plan.excluded
    assert d.plan is not None

    def work_of(plan: Plan, w: str) -> int:
        return sum(row.count(w) * (st.end_layer - st.first_layer)
                   for pipe, rows in zip(plan.pipelines, plan.routing, strict=True)
                   for st, row in zip(pipe.stages, rows, strict=True))  # fmt: skip

    assert work_of(d.plan, "w1") <= work_of(current, "w1") / 5
    assert max(weighted.score, excl.score, dyn.score) > 3 * keep.score
    # The re-partition gives w1 one layer (a stage has one at least) and is the fastest here.
    assert dyn.plan is not None and d.selected == Policy.DYNAMIC
    assert [st.end_layer - st.first_layer for st in dyn.plan.pipelines[0].stages][1] == 1
    assert dyn.step_seconds < min(weighted.step_seconds, excl.step_seconds)
    valid(spec, d.plan, 2)


def test_recovery_gives_the_share_back() -> None:
    spec = job(2, 1, 2, 8)
    first = decide_slow(spec, initial_plan(spec), {"w0": 0.5}, duration_seconds=3600.0,
                        generation=2, mtbf_seconds=36000.0)  # fmt: skip
    assert first.selected == Policy.REROUTE and first.plan is not None
    shared = first.plan
    back = decide_slow(spec, shared, {"w0": 1.0}, duration_seconds=3600.0, generation=3,
                       mtbf_seconds=36000.0)  # fmt: skip
    weighted = back.candidates[1]
    assert weighted.plan is not None
    for pipe, rows in zip(weighted.plan.pipelines, weighted.plan.routing, strict=True):
        for st, row in zip(pipe.stages, rows, strict=True):
            assert set(row) == {st.worker}
    assert weighted.transition_seconds == spec.rebuild_seconds
    assert not back.candidates[3].feasible  # nobody is slow: nothing to exclude
    assert back.selected == Policy.REROUTE and back.plan is weighted.plan
    valid(spec, weighted.plan, 3)
