"""The performance model: closed form, build_schedule equality, sync, memory, rerouting bound."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.core.decide import decide, initial_plan
from chameleond.core.estimator import (
    Estimator,
    _longest_path,
    closed_form_seconds,
    pipeline_seconds,
    reroute_bound_seconds,
    ring_allreduce_seconds,
    stage_finishes,
)
from chameleond.core.plan import Pipeline, Stage, SyncGroup
from chameleond.core.schedule import BACKWARD, FORWARD, slot_queue
from chameleond.core.spec import JobSpec, LinkSpec, parse_spec
from chameleond.jobstate.jobspec import spec_document


def spec_of(
    n_workers: int, n_stages: int, layers: list[dict[str, Any]], micro: int, *, hosts: int = 1,
    memory: int = 10**12,
) -> JobSpec:  # fmt: skip
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i % hosts}", "memory_bytes": memory}
                for i in range(n_workers)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e3, "latency_seconds": 0.01},
                "inter_host": {"bandwidth_bytes_per_second": 1e2, "latency_seconds": 0.05},
            },
            "model": {"layers": layers},
            "training": {"global_batch": micro, "micro_batch": 1},
            "plan": {"stages": n_stages},
        }
    )


def layer(
    f: float, b: float, *, p: int = 0, o: int = 0, a: int = 0, out: int = 0
) -> dict[str, Any]:
    return {
        "forward_seconds": f, "backward_seconds": b, "param_bytes": p, "optimizer_bytes": o,
        "activation_bytes": a, "output_bytes": out,
    }  # fmt: skip


def reference_makespan(spec: JobSpec, pipelines: Any, routing: Any) -> float:
    """build_schedule's makespan: the op lists the workers run, built op by op."""
    return Estimator(spec).schedule(pipelines, routing).makespan


@given(
    n_stages=st.integers(1, 6), n_micro=st.integers(1, 12), tf=st.floats(0.01, 3.0),
    tb=st.floats(0.01, 3.0), pipes=st.integers(1, 3),
)  # fmt: skip
def test_uniform_symmetric_pipelines_match_the_closed_form(
    n_stages: int, n_micro: int, tf: float, tb: float, pipes: int
) -> None:
    spec = spec_of(n_stages * pipes, n_stages, [layer(tf, tb)] * n_stages, n_micro * pipes)
    plan = initial_plan(spec)
    expected = closed_form_seconds(n_stages, n_micro, tf, tb)
    got = Estimator(spec).makespan(plan.pipelines, plan.routing)
    assert math.isclose(got, expected, rel_tol=1e-9)
    # No parameters: no gradient sync; the commit vote's ring over every worker remains.
    n = n_stages * pipes
    vote = ring_allreduce_seconds(n, 24 * n, spec.intra_host)
    assert vote == (2 * (n - 1) * 0.01 + 2 * (n - 1) / n * 24 * n / 1e3 if n > 1 else 0.0)
    assert math.isclose(plan.estimates.step_seconds, expected + vote, rel_tol=1e-9)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_estimate_equals_build_schedule_on_every_candidate(data: st.DataObject) -> None:
    n_stages = data.draw(st.integers(1, 4))
    pipes = data.draw(st.integers(2, 4))
    n_layers = data.draw(st.integers(n_stages, 8))
    layers = [
        layer(data.draw(st.floats(0.01, 2)), data.draw(st.floats(0.01, 2)),
              out=data.draw(st.integers(0, 500)))
        for _ in range(n_layers)
    ]  # fmt: skip
    spec = spec_of(
        n_stages * pipes, n_stages, layers, pipes * data.draw(st.integers(1, 5)), hosts=2
    )
    plan = initial_plan(spec)
    failed = data.draw(st.sets(st.sampled_from([w.id for w in spec.workers]), min_size=1))
    d = decide(spec, plan, failed, mtbf_seconds=1e6, generation=2)
    est = Estimator(spec)
    for c in d.candidates:
        if c.plan is not None:
            ref = reference_makespan(spec, c.plan.pipelines, c.plan.routing)
            assert math.isclose(est.makespan(c.plan.pipelines, c.plan.routing), ref, rel_tol=1e-12)


