"""decide(): both candidates, the choice, and the invariants of every plan it produces."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleond.core import selector
from chameleond.core.candidates import Candidate
from chameleond.core.decide import decide, initial_plan, prepared_for
from chameleond.core.decision import (
    Decision,
    decision_to_dict,
    join_not_taken,
    prepared_switch,
    select,
)
from chameleond.core.holdings import of_plan
from chameleond.core.layout import own_layout, own_layout_rerouted
from chameleond.core.plan import Plan, check_batch, plan_from_dict, plan_to_dict
from chameleond.core.policy import Policy
from chameleond.core.search import search
from chameleond.core.spec import CostSpec, JobSpec, parse_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def job(
    pipes: int,
    stages: int,
    layers: int,
    micro: int,
    *,
    memory: int = 10**12,
    min_batch: int | None = None,
) -> JobSpec:
    smaller = {} if min_batch is None else {"min_global_batch": min_batch}
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i // 4}", "memory_bytes": memory}
                for i in range(pipes * stages)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 1e-5},
                "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 1e-4},
            },
            "model": {"layers": [{"forward_seconds": 0.01, "backward_seconds": 0.02,
                                  "param_bytes": 10**6, "optimizer_bytes": 2 * 10**6,
                                  "activation_bytes": 10**5, "output_bytes": 10**4,
                                  "count": layers}]},
            "training": {"global_batch": micro * 2, "micro_batch": 2, **smaller},
            "plan": {"stages": stages},
            "job": {"rebuild_seconds": 0.1},
        }
    )  # fmt: skip


def violations(spec: JobSpec, plan: Plan) -> list[str]:
    """Every invariant a plan must hold; empty when it holds them all."""
    out = check_batch(plan, spec.training)
    ids = sorted(m for pipe in plan.pipelines for m in pipe.micro_batch_ids)
    # A drop plan skips the dropped pipelines' ids, and a reroute of it keeps its pipelines.
    if spec.training.fixed_batch and ids != list(range(spec.training.micro_batches)):
        out.append("micro-batches do not partition [0, B/mbs)")
    for p, pipe in enumerate(plan.pipelines):
        covered = [layer for stage in pipe.stages for layer in stage.layers]
        if covered != list(range(len(spec.layers))):
            out.append(f"pipeline {p} does not hold every layer exactly once")
        for s, stage in enumerate(pipe.stages):
            if len(plan.routing[p][s]) != pipe.micro_batches:
                out.append(f"routing[{p}][{s}] does not cover the pipeline's micro-batches")
            for w in plan.routing[p][s]:
                if w in plan.excluded:
                    out.append(f"excluded {w} executes stage {s} of pipeline {p}")
                if set(stage.layers) - set(plan.owned_layers(w)):
                    out.append(f"{w} executes layers it does not own")
    memory = {w.id: w.memory_bytes for w in spec.workers}
    for w, need in plan.estimates.peak_memory_bytes.items():
        if need > memory[w]:
            out.append(f"{w} over memory")
    for t in plan.migration:
        if t.src in plan.excluded:
            out.append(f"migration from excluded {t.src}")
    return out


def plans_of(d: Decision) -> list[Plan]:
    out = [c.plan for c in d.candidates if c.plan is not None]
    return out + ([d.follow_up] if d.follow_up is not None else [])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_plan_holds_the_invariants(data: st.DataObject) -> None:
    pipes, stages = data.draw(st.integers(2, 4)), data.draw(st.integers(1, 4))
    layers = data.draw(st.integers(stages, 9))
    micro = pipes * data.draw(st.integers(1, 4))
    # A job that accepts a smaller batch (drop candidates) or one whose batch is fixed.
    min_batch = data.draw(st.one_of(st.none(), st.integers(1, micro).map(lambda m: 2 * m)))
    spec = job(pipes, stages, layers, micro, min_batch=min_batch)
    ids = [w.id for w in spec.workers]
    current = initial_plan(spec)
    assert violations(spec, current) == []
    failed: set[str] = set()
    generation = current.generation
    for _ in range(data.draw(st.integers(1, 3))):  # faults, some landing mid-transition
        failed |= set(data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=2)))
        joined = data.draw(st.lists(st.sampled_from(sorted(failed)), max_size=1))
        failed -= set(joined)
        d = decide(
            spec, current, failed, mtbf_seconds=data.draw(st.floats(1.0, 1e6)),
            generation=generation + 1, joined=joined,
            force=data.draw(st.sampled_from([None, "reroute", "dynamic", "drop"])),
        )  # fmt: skip
        for plan in plans_of(d):
            assert violations(spec, plan) == []
            assert plan.generation > current.generation
            assert set(failed) <= set(plan.excluded)
            assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan
        json.dumps(decision_to_dict(d))
        if d.plan is None:
            assert d.selected is None and d.unrecoverable
            break
        current, generation = d.plan, d.plan.generation
        failed |= set(current.excluded)


def candidate(policy: str, step: float, transition: float, mtbf: float) -> Candidate:
    return Candidate(
        policy, True, "", step, transition, selector.score(10, step, transition, mtbf), 0, None
    )


def test_published_score_example() -> None:
    for mtbf, expected in ((15.0, "reroute"), (40.0, "dynamic")):
        rr = candidate("reroute", 2.0, 0.0, mtbf)
        dyn = candidate("dynamic", 1.0, 10.0, mtbf)
        assert select((rr, dyn)) == (expected, "")
    rr, dyn = candidate("reroute", 2.0, 0.0, 15.0), candidate("dynamic", 1.0, 10.0, 15.0)
    assert math.isclose(rr.score, 5.0) and math.isclose(dyn.score, 10 / 3)


def test_force_falls_back_with_a_note_when_infeasible() -> None:
    # Asymmetric pipelines: w1 holds layers 3-5, which no other slot holds as one range, yet
    # every layer survives on w3 and w4.
    spec = job(1, 5, 6, 6)
    spec = parse_spec(
        {
            "workers": [{"id": w.id, "memory_bytes": 10**12} for w in spec.workers],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 0.0},
                "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.0},
            },
            "model": {"layers": [{"forward_seconds": 0.01, "backward_seconds": 0.02,
                                  "param_bytes": 10, "optimizer_bytes": 20,
                                  "activation_bytes": 1, "output_bytes": 1, "count": 6}]},
            "training": {"global_batch": 6, "micro_batch": 1},
            "plan": {"pipelines": [["w0", "w1"], ["w2", "w3", "w4"]]},
        }
    )  # fmt: skip
    d = decide(spec, initial_plan(spec), ["w1"], mtbf_seconds=1e5, generation=2, force="reroute")
    assert d.selected == "dynamic"
    assert "forced reroute is infeasible" in d.note
    assert "no surviving replica" in d.candidates[0].reason


def test_unrecoverable_names_the_lost_layers_without_raising() -> None:
    spec = job(2, 2, 8, 4)
    d = decide(spec, initial_plan(spec), ["w0", "w2"], mtbf_seconds=100.0, generation=2)
    assert d.selected is None and d.plan is None
    assert d.unrecoverable == "layers 0-3 lost every replica (workers w0, w2 failed)"
    assert not any(c.feasible for c in d.candidates)
    assert decision_to_dict(d)["unrecoverable"] == d.unrecoverable


def test_rejoin_takes_the_worker_back_with_a_scale_up_plan() -> None:
    spec = job(4, 2, 8, 16)
    start = initial_plan(spec)
    first = decide(spec, start, ["w3"], mtbf_seconds=1e6, generation=2, force="dynamic")
    assert first.plan is not None and "w3" not in first.plan.workers
    back = decide(spec, first.plan, [], mtbf_seconds=1e6, generation=3, joined=["w3"])
    dyn = back.candidates[1]
    assert dyn.feasible and dyn.plan is not None and "w3" in dyn.plan.workers
    assert dyn.step_seconds < first.plan.estimates.step_seconds  # one more worker helps
    assert back.selected == "dynamic"
    assert back.candidates[0].plan is not None and "w3" in back.candidates[0].plan.excluded


def test_a_returning_worker_takes_its_own_slot_back_under_the_kept_layout() -> None:
    spec = job(4, 2, 8, 16)
    start = initial_plan(spec)
    first = decide(spec, start, ["w3"], mtbf_seconds=1e6, generation=2, force="reroute")
    assert first.plan is not None and "w3" in first.plan.excluded
    back = decide(spec, first.plan, [], mtbf_seconds=1e6, generation=3, joined=["w3"],
                  holdings=of_plan(first.plan))  # fmt: skip
    keep = back.candidates[0]
    assert keep.plan is not None and keep.plan.routing == start.routing  # w3 runs its slot again
    assert keep.plan.excluded == () and keep.step_seconds == pytest.approx(
        start.estimates.step_seconds
    )
    w3 = next(st for p in start.pipelines for st in p.stages if st.worker == "w3")
    assert [(t.dst, t.layers) for t in keep.plan.migration] == [
        ("w3", tuple(range(w3.first_layer, w3.end_layer)))
    ]  # its layers come from a peer: the new process holds nothing


def test_fault_during_a_transition_plans_from_the_published_plan() -> None:
    spec = job(4, 2, 8, 16)
    d1 = decide(spec, initial_plan(spec), ["w0"], mtbf_seconds=1e6, generation=2, force="dynamic")
    assert d1.plan is not None
    # A second fault before the migration finished: cumulative set, plan of generation 2.
    d2 = decide(spec, d1.plan, ["w0", "w5"], mtbf_seconds=1e6, generation=3)
    assert d2.plan is not None and d2.plan.generation == 3
    assert {"w0", "w5"} <= set(d2.plan.excluded)
    assert violations(spec, d2.plan) == []


def test_reroute_now_and_switch_later_when_it_pays() -> None:
    # The paper's score (no risk term), and a search slow enough that hiding it pays.
    spec = replace(
        job(2, 4, 8, 16), restart_seconds=0.0, costs=CostSpec(search_seconds_per_plan=0.01)
    )
    current = initial_plan(spec)
    first = decide(spec, current, ["w1"], mtbf_seconds=1e6, generation=2)
    rr, dyn, _ = first.candidates
    assert rr.feasible and dyn.feasible and dyn.step_seconds < rr.step_seconds
    direct = selector.break_even_seconds(
        rr.step_seconds, rr.transition_seconds, dyn.step_seconds, dyn.transition_seconds
    )
    assert direct is not None
    # The search runs while the rerouted plan trains; the switch stops training for its real
    # transition, migration + rebuild (the state moved changes every step, so it is not staged).
    prep = first.search_seconds
    assert prep > 0
    switch = dyn.transition_seconds - prep
    after = switch * rr.step_seconds / (rr.step_seconds - dyn.step_seconds)
    assert prep + after < direct
    d = decide(spec, current, ["w1"], mtbf_seconds=(prep + after + direct) / 2, generation=2)
    assert d.selected == "reroute" and d.follow_up is not None
    assert d.follow_up_after_seconds is not None
    assert math.isclose(d.follow_up_after_seconds, after, rel_tol=1e-9)
    assert d.follow_up.generation == 3 and d.follow_up.policy == "dynamic"
    assert math.isclose(d.follow_up.estimates.transition_seconds, switch, rel_tol=1e-9)
    assert switch > spec.rebuild_seconds
    assert violations(spec, d.follow_up) == []
    # Too short a window for the switch to pay: no follow-up.
    short = decide(spec, current, ["w1"], mtbf_seconds=prep * 0.9, generation=2)
    assert short.selected == "reroute" and short.follow_up is None
    # Long enough for the direct switch: dynamic now, nothing to follow.
    long = decide(spec, current, ["w1"], mtbf_seconds=direct * 2, generation=2)
    assert long.selected == "dynamic" and long.follow_up is None


def test_a_plan_holding_some_layer_once_pays_the_restart_it_risks() -> None:
    # 2 x 4: after w1's loss the rerouted plan holds layers 2-3 on w5 alone (1 of 7 workers);
    # the dynamic plan over the 7 survivors keeps two copies of everything.
    spec = job(2, 4, 8, 16)
    current = initial_plan(spec)
    rr, dyn, _ = decide(spec, current, ["w1"], mtbf_seconds=1e6, generation=2).candidates
    assert rr.at_risk == pytest.approx(1 / 7) and dyn.at_risk == 0.0
    # A window short enough that the paper's score picks reroute (the migration does not pay)
    even = selector.break_even_seconds(
        rr.step_seconds, rr.transition_seconds, dyn.step_seconds, dyn.transition_seconds
    )
    assert even is not None
    paper = replace(spec, restart_seconds=0.0)
    assert decide(paper, current, ["w1"], mtbf_seconds=even / 2, generation=2).selected == (
        "reroute"
    )
    # ... picks dynamic once w5's loss would cost the 600 s restart, with probability 1/7.
    risky = decide(spec, current, ["w1"], mtbf_seconds=even / 2, generation=2)
    assert risky.selected == "dynamic"
    rr = risky.candidates[0]
    b = spec.training.global_batch
    assert rr.score == pytest.approx(
        selector.score(b, rr.step_seconds, rr.transition_seconds, even / 2, 1 / 7, 600.0)
    )
    # Over a window of a day, the expected restart costs under 0.1%.
    day = decide(spec, current, ["w1"], mtbf_seconds=86400.0, generation=2).candidates[0]
    paper_day = selector.score(b, day.step_seconds, day.transition_seconds, 86400.0)
    assert 0.999 * paper_day < day.score < paper_day


def test_the_risk_term_is_a_probability_of_a_restart() -> None:
    # B = 10, t_step = 1 s, no transition, D = 100 s: 10 samples/s; a certain 100 s restart
    # halves the average over window and pause.
    assert selector.score(10, 1.0, 0.0, 100.0, 1.0, 100.0) == pytest.approx(5.0)
    assert selector.score(10, 1.0, 0.0, 100.0, 0.0, 100.0) == pytest.approx(10.0)
    assert selector.score(10, 1.0, 0.0, math.inf, 1.0, 100.0) == pytest.approx(10.0)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="at_risk"):
            selector.score(10, 1.0, 0.0, 100.0, bad, 100.0)


def test_bad_requests_are_errors_not_results() -> None:
    spec = job(2, 2, 4, 4)
    plan = initial_plan(spec)
    for kwargs in (
        {"failed": ["nope"], "generation": 2},
        {"failed": ["w0"], "generation": 1},
        {"failed": ["w0"], "generation": 2, "force": "restart"},
    ):
        try:
            decide(spec, plan, kwargs["failed"], mtbf_seconds=10.0,  # type: ignore[arg-type]
                   generation=kwargs["generation"], force=kwargs.get("force"))  # type: ignore[arg-type]  # fmt: skip
        except ValueError as e:
            assert str(e)
        else:
            raise AssertionError(f"{kwargs} was accepted")


def test_a_layer_without_state_is_never_lost() -> None:
    """3 x 2 pipelines of one layer per stage; the middle layer holds no parameters or optimizer
    state, so losing every worker that ran it loses nothing: no rollback to a checkpoint."""
    layer = {"forward_seconds": 0.01, "backward_seconds": 0.02, "activation_bytes": 10,
             "output_bytes": 10}  # fmt: skip
    stateful = dict(layer, param_bytes=1000, optimizer_bytes=2000)
    spec = parse_spec(
        {
            "workers": [{"id": f"w{i}", "memory_bytes": 10**9} for i in range(6)],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 1e-5},
                "inter_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 1e-5},
            },
            "model": {
                "layers": [stateful, dict(layer, param_bytes=0, optimizer_bytes=0), stateful]
            },
            "training": {"global_batch": 8, "micro_batch": 1},
            "plan": {"stages": 3},
        }
    )
    current = initial_plan(spec)
    assert [st.worker for st in current.pipelines[0].stages if st.layers == range(1, 2)] == ["w1"]
    assert [st.worker for st in current.pipelines[1].stages if st.layers == range(1, 2)] == ["w4"]
    for checkpoint in (None, 7):
        d = decide(spec, current, ["w1", "w4"], mtbf_seconds=1e4, generation=2,
                   checkpoint_step=checkpoint)  # fmt: skip
        assert d.unrecoverable is None
        assert d.selected == "dynamic" and d.plan is not None
        assert d.plan.restore_step is None
        assert violations(spec, d.plan) == []
        assert all(1 not in t.layers for t in d.plan.migration)


def test_a_scale_up_offers_the_jobs_own_layout() -> None:
    """With every worker of `spec.layout` live again, its layout is priced beside the search's:
    the workers that came back receive their slots' layers (the migration of repairs)."""
    spec = job(4, 2, 4, 32)  # w0-w3 on h0, w4-w7 on h1
    start = initial_plan(spec)
    dropped = decide(spec, start, ["w2", "w3"], mtbf_seconds=1e6, generation=2, force="dynamic")
    assert dropped.plan is not None
    held = of_plan(dropped.plan)
    everyone = [w.id for w in spec.workers]
    own = own_layout(spec, everyone, held)
    assert own is not None
    pipelines, migration, seconds = own
    assert list(pipelines) == list(start.pipelines)
    # w2 and w3 each receive 2 layers of 3 MB (parameters + optimizer state) from their stage's
    # peer on the same host (w0, w1), in one round: 6 MB over the 1e9 B/s intra-host link + 10 us.
    assert sorted((t.src, t.dst, t.nbytes) for t in migration) == [
        ("w0", "w2", 6 * 10**6), ("w1", "w3", 6 * 10**6)
    ]  # fmt: skip
    assert seconds == pytest.approx(6e6 / 1e9 + 1e-5)
    # Not while a worker of it is down.
    assert own_layout(spec, everyone[:-1], held) is None


