"""Processor sharing on a host's cores (core/sharing.py) against the schedule's longest path."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.core.decide import decide, initial_plan
from chameleond.core.plan import Plan
from chameleond.core.schedule import FORWARD, Op, build_schedule
from chameleond.core.sharing import shared_jobs_seconds, shared_makespan
from chameleond.core.spec import parse_spec


def test_independent_work_shares_the_cores_equally() -> None:
    # Two cores, three pieces: all at 2/3 speed until the 1 s pieces end (1.5 s), then the
    # 3 s piece alone on one core for its last 2 s.
    assert math.isclose(shared_jobs_seconds([3.0, 1.0, 1.0], 2), 3.5)
    assert shared_jobs_seconds([3.0, 1.0, 1.0], 3) == 3.0  # a core each
    assert shared_jobs_seconds([3.0, 1.0, 1.0], None) == 3.0  # not a shared host
    assert math.isclose(shared_jobs_seconds([3.0, 1.0, 1.0], 1), 5.0)  # one after another
    assert shared_jobs_seconds([], 2) == 0.0


_LINK = {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 0.0}
Costs = dict[int, tuple[float, float]]  # per layer: forward, backward seconds


def _job(data: st.DataObject) -> tuple[Plan, Costs]:
    """A random job over two hosts: its initial plan or a rerouted one, and its layer costs."""
    n_stages = data.draw(st.integers(1, 3))
    pipes = data.draw(st.integers(2, 3))
    seconds = st.floats(0.01, 2.0)
    costs = {
        i: (data.draw(seconds), data.draw(seconds))
        for i in range(data.draw(st.integers(n_stages, 5)))
    }
    layers = [
        {"forward_seconds": f, "backward_seconds": b, "param_bytes": 0, "optimizer_bytes": 0,
         "activation_bytes": 0, "output_bytes": 0}
        for f, b in costs.values()
    ]  # fmt: skip
    spec = parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i % 2}", "memory_bytes": 10**12}
                for i in range(n_stages * pipes)
            ],
            "links": {"intra_host": _LINK, "inter_host": _LINK},  # unused: _comm is the wire
            "model": {"layers": layers},
            "training": {"global_batch": pipes * data.draw(st.integers(1, 4)), "micro_batch": 1},
            "plan": {"stages": n_stages},
        }
    )
    plan = initial_plan(spec)
    if data.draw(st.booleans()):
        failed = data.draw(st.sampled_from([w.id for w in spec.workers]))
        d = decide(spec, plan, {failed}, mtbf_seconds=1e6, generation=2, force="reroute")
        if d.plan is not None:
            plan = d.plan
    return plan, costs


def _host(worker: str) -> str:
    return f"h{int(worker[1:]) % 2}"


def _comm(_p: int, _s: int, _k: str, a: str, b: str) -> float:
    return 0.0 if a == b else 0.01 if _host(a) == _host(b) else 0.05


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_with_a_core_each_it_is_the_longest_path_and_never_beats_the_cores(
    data: st.DataObject,
) -> None:
    plan, costs = _job(data)

    def seconds(p: int, s: int, kind: str, _w: str) -> float:
        st_ = plan.pipelines[p].stages[s]
        return sum(costs[i][0 if kind == FORWARD else 1] for i in st_.layers)

    def work(op: Op) -> float:
        return seconds(op.pipeline, op.stage, op.kind, op.worker)

    sched = build_schedule(plan.pipelines, plan.routing, seconds, _comm)
    host_of = {w: _host(w) for w in sched.ops}
    # Hosts not listed, or a core for every worker: nobody waits for a core.
    assert math.isclose(shared_makespan(sched.ops, work, _comm, host_of, {}), sched.makespan)
    plenty = {"h0": 99.0, "h1": 99.0}
    assert math.isclose(shared_makespan(sched.ops, work, _comm, host_of, plenty), sched.makespan)
    # Fewer cores: never faster than a core each, nor than a host's work over its cores.
    cores = {"h0": data.draw(st.floats(0.5, 3.0)), "h1": data.draw(st.floats(0.5, 3.0))}
    shared = shared_makespan(sched.ops, work, _comm, host_of, cores)
    assert shared >= sched.makespan * (1 - 1e-9)
    for h, c in cores.items():
        busy = sum(work(op) for w, q in sched.ops.items() if host_of[w] == h for op in q)
        assert shared >= busy / c * (1 - 1e-9)