# Stage and wire seconds as the model meets them: zeros (clamped), small integers, awkward floats.
SECONDS = st.one_of(
    st.just(0.0), st.integers(0, 5), st.floats(1e-6, 1e4, allow_nan=False, allow_infinity=False)
)


def reference_path(
    fwd: list[float], bwd: list[float], comm: list[float], n_micro: int
) -> dict[tuple[str, int, int], tuple[float, float]]:
    """The 1F1B longest path straight from its definition, (kind, stage, micro-batch) -> (start,
    end): each stage runs its `slot_queue` in order; an op starts after the stage's previous op
    and its dependency plus the wire (F(s, m) on F(s-1, m); B(s, m) on F(s, m) and B(s+1, m)),
    lasting its seconds (at least 1e-12)."""
    n = len(fwd)
    queues = [slot_queue(n, s, n_micro) for s in range(n)]
    times: dict[tuple[str, int, int], tuple[float, float]] = {}
    free, pos = [0.0] * n, [0] * n
    while any(p < len(q) for p, q in zip(pos, queues, strict=True)):
        for s in range(n):
            while pos[s] < len(queues[s]):
                kind, m = queues[s][pos[s]]
                ready = free[s]
                if kind == FORWARD:
                    if s > 0:
                        if (FORWARD, s - 1, m) not in times:
                            break
                        ready = max(ready, times[(FORWARD, s - 1, m)][1] + comm[s - 1])
                else:
                    if s + 1 < n:
                        if (BACKWARD, s + 1, m) not in times:
                            break
                        ready = max(ready, times[(BACKWARD, s + 1, m)][1] + comm[s])
                    ready = max(ready, times[(FORWARD, s, m)][1])
                seconds = fwd[s] if kind == FORWARD else bwd[s]
                free[s] = ready + max(seconds, 1e-12)
                times[(kind, s, m)] = (ready, free[s])
                pos[s] += 1
    return times


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_longest_paths_equal_the_reference_bit_for_bit(data: st.DataObject) -> None:
    """Each op's start and end, and each stage's last backward, exactly (==, not approximately)
    those of the op-by-op walk over the 1F1B queues, on random stage and wire seconds and
    micro-batch counts."""
    n = data.draw(st.integers(1, 9))
    n_micro = data.draw(st.integers(0, 40))
    fwd = data.draw(st.lists(SECONDS, min_size=n, max_size=n))
    bwd = data.draw(st.lists(SECONDS, min_size=n, max_size=n))
    comm = data.draw(st.lists(SECONDS, min_size=n - 1, max_size=n - 1))
    times = reference_path(fwd, bwd, comm, n_micro)
    ops = [(s, m) for s in range(n) for m in range(n_micro)]
    assert _longest_path(fwd, bwd, comm, n_micro) == (
        [times[(FORWARD, s, m)][0] for s, m in ops],
        [times[(FORWARD, s, m)][1] for s, m in ops],
        [times[(BACKWARD, s, m)][0] for s, m in ops],
        [times[(BACKWARD, s, m)][1] for s, m in ops],
    )
    last = [
        max((times[(BACKWARD, s, m)][1] for m in range(n_micro)), default=0.0) for s in range(n)
    ]
    assert stage_finishes(fwd, bwd, comm, n_micro) == last
    assert pipeline_seconds(fwd, bwd, comm, n_micro) == max(last)


def test_asymmetric_pipeline_is_bound_by_its_slowest_stage() -> None:
    # Stage 1 takes twice as long: 1 s of stage 0 before its first forward, its 10 x 4 s, then
    # stage 0's last backward; stage 2's work hides in stage 1's pace.
    t = pipeline_seconds([1.0, 2.0, 1.0], [1.0, 2.0, 1.0], [0.0, 0.0], 10)
    assert math.isclose(t, 1.0 + 10 * 4.0 + 1.0)
    assert t < closed_form_seconds(3, 10, 2.0, 2.0)