def test_a_scale_up_takes_the_jobs_own_layout_when_it_steps_faster() -> None:
    """96 hosts of examples/cluster-1024.toml, 8 devices and one 8-stage pipeline each: after a
    host's loss and return the search's layout over the 768 workers crosses hosts (the search
    prices every boundary at the inter-host link) and steps slower than the job's own; the
    dynamic candidate takes the job's own layout back."""
    doc = tomllib.loads((EXAMPLES / "cluster-1024.toml").read_text())
    doc["workers"] = doc["workers"][: 8 * 96]
    doc["training"]["global_batch"] = 12 * 96
    spec = parse_spec(doc)
    start = initial_plan(spec)
    host = [f"w{i}" for i in range(8, 16)]
    dropped = decide(spec, start, host, mtbf_seconds=1e6, generation=2, force="dynamic")
    assert dropped.plan is not None
    running = {st.worker for p in dropped.plan.pipelines for st in p.stages}
    back = [w.id for w in spec.workers if w.id not in running]  # the host and any spares
    up = decide(spec, dropped.plan, [], mtbf_seconds=1e6, generation=3, joined=back,
                holdings=of_plan(dropped.plan))  # fmt: skip
    assert up.selected == "dynamic" and up.plan is not None
    assert up.plan.pipelines == start.pipelines
    assert up.plan.estimates.step_seconds == pytest.approx(start.estimates.step_seconds)
    found = search(spec, [w.id for w in spec.workers])
    assert found.layout is not None and found.layout.shape != tuple(
        tuple((st.first_layer, st.end_layer) for st in p.stages) for p in start.pipelines
    )


