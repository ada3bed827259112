"""The rerouting candidate: same-range peers take a failed slot's micro-batches, evenly."""

from __future__ import annotations

from collections import Counter

from chameleond.core.decide import initial_plan
from chameleond.core.plan import Plan
from chameleond.core.reroute import reroute
from chameleond.core.spec import JobSpec, parse_spec


def grid(pipes: int, stages: int, layers: int, micro: int, hosts: list[str]) -> JobSpec:
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": hosts[i], "memory_bytes": 10**12}
                for i in range(pipes * stages)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 0.0},
                "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 0.0},
            },
            "model": {"layers": [{"forward_seconds": 1, "backward_seconds": 2, "param_bytes": 1,
                                  "optimizer_bytes": 1, "activation_bytes": 1, "output_bytes": 1,
                                  "count": layers}]},
            "training": {"global_batch": micro, "micro_batch": 1},
            "plan": {"stages": stages},
        }
    )  # fmt: skip


def owns(plan: Plan, worker: str, first: int, end: int) -> bool:
    return any(
        st.worker == worker and (st.first_layer, st.end_layer) == (first, end)
        for pipe in plan.pipelines
        for st in pipe.stages
    )


def test_failed_slot_spreads_evenly_over_its_peers() -> None:
    spec = grid(4, 2, 4, 24, ["h"] * 8)
    plan = initial_plan(spec)
    r = reroute(spec, plan, {"w3"})  # pipeline 1, stage 1
    assert r.routing is not None and r.rerouted == 6
    got = Counter(r.routing[1][1])
    assert set(got) == {"w1", "w5", "w7"} and sorted(got.values()) == [2, 2, 2]
    for p, pipe in enumerate(plan.pipelines):
        for s, st in enumerate(pipe.stages):
            for w in r.routing[p][s]:
                assert w != "w3"
                assert owns(plan, w, st.first_layer, st.end_layer)
            if st.worker != "w3":
                assert set(r.routing[p][s]) == {st.worker}


def test_same_host_peers_are_preferred_on_ties() -> None:
    hosts = ["a", "a", "b", "b", "a", "a", "b", "b"]  # pipelines 0 and 2 on host a
    spec = grid(4, 2, 4, 4, hosts)
    r = reroute(spec, initial_plan(spec), {"w1"})
    assert r.routing is not None
    assert r.routing[0][1] == ("w5",)  # one micro-batch, the peer on host a


def test_no_surviving_replica_names_the_slot_and_layers() -> None:
    spec = grid(3, 2, 6, 6, ["h"] * 6)
    r = reroute(spec, initial_plan(spec), {"w1", "w3", "w5"})
    assert r.routing is None
    assert r.reason == "stage 1 of pipeline 0 has no surviving replica (layers 3-5)"


def test_cumulative_failures_reroute_an_already_rerouted_plan() -> None:
    spec = grid(4, 2, 4, 8, ["h"] * 8)
    plan = initial_plan(spec)
    first = reroute(spec, plan, {"w1"})
    assert first.routing is not None
    rerouted = Plan(**{**plan.__dict__, "routing": first.routing, "excluded": ("w1",)})
    second = reroute(spec, rerouted, {"w1", "w3"})
    assert second.routing is not None
    executors = Counter(w for pipe in second.routing for w in pipe[1])
    assert set(executors) == {"w5", "w7"} and executors["w5"] == executors["w7"] == 4