def test_transfer_time_is_on_the_link_between_executors() -> None:
    layers = [layer(1, 1, out=100), layer(1, 1, out=100)]
    same = spec_of(2, 2, layers, 1, hosts=1)
    split = spec_of(2, 2, layers, 1, hosts=2)
    t_same = initial_plan(same).estimates.step_seconds
    t_split = initial_plan(split).estimates.step_seconds
    # One micro-batch: F0, send, F1, B1, send back, B0; then the commit vote of the two workers.
    vote_same = ring_allreduce_seconds(2, 48, same.intra_host)
    vote_split = ring_allreduce_seconds(2, 48, split.inter_host)  # the vote spans both hosts
    assert math.isclose(t_same, 4 + 2 * (0.01 + 100 / 1e3) + vote_same)
    assert math.isclose(t_split, 4 + 2 * (0.05 + 100 / 1e2) + vote_split)


def test_ring_allreduce_and_rounds() -> None:
    link = LinkSpec(1e3, 0.01)
    assert ring_allreduce_seconds(1, 1000, link) == 0.0
    assert math.isclose(ring_allreduce_seconds(4, 1000, link), 2 * 3 / 4 * 1.0 + 6 * 0.01)
    spec = spec_of(4, 1, [layer(1, 1, p=1000), layer(1, 1, p=500)], 4)
    est = Estimator(spec)
    one = ring_allreduce_seconds(2, 1000, spec.intra_host)
    two = ring_allreduce_seconds(2, 500, spec.intra_host)
    concurrent = [SyncGroup(("w0", "w1"), (0,), 0), SyncGroup(("w2", "w3"), (1,), 0)]
    rounds = [SyncGroup(("w0", "w1"), (0,), 0), SyncGroup(("w0", "w2"), (1,), 1)]
    assert math.isclose(est.sync_seconds(concurrent), max(one, two))
    assert math.isclose(est.sync_seconds(rounds), one + two)
    # A group spanning hosts runs on the slower link.
    multi = spec_of(4, 1, [layer(1, 1, p=1000)], 4, hosts=2)
    assert math.isclose(
        Estimator(multi).sync_seconds([SyncGroup(("w0", "w1"), (0,), 0)]),
        ring_allreduce_seconds(2, 1000, multi.inter_host),
    )


def test_peak_memory_follows_section_5_and_counts_rerouted_streams() -> None:
    # 4 stages, one layer each: state = 2 p + o, activations a per in-flight micro-batch.
    layers = [layer(1, 1, p=10, o=20, a=100)] * 4
    spec = spec_of(8, 4, layers, 16)
    plan = initial_plan(spec)
    mem = plan.estimates.peak_memory_bytes
    for i, w in enumerate(["w0", "w1", "w2", "w3"]):
        assert mem[w] == 40 + (4 - i) * 100  # N_pp - i in flight (8 micro-batches >= 4)
    d = decide(spec, plan, ["w5"], mtbf_seconds=1e9, generation=2, force="reroute")
    assert d.plan is not None and d.selected == "reroute"
    rerouted = d.plan.estimates.peak_memory_bytes
    assert "w5" not in rerouted
    assert rerouted["w1"] == 40 + 3 * 100 + 3 * 100  # its own stream + the one it serves


def test_out_of_memory_is_named() -> None:
    spec = spec_of(2, 2, [layer(1, 1, p=10, o=20, a=100)] * 2, 2)
    est = Estimator(spec)
    assert est.over_memory({"w0": 10**12}) is None
    reason = est.over_memory({"w0": 10**13})
    assert reason is not None and "w0" in reason and "out of memory" in reason


def test_rerouting_bound_is_conservative_against_the_schedule() -> None:
    assert reroute_bound_seconds(4, 8, 2, [0, 2, 0, 0], 1.0, 2.0) == math.inf
    spec = spec_of(8, 4, [layer(1.0, 2.0)] * 4, 16)
    plan = initial_plan(spec)
    d = decide(spec, plan, ["w1"], mtbf_seconds=1e9, generation=2, force="reroute")
    assert d.plan is not None
    bound = reroute_bound_seconds(4, 8, 2, [0, 1, 0, 0], 1.0, 2.0)
    assert closed_form_seconds(4, 8, 1.0, 2.0) < d.plan.estimates.step_seconds <= bound