def test_a_partial_return_takes_the_jobs_own_layout_with_the_missing_host_rerouted() -> None:
    """64 hosts of examples/cluster-8192.toml: 32 pipelines of 16 stages, each on two hosts.
    Two hosts of different pipelines lost, the job re-partitioned; one comes back. The job's own
    layout is not whole, so before it was never offered; now it is priced with the still-missing
    host's slots rerouted to their same-stage peers, beside the search's layout over the
    survivors: the dynamic candidate is the faster of the two (here the search's, one length
    and one split)."""
    doc = tomllib.loads((EXAMPLES / "cluster-8192.toml").read_text())
    doc["workers"] = doc["workers"][: 8 * 64]
    doc["training"]["global_batch"] = 8 * 32
    spec = parse_spec(doc)
    start = initial_plan(spec)
    first, second = [f"w{i}" for i in range(8)], [f"w{i}" for i in range(16, 24)]
    dropped = decide(spec, start, first + second, mtbf_seconds=1e6, generation=2,
                     force="dynamic")  # fmt: skip
    assert dropped.plan is not None
    running = {st.worker for p in dropped.plan.pipelines for st in p.stages}
    back = [w.id for w in spec.workers if w.id not in running and w.id not in second]
    held = of_plan(dropped.plan)
    survivors = sorted(running | set(back))
    around = own_layout_rerouted(spec, dropped.plan, survivors, held)
    assert around is not None
    pipelines, migration, _, routing = around
    assert list(pipelines) == list(start.pipelines)
    assert not {w for pipe in routing for stage in pipe for w in stage} & set(second)
    assert {t.dst for t in migration} >= set(first)  # the returning host receives its layers
    rerouted = decide(spec, start, second, mtbf_seconds=1e6, generation=2, force="reroute").plan
    assert rerouted is not None and rerouted.routing == routing
    up = decide(spec, dropped.plan, second, mtbf_seconds=1e6, generation=3, joined=back,
                holdings=held)  # fmt: skip
    dyn = up.candidates[1].plan
    assert dyn is not None and dyn.pipelines != start.pipelines
    assert dyn.estimates.step_seconds < rerouted.estimates.step_seconds
    assert dyn.estimates.step_seconds < dropped.plan.estimates.step_seconds
    assert up.selected == "dynamic"
    # With the current plan already on the job's own slots, the reroute candidate is that plan.
    assert own_layout_rerouted(spec, rerouted, survivors, of_plan(rerouted)) is None


