"""The discrete-event simulation agrees with the estimator (failure-free and rerouted steps)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from oracles.simulate import SimOp, SimPipeline, one_f_one_b, simulate

from chameleond.core.decide import decide, initial_plan
from chameleond.core.estimator import Estimator, pipeline_seconds
from chameleond.core.plan import Plan
from chameleond.core.schedule import build_schedule
from chameleond.core.spec import JobSpec, parse_spec


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_one_pipeline_agrees_with_the_longest_path(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 6))
    m = data.draw(st.integers(1, 10))
    fwd = data.draw(st.lists(st.floats(0.01, 3.0), min_size=n, max_size=n))
    bwd = data.draw(st.lists(st.floats(0.01, 3.0), min_size=n, max_size=n))
    comm = data.draw(st.lists(st.floats(0.0, 1.0), min_size=n - 1, max_size=n - 1))
    sim = simulate(
        [SimPipeline(fwd, bwd, m)],
        lambda p, s, _m: f"s{s}",
        lambda p, b, src, dst: 0.0 if src == dst else comm[b],
    )
    assert math.isclose(sim, pipeline_seconds(fwd, bwd, comm, m), rel_tol=1e-9)


def test_one_f_one_b_queue() -> None:
    assert one_f_one_b(3, 0, 4) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3),
    ]  # fmt: skip


def _spec(pipes: int, stages: int, layers: list[tuple[float, float, int]], micro: int) -> JobSpec:
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i % 2}", "memory_bytes": 10**12}
                for i in range(pipes * stages)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e3, "latency_seconds": 0.01},
                "inter_host": {"bandwidth_bytes_per_second": 1e2, "latency_seconds": 0.05},
            },
            "model": {
                "layers": [
                    {
                        "forward_seconds": f,
                        "backward_seconds": b,
                        "param_bytes": 0,
                        "optimizer_bytes": 0,
                        "activation_bytes": 0,
                        "output_bytes": out,
                    }
                    for f, b, out in layers
                ]
            },
            "training": {"global_batch": micro, "micro_batch": 1},
            "plan": {"stages": stages},
        }
    )


def _simulate_plan(spec: JobSpec, plan: Plan) -> float:
    """Simulate the plan with the per-worker op order the workers execute."""
    est = Estimator(spec)
    t = est.table
    pipes = [
        SimPipeline(
            [t.forward_seconds(s.first_layer, s.end_layer) for s in p.stages],
            [t.backward_seconds(s.first_layer, s.end_layer) for s in p.stages],
            p.micro_batches,
        )
        for p in plan.pipelines
    ]
    sch = build_schedule(
        plan.pipelines,
        plan.routing,
        lambda p, s, k, w: 0.0,  # only the order is taken from here
        lambda p, s, k, a, b: 0.0,
    )
    # Order by the ideal start times (the schedule's rule), recomputed with real durations.
    ideal = build_schedule(
        plan.pipelines,
        [[[st.worker] * p.micro_batches for st in p.stages] for p in plan.pipelines],
        lambda p, s, k, w: pipes[p].forward[s] if k == "F" else pipes[p].backward[s],
        lambda p, s, k, a, b: est.transfer_seconds(plan.pipelines[p], s, a, b),
    )
    start = {
        (o.kind, o.pipeline, o.stage, o.micro_batch): (o.start, o.end)
        for ops in ideal.ops.values()
        for o in ops
    }
    order: dict[str, list[SimOp]] = {}
    for w, ops in sch.ops.items():
        keyed = sorted(
            ops,
            key=lambda o: (*start[(o.kind, o.pipeline, o.stage, o.micro_batch)], o.pipeline,
                           o.stage, 0 if o.kind == "F" else 1),
        )  # fmt: skip
        order[w] = [
            (
                o.kind,
                o.pipeline,
                o.stage,
                o.micro_batch - plan.pipelines[o.pipeline].first_micro_batch,
            )
            for o in keyed
        ]
    return simulate(
        pipes,
        lambda p, s, m: plan.routing[p][s][m],
        lambda p, b, src, dst: est.transfer_seconds(plan.pipelines[p], b, src, dst),
        order,
    )


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rerouted_plans_agree_with_the_estimator(data: st.DataObject) -> None:
    pipes = data.draw(st.integers(2, 4))
    stages = data.draw(st.integers(1, 4))
    n_layers = data.draw(st.integers(stages, 7))
    layers = [
        (
            data.draw(st.floats(0.01, 2)),
            data.draw(st.floats(0.01, 2)),
            data.draw(st.integers(0, 50)),
        )
        for _ in range(n_layers)
    ]
    spec = _spec(pipes, stages, layers, pipes * data.draw(st.integers(1, 5)))
    plan = initial_plan(spec)
    failed = data.draw(st.sets(st.sampled_from([w.id for w in spec.workers]), min_size=1))
    d = decide(spec, plan, failed, mtbf_seconds=1e6, generation=2, force="reroute")
    for candidate in (plan, d.candidates[0].plan):
        if candidate is None:
            continue
        got = Estimator(spec).makespan(candidate.pipelines, candidate.routing)
        assert math.isclose(_simulate_plan(spec, candidate), got, rel_tol=1e-9)