def on_host(spec: JobSpec, cores: float, step_cpu: float = 0.0, latency: float = 0.0) -> JobSpec:
    """The spec with its workers sharing `cores` cores of host h0, on links of `latency`."""
    link = {"bandwidth_bytes_per_second": 1e3, "latency_seconds": latency}
    return parse_spec(
        {
            **spec_document(spec),
            "hosts": {"h0": {"cpu_cores": cores, "step_cpu_seconds": step_cpu}},
            "links": {"intra_host": link, "inter_host": link},
        }
    )


def test_updates_add_the_slowest_owner_and_a_shared_host_bounds_the_step() -> None:
    layers = [{**layer(1.0, 2.0), "update_seconds": 0.5}] * 2
    spec = spec_of(4, 2, layers, 4)  # 2 pipelines x 2 stages, 2 micro-batches each, one host
    plan = initial_plan(spec)
    vote = ring_allreduce_seconds(4, 4 * 24, spec.intra_host)  # the commit vote of 4 workers
    assert math.isclose(Estimator(spec).vote_seconds(plan.routing), vote)
    critical = closed_form_seconds(2, 2, 1.0, 2.0) + 0.5  # + one layer's update
    assert math.isclose(plan.estimates.step_seconds, critical + vote)
    # The four workers on one core: every op (8 x 3 s), per-step CPU (4 x 0.25 s) and update
    # (4 x 0.5 s) runs on it in turn; with instant transfers someone can always run.
    one_core = on_host(spec, 1, step_cpu=0.25)
    instant_vote = Estimator(one_core).vote_seconds(plan.routing)
    shared = initial_plan(one_core).estimates.step_seconds
    assert math.isclose(shared, 8 * 3.0 + 4 * 0.25 + 4 * 0.5 + instant_vote)
    assert math.isclose(
        Estimator(one_core).shared_seconds(plan.pipelines, plan.routing), shared - instant_vote
    )
    # Enough cores: nobody shares, and the critical path is the step again.
    many = on_host(spec, 64, latency=0.01)
    assert Estimator(many).shared_seconds(plan.pipelines, plan.routing) == 0.0
    assert math.isclose(initial_plan(many).estimates.step_seconds, critical + vote)


def test_a_rerouted_plan_moves_the_failed_workers_cpu_work_to_its_peers() -> None:
    spec = on_host(spec_of(4, 2, [layer(1.0, 2.0)] * 2, 4), 1)
    plan = initial_plan(spec)
    d = decide(spec, plan, {"w0"}, mtbf_seconds=1e6, generation=2, force="reroute")
    assert d.plan is not None
    # The same ops on three workers of one core: the host's work does not change, only who does it.
    est = Estimator(spec)
    assert math.isclose(est.shared_seconds(d.plan.pipelines, d.plan.routing), 8 * 3.0)


def test_an_uneven_plan_leaves_shared_cores_idle() -> None:
    """Three one-stage pipelines on two cores: the 4-micro-batch one runs alone at the end, on one
    core, while the other core idles (a bound of work / cores would say 6 / 2 = 3 s)."""
    spec = on_host(spec_of(3, 1, [layer(0.5, 0.5)], 6), 2)
    est = Estimator(spec)
    pipes = [
        Pipeline((Stage(w, 0, 1),), first, n)
        for w, first, n in (("w0", 0, 4), ("w1", 4, 1), ("w2", 5, 1))
    ]
    routing = [[[p.stages[0].worker] * p.micro_batches] for p in pipes]
    # 1 s of w1's and w2's work at 2/3 speed (1.5 s), then w0's last 3 s alone.
    assert math.isclose(est.shared_seconds(pipes, routing), 1.5 + 3.0)
    assert math.isclose(est.makespan(pipes, routing), 4.0)