# ---- how a decision is acted on: the rules the daemon and the simulator share (core/decision.py)


def test_a_join_the_planner_does_not_take_keeps_the_plan_and_one_that_changes_it_is_taken() -> None:
    spec = job(4, 2, 8, 16)
    start = initial_plan(spec)
    # w3 out of the layout (dynamic): back, it has no slot in it; the kept layout leaves it idle.
    moved = decide(spec, start, ["w3"], mtbf_seconds=1e6, generation=2, force="dynamic").plan
    assert moved is not None and "w3" not in {st.worker for p in moved.pipelines for st in p.stages}
    idle = decide(spec, moved, [], mtbf_seconds=1e6, generation=3, joined=["w3"], force="reroute")
    assert idle.selected == Policy.REROUTE and idle.plan is not None
    assert join_not_taken(moved, idle.plan, joins_only=True)
    # The same plan answering a fault is taken: only a decision on joins alone keeps the plan.
    assert not join_not_taken(moved, idle.plan, joins_only=False)
    # w3 rerouted around: back, it takes its slot again, a layout that differs: taken.
    rerouted = decide(spec, start, ["w3"], mtbf_seconds=1e6, generation=2, force="reroute").plan
    assert rerouted is not None and "w3" in rerouted.excluded
    back = decide(spec, rerouted, [], mtbf_seconds=1e6, generation=3, joined=["w3"],
                  force="reroute", holdings=of_plan(rerouted))  # fmt: skip
    assert back.plan is not None and back.plan.routing == start.routing
    assert not join_not_taken(rerouted, back.plan, joins_only=True)


