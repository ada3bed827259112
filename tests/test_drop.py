"""The drop candidate (core.drop): the pipelines that lost a worker left out, a smaller batch.

The job: 8 pipelines x 2 stages, one host per pipeline, one micro-batch (2 samples) each, so
B = 16 samples. Stages are 4 layers of 10 ms forward and 20 ms backward: a step is
2 x (40 + 80) ms = 0.24 s of compute, plus two activation hops of 10 KB on the 1 GB/s host link,
plus the gradient all-reduce of each stage's 4 x 100 KB over the 100 MB/s links between hosts
(ring: 2 (n-1)/n of the bytes), plus the commit vote (24 bytes per worker, the same ring over
every worker). Each layer carries 1 GB of optimizer state, so migrating any
layer costs seconds and, with D = 10 s, the dynamic plan cannot pay for its transition.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from chameleond.core import selector
from chameleond.core.decide import DecisionError, decide, initial_plan
from chameleond.core.drop import FIXED_BATCH
from chameleond.core.holdings import of_plan
from chameleond.core.plan import Plan, PlanError, check_batch, plan_from_dict, plan_to_dict
from chameleond.core.policy import Policy, Selection
from chameleond.core.spec import JobSpec, SpecError, parse_spec

PIPES = 8
REBUILD = 0.1


def document(min_global_batch: int | None = 8, pipes: int = PIPES) -> dict[str, Any]:
    training: dict[str, Any] = {"global_batch": 2 * pipes, "micro_batch": 2}
    if min_global_batch is not None:
        training["min_global_batch"] = min_global_batch
    return {
        "job": {"rebuild_seconds": REBUILD},
        "workers": [{"id": f"w{i}", "host": f"h{i // 2}", "memory_bytes": 10**12}
                    for i in range(2 * pipes)],
        "links": {
            "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 0.0},
            "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.0},
        },
        "model": {"layers": [{"forward_seconds": 0.01, "backward_seconds": 0.02,
                              "param_bytes": 10**5, "optimizer_bytes": 10**9,
                              "activation_bytes": 10**5, "output_bytes": 10**4, "count": 8}]},
        "training": training,
        "plan": {"stages": 2},
    }  # fmt: skip


def job(min_global_batch: int | None = 8) -> JobSpec:
    return parse_spec(document(min_global_batch))


def step_of(pipelines: int) -> float:
    """The step time of `pipelines` whole pipelines of one micro-batch each (module docstring)."""
    sync = 2 * (pipelines - 1) / pipelines * 4 * 10**5 / 1e8
    n = 2 * pipelines
    vote = 2 * (n - 1) / n * 24 * n / 1e8
    return 0.24 + 2 * 10**4 / 1e9 + sync + vote


def test_min_global_batch_defaults_to_the_fixed_batch_and_is_validated() -> None:
    assert job(None).training.min_global_batch == 16 and job(None).training.fixed_batch
    assert job(16).training.fixed_batch and not job(8).training.fixed_batch
    for bad, words in [
        (0, "training.min_global_batch: must be >= 1"),
        (-2, "training.min_global_batch: must be >= 1"),
        (7, "training.min_global_batch: 7 is not a multiple of micro_batch (2)"),
        (18, "training.min_global_batch: 18 exceeds global_batch (16)"),
        (4.5, "training.min_global_batch: expected a whole number"),
    ]:
        with pytest.raises(SpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
            parse_spec(document(bad))  # type: ignore[arg-type]


def test_drop_wins_when_a_whole_pipeline_is_lost_and_the_window_is_short() -> None:
    spec = job()
    current = initial_plan(spec)
    assert current.estimates.step_seconds == pytest.approx(step_of(8), rel=1e-6)
    d = decide(spec, current, ["w0", "w1"], mtbf_seconds=10.0, generation=2)
    rr, dyn, dr = d.candidates
    assert [c.policy for c in d.candidates] == [Policy.REROUTE, Policy.DYNAMIC, Policy.DROP]
    assert d.selected == Policy.DROP and d.plan is dr.plan and dr.plan is not None
    plan = dr.plan
    # The other 7 pipelines, unchanged; micro-batch 0 is not trained; 14 samples per step.
    assert plan.pipelines == current.pipelines[1:] and plan.routing == current.routing[1:]
    assert [p.first_micro_batch for p in plan.pipelines] == list(range(1, 8))
    assert plan.global_batch == 14 and plan.migration == () and plan.excluded == ("w0", "w1")
    assert [set(g.workers) for g in plan.sync_groups] == [
        {f"w{2 * p}" for p in range(1, 8)},
        {f"w{2 * p + 1}" for p in range(1, 8)},
    ]
    assert "w0" not in plan.workers and len(plan.workers) == 14
    assert dr.transition_seconds == REBUILD and dr.at_risk == 0.0
    assert dr.step_seconds == pytest.approx(step_of(7), rel=1e-6)
    assert dr.score == pytest.approx(14 / step_of(7) * (10.0 - REBUILD) / 10.0, rel=1e-6)
    # Reroute keeps 16 samples but two workers run two micro-batches; dynamic moves 1 GB layers.
    assert rr.plan is not None and rr.plan.global_batch == 16 and rr.score < dr.score
    assert dyn.plan is not None and dyn.transition_seconds > 1.0 and dyn.score < dr.score
    assert check_batch(plan, spec.training) == []
    assert plan_from_dict(plan_to_dict(plan)) == plan
    # With a longer window the dynamic plan's migration pays: it keeps the full batch.
    assert decide(spec, current, ["w0", "w1"], mtbf_seconds=1e4, generation=2).selected == (
        Policy.DYNAMIC
    )


def test_a_fixed_batch_never_offers_drop_even_forced() -> None:
    spec = job(None)
    d = decide(spec, initial_plan(spec), ["w0", "w1"], mtbf_seconds=10.0, generation=2,
               force=Selection.DROP.force)  # fmt: skip
    dr = d.candidates[2]
    assert not dr.feasible and dr.reason == FIXED_BATCH and dr.plan is None
    assert d.selected == Policy.REROUTE
    assert d.note == f"forced drop is infeasible ({FIXED_BATCH}); selector decided"


def test_forced_drop_is_taken_where_the_selector_would_reroute() -> None:
    spec = job()
    current = initial_plan(spec)
    d = decide(spec, current, ["w3"], mtbf_seconds=1e4, generation=2)
    assert d.selected != Policy.DROP
    forced = decide(spec, current, ["w3"], mtbf_seconds=1e4, generation=2, force="drop")
    assert forced.selected == Policy.DROP and forced.note == "" and forced.plan is not None
    assert forced.plan.pipelines == (current.pipelines[0], *current.pipelines[2:])
    # w2, w3's peer in pipeline 1, is alive and simply not in the plan.
    assert forced.plan.excluded == ("w3",) and "w2" not in forced.plan.workers


def test_infeasible_drops_say_why() -> None:
    spec = job(14)
    current = initial_plan(spec)

    def reason(failed: list[str], **kw: Any) -> str:
        d = decide(spec, current, failed, mtbf_seconds=10.0, generation=2, **kw)
        assert not d.candidates[2].feasible
        return d.candidates[2].reason

    assert reason(["w0", "w3"]) == "12 samples per step would remain, below min_global_batch 14"
    every = [f"w{2 * p + p % 2}" for p in range(PIPES)]  # one stage of each pipeline, alternating
    assert reason(every) == "every one of the 8 pipelines lost a worker"
    assert reason([], joined=[]) == "no pipeline lost a worker"
    # Mid-transition: w4 never acknowledged its layers (it holds nothing yet).
    held = {w: ivs for w, ivs in of_plan(current).items() if w != "w4"}
    assert (
        reason(["w0"], holdings=held) == "w4 (stage 0 of pipeline 2) does not hold layers 0-3 yet"
    )


def drop_plan(spec: JobSpec) -> Plan:
    d = decide(spec, initial_plan(spec), ["w0", "w1"], mtbf_seconds=10.0, generation=2)
    assert d.selected == Policy.DROP and d.plan is not None
    return d.plan


def test_a_fault_on_a_drop_plan_reroutes_at_its_batch_drops_more_or_restores_the_full_batch() -> (
    None
):
    spec = job()
    current = drop_plan(spec)
    idle: list[str] = []  # w0 and w1 failed: no worker of the dropped pipeline is alive
    d = decide(spec, current, ["w0", "w1", "w2"], mtbf_seconds=1e4, generation=3, joined=idle)
    rr, dyn, dr = d.candidates
    assert rr.plan is not None and rr.plan.global_batch == 14  # the current plan's batch
    assert dr.plan is not None and dr.plan.global_batch == 12  # pipeline 1 dropped too
    assert dr.plan.pipelines == current.pipelines[1:]
    assert dyn.plan is not None and dyn.plan.global_batch == 16  # the search restores B
    ids = sorted(m for p in dyn.plan.pipelines for m in p.micro_batch_ids)
    assert ids == list(range(8)) and check_batch(dyn.plan, spec.training) == []
    assert d.selected == Policy.DYNAMIC and d.plan is dyn.plan


def test_joins_after_a_drop_compete_keep_against_the_full_batch() -> None:
    spec = job()
    current = drop_plan(spec)
    held = of_plan(current)  # the drop plan committed: w0 and w1 come back holding nothing
    for window, chosen in ((1e6, Policy.DYNAMIC), (10.0, None)):
        d = decide(spec, current, [], mtbf_seconds=window, generation=3, joined=["w0", "w1"],
                   holdings=held)  # fmt: skip
        keep, dyn, dr = d.candidates
        assert not dr.feasible and "every pipeline of the job is whole" in dr.reason
        assert keep.plan is not None and keep.plan.global_batch == 14
        assert keep.plan.pipelines == current.pipelines
        assert dyn.plan is not None and dyn.plan.global_batch == 16
        assert keep.score == pytest.approx(
            selector.score(14, keep.step_seconds, keep.transition_seconds, window), rel=1e-9
        )
        if chosen is None:  # the 1 GB layers do not move in a 10 s window: the plan is kept
            assert d.selected == Policy.REROUTE and keep.transition_seconds == 0.0
        else:
            assert d.selected == chosen and {"w0", "w1"} <= set(dyn.plan.workers)


def test_check_batch_accepts_a_drop_plan_and_names_what_is_wrong() -> None:
    spec = job()
    plan = drop_plan(spec)
    doc = plan_to_dict(plan)

    def errors(**change: Any) -> list[str]:
        bad = {**doc, **change}
        return check_batch(plan_from_dict(bad), spec.training)

    assert errors() == []
    assert errors(global_batch=10) == [
        "global_batch 10 is not the 7 micro-batches of 2 samples its pipelines train (14)"
    ]
    fixed = job(None)
    assert check_batch(plan, fixed.training) == ["global_batch 14 is below min_global_batch 16"]
    pipes = [dict(p) for p in doc["pipelines"]]
    pipes[1]["first_micro_batch"] = 1  # overlaps pipeline 0's micro-batch 1
    assert "micro-batch 1 is trained by pipelines 0 and 1" in errors(pipelines=pipes)
    pipes = [dict(p) for p in doc["pipelines"]]
    pipes[-1]["first_micro_batch"] = 8
    assert errors(pipelines=pipes) == ["micro-batch 8 is outside 0-7"]
    with pytest.raises(PlanError, match="micro_batches: must be >= 1"):
        pipes = [dict(p) for p in doc["pipelines"]]
        pipes[0]["micro_batches"] = 0
        plan_from_dict({**doc, "pipelines": pipes})


def test_a_join_grows_a_dropped_job_back_with_the_whole_pipelines() -> None:
    """Pipelines 0 and 1 lost a worker each and were dropped (12 samples). Pipeline 0's worker
    comes back: the drop candidate takes the job's own pipelines that are whole again (0 and
    2-7, 14 samples), pipeline 0's workers receiving their slots' layers from replicas."""
    spec = job()
    current = initial_plan(spec)
    first = decide(spec, current, ["w0", "w2"], mtbf_seconds=10.0, generation=2, force="drop")
    assert first.selected == Policy.DROP and first.plan is not None
    dropped = first.plan
    assert dropped.global_batch == 12
    # w1 and w3, alive in the dropped pipelines, are on standby: offered with the returning w0.
    d = decide(
        spec, dropped, ["w2"], mtbf_seconds=1e6, generation=3, joined=["w0", "w1", "w3"],
        holdings=of_plan(dropped),
    )  # fmt: skip
    grow = d.candidates[2]
    assert grow.plan is not None and grow.feasible, grow.reason
    plan = grow.plan
    assert plan.global_batch == 14 and "w2" not in plan.workers and "w0" in plan.workers
    assert [p.first_micro_batch for p in plan.pipelines] == [0, *range(2, 8)]
    assert plan.pipelines[0] == current.pipelines[0]
    # w0 is a new process; w1's copy is a step behind since the drop plan committed: both receive.
    moved = [(t.dst, t.layers) for t in plan.migration]
    assert moved == [("w0", tuple(range(4))), ("w1", tuple(range(4, 8)))]
    assert grow.transition_seconds > REBUILD  # 4 GB of layers per returning worker move
    assert plan.excluded == ("w2",) and check_batch(plan, spec.training) == []
    # With every pipeline whole again, the full batch is the dynamic candidate's (own layout).
    whole = decide(spec, dropped, [], mtbf_seconds=1e6, generation=3,
                   joined=["w0", "w1", "w2", "w3"], holdings=of_plan(dropped))  # fmt: skip
    assert not whole.candidates[2].feasible and "every pipeline" in whole.candidates[2].reason
    assert whole.selected == Policy.DYNAMIC and whole.plan is not None
    assert whole.plan.global_batch == 16
    # A fixed batch never grows back this way: it never dropped.
    assert FIXED_BATCH in decide(job(None), initial_plan(job(None)), ["w0"], mtbf_seconds=10.0,
                                 generation=2).candidates[2].reason  # fmt: skip


def test_a_fault_on_a_layout_across_hosts_drops_to_the_jobs_own_whole_pipelines() -> None:
    """The running layout pairs each pipeline's first stage with the next host's second stage,
    so host h0's loss (w0, w1) breaks two of its pipelines; of the job's own host-aligned
    pipelines it breaks one. The drop candidate is the better of the two: the own 7 whole
    pipelines (14 samples), and nothing moves since every second stage holds the same layers."""
    spec = job()
    own = initial_plan(spec)
    pipes = own.pipelines
    crossed = tuple(
        replace(p, stages=(p.stages[0], pipes[(i + 1) % PIPES].stages[1]))
        for i, p in enumerate(pipes)
    )
    routing = tuple(tuple((st.worker,) * p.micro_batches for st in p.stages) for p in crossed)
    current = replace(own, pipelines=crossed, routing=routing)
    d = decide(spec, current, ["w0", "w1"], mtbf_seconds=10.0, generation=2, force="drop")
    assert d.selected == Policy.DROP and d.plan is not None
    plan = d.plan
    assert plan.global_batch == 14 and plan.pipelines == own.pipelines[1:]
    assert plan.migration == () and plan.excluded == ("w0", "w1")
    # Dropping from the running layout would have kept 6 pipelines, 12 samples.
    kept = [p for p in crossed if not {"w0", "w1"} & {st.worker for st in p.stages}]
    assert len(kept) == 6


def test_a_join_scores_growing_back_over_the_window_and_re_partitioning_over_d() -> None:
    """On a join the grow back is scored over the window to the next fault or return: a
    pipeline not grown back now goes back with the next change. The dynamic candidate of the
    same join keeps D. With a window shorter than the grow back's break-even, keeping the
    dropped batch scores higher; with the window at D, growing back does."""
    spec = job()
    first = decide(spec, initial_plan(spec), ["w0", "w2"], mtbf_seconds=10.0, generation=2,
                   force="drop")  # fmt: skip
    assert first.plan is not None and first.plan.global_batch == 12
    dropped = first.plan

    def at(d: float, window: float | None) -> Any:
        return decide(spec, dropped, ["w2"], mtbf_seconds=d, window_seconds=window,
                      generation=3, joined=["w0", "w1", "w3"],
                      holdings=of_plan(dropped))  # fmt: skip

    keep, _, grow = at(1e6, None).candidates
    assert keep.transition_seconds == 0.0 and keep.plan is not None
    assert keep.plan.global_batch == 12 and grow.plan is not None and grow.plan.global_batch == 14
    # 14/s_g (1 - t/D) = 12/s_k: the window at which growing back pays.
    even = grow.transition_seconds / (1 - 12 * grow.step_seconds / (14 * keep.step_seconds))
    d = 2 * even
    long, short = at(d, None), at(d, even / 2)
    for decision, window in ((long, d), (short, even / 2)):
        kept, dyn, grown = decision.candidates
        assert grown.score == pytest.approx(
            selector.score(14, grow.step_seconds, grow.transition_seconds, window)
        )
        assert dyn.score == pytest.approx(  # the join's re-partition keeps D
            selector.score(16, dyn.step_seconds, dyn.transition_seconds, d)
        )
        assert kept.score == pytest.approx(12 / keep.step_seconds)
    assert long.candidates[2].score > long.candidates[0].score
    assert short.candidates[2].score < short.candidates[0].score
    assert short.mtbf_seconds == d and short.window_seconds == even / 2
    # A fault scores every candidate over the window.
    fault = decide(spec, dropped, ["w2", "w4"], mtbf_seconds=d, window_seconds=even / 2,
                   generation=3, holdings=of_plan(dropped))  # fmt: skip
    assert fault.mtbf_seconds == even / 2
    for c in fault.candidates:
        assert c.plan is not None
        want = selector.score(c.plan.global_batch, c.step_seconds, c.transition_seconds, even / 2,
                              c.at_risk, spec.restart_seconds)  # fmt: skip
        assert c.score == pytest.approx(want)
    with pytest.raises(DecisionError, match="window_seconds"):
        at(d, 2 * d)