def test_the_prepared_switch_follows_a_reroute_unless_a_policy_is_forced() -> None:
    # The paper's score (no risk term), and a search slow enough that hiding it pays.
    spec = replace(
        job(2, 4, 8, 16), restart_seconds=0.0, costs=CostSpec(search_seconds_per_plan=0.01)
    )
    current = initial_plan(spec)
    rr, dyn, _ = decide(spec, current, ["w1"], mtbf_seconds=1e6, generation=2).candidates
    direct = selector.break_even_seconds(
        rr.step_seconds, rr.transition_seconds, dyn.step_seconds, dyn.transition_seconds
    )
    assert direct is not None
    d = decide(spec, current, ["w1"], mtbf_seconds=direct * 0.99, generation=2)
    assert d.selected == Policy.REROUTE and d.follow_up is not None
    assert prepared_switch(d, None) == (d.follow_up, d.follow_up_after_seconds)
    assert prepared_switch(d, Policy.REROUTE) is None  # forced: no switch
    assert prepared_switch(None, None) is None  # no decision (the planner failed)
    # Long enough for the direct switch: dynamic now, nothing to follow.
    now = decide(spec, current, ["w1"], mtbf_seconds=direct * 2, generation=2)
    assert now.selected == Policy.DYNAMIC and prepared_switch(now, None) is None


def test_a_preparation_is_keyed_by_what_it_searches_with() -> None:
    # The daemon prepares a plan again only when `prepared_for` moves: the layer figures, the
    # links, or a worker's memory (the search gives every slot the survivors' least).
    spec = job(4, 4, 8, 8)
    plan = initial_plan(spec)
    key = prepared_for(spec, plan)
    assert prepared_for(spec, plan) == key
    smaller = replace(
        spec,
        workers=tuple(
            replace(w, memory_bytes=w.memory_bytes // 2) if w.id == "w2" else w
            for w in spec.workers
        ),
    )
    assert prepared_for(smaller, plan) != key
    slower = replace(spec, layers=tuple(replace(x, forward_seconds=0.02) for x in spec.layers))
    assert prepared_for(slower, plan) != key
