"""Measured links: who probes whom and in which order (worker side), the bounds of a profile's
`links`, and their fold into the spec the planner sees (daemon side). No processes."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest

from chameleond.core.decide import initial_plan
from chameleond.core.machine import PolicyMachine
from chameleond.core.plan import Plan
from chameleond.core.spec import JobSpec, LinkSpec
from chameleond.daemon.dispatch import dispatch
from chameleond.handlers.outcome import Outcome
from chameleond.jobs import load_default_spec
from chameleond.jobstate.job import Job
from chameleond.jobstate.links import links_from_json, links_to_json
from chameleond.jobstate.snapshot import restore, snapshot
from chameleond.protocol import EventError, parse_event
from chameleond.worker._linkprobe import (
    LARGE_BYTES,
    figures,
    neighbour_pairs,
    probe_rounds,
    schedule,
)

BASE = load_default_spec()
# w0..w5 in pipelines (w0 w1) (w2 w3) (w4 w5); w0-w3 on host a, w4 w5 on host b.
SPEC: JobSpec = BASE.with_workers(
    [replace(w, host="a" if i < 4 else "b") for i, w in enumerate(BASE.workers)]
)
LAYERS = [asdict(layer) for layer in SPEC.layers]


def link(peer: str, bandwidth: float, latency: float) -> dict[str, object]:
    return {"peer": peer, "bandwidth_bytes_per_second": bandwidth, "latency_seconds": latency}


def send(j: Job, worker: str, links: object) -> Outcome:
    data = {"layers": LAYERS, "links": links}
    fields = {"type": "profile", "worker": worker, "data": json.dumps(data)}
    return dispatch(j, parse_event(fields), "1-0", 1.0)


def job(spec: JobSpec = SPEC) -> Job:
    j = Job("t", spec, policy="adaptive", machine=PolicyMachine())
    j.plan = initial_plan(j.spec)
    return j


def rerouted(plan: Plan, routing: tuple[tuple[tuple[str, ...], ...], ...]) -> Plan:
    """`plan` with this routing and no sync groups: only pipeline neighbours are probed."""
    return replace(plan, routing=routing, sync_groups=())


# ---- worker side: pairs and their order ---------------------------------------------------------


def test_pairs_are_the_adjacent_stages_of_each_pipeline() -> None:
    plan = replace(initial_plan(SPEC), sync_groups=())
    assert neighbour_pairs(plan) == [("w0", "w1"), ("w2", "w3"), ("w4", "w5")]
    assert probe_rounds(plan) == [[("w0", "w1"), ("w2", "w3"), ("w4", "w5")]]  # all at once
    assert schedule(plan, "w0") == [("w1", True)]
    assert schedule(plan, "w1") == [("w0", False)]  # w0 leads: the first id of the pair


def test_sync_group_rings_are_neighbours_too() -> None:
    """The gradient all-reduce runs around each sync group's ring: those links are probed too
    (a data-parallel plan has no pipeline neighbours at all)."""
    plan = initial_plan(SPEC)
    rings = {tuple(g.workers) for g in plan.sync_groups}
    assert rings == {("w0", "w2", "w4"), ("w1", "w3", "w5")}
    assert neighbour_pairs(plan) == [
        ("w0", "w1"), ("w0", "w2"), ("w0", "w4"), ("w1", "w3"), ("w1", "w5"), ("w2", "w3"),
        ("w2", "w4"), ("w3", "w5"), ("w4", "w5"),
    ]  # fmt: skip
    stage0 = plan.sync_groups[:1]
    data_parallel = replace(plan, routing=((("w0",),), (("w2",),)), sync_groups=stage0)
    assert neighbour_pairs(data_parallel) == [("w0", "w2"), ("w0", "w4"), ("w2", "w4")]


def test_a_middle_stage_probes_both_neighbours_in_rounds_both_sides_agree_on() -> None:
    plan = initial_plan(SPEC)
    # One pipeline of three stages, its micro-batches split between two executors of stage 1.
    routing = ((("w2", "w2"), ("w0", "w5"), ("w1", "w1")),)
    plan = rerouted(plan, routing)
    assert neighbour_pairs(plan) == [("w0", "w1"), ("w0", "w2"), ("w1", "w5"), ("w2", "w5")]
    rounds = probe_rounds(plan)
    for pairs in rounds:  # nobody twice in a round
        members = [w for pair in pairs for w in pair]
        assert len(members) == len(set(members))
    # Each pair's two sides list it at the same position among the pairs they share a round
    # order with: their schedules, read pair by pair, never wait on each other in a cycle.
    order = {pair: r for r, pairs in enumerate(rounds) for pair in pairs}
    for w in plan.workers:
        mine = schedule(plan, w)
        assert [order[(min(w, p), max(w, p))] for p, _ in mine] == sorted(
            order[(min(w, p), max(w, p))] for p, _ in mine
        )
        for peer, leads in mine:
            assert leads == (w < peer) and (w, not leads) in schedule(plan, peer)


def test_a_worker_without_neighbours_measures_nothing() -> None:
    plan = rerouted(initial_plan(SPEC), ((("w0",), ("w0",)),))  # one worker runs both stages
    assert neighbour_pairs(plan) == [] and schedule(plan, "w0") == []


def test_figures_from_round_trips() -> None:
    bandwidth, latency = figures(small_rtt=2e-4, large_rtt=2e-4 + 2 * LARGE_BYTES / 1e8)
    assert latency == pytest.approx(1e-4)
    assert bandwidth == pytest.approx(1e8)


# ---- daemon side: the fold into the spec ------------------------------------------------------


def test_a_slow_inter_host_pair_lowers_inter_host_and_leaves_intra_host() -> None:
    j = job()
    assert send(j, "w4", [link("w5", 5e9, 1e-5)]).label == "handled"  # b-b: intra-host
    assert send(j, "w2", [link("w3", 3e9, 2e-5)]).label == "handled"  # a-a: intra-host
    assert j.spec.intra_host == LinkSpec(3e9, 2e-5)  # the slowest of the kind
    assert j.spec.inter_host == SPEC.inter_host  # none measured: the spec's
    # A plan that puts w3 and w4 next to each other: that pair crosses hosts.
    send(j, "w3", [link("w2", 3e9, 2e-5), link("w4", 6.25e6, 2e-3)])
    assert j.spec.inter_host == LinkSpec(6.25e6, 2e-3)
    assert j.spec.intra_host == LinkSpec(3e9, 2e-5)
    view = j.links_view()
    assert view["inter_host"] == {
        "bandwidth_bytes_per_second": 6.25e6, "latency_seconds": 2e-3, "measured": True,
    }  # fmt: skip
    assert [(p["worker"], p["peer"], p["inter_host"]) for p in view["pairs"]] == [
        ("w2", "w3", False), ("w3", "w2", False), ("w3", "w4", True), ("w4", "w5", False),
    ]  # fmt: skip
    # The newest measurement replaces the worker's earlier ones: the link recovered.
    send(j, "w3", [link("w4", 2e9, 1e-4)])
    assert j.spec.inter_host == LinkSpec(2e9, 1e-4)
    assert j.spec.intra_host == LinkSpec(3e9, 2e-5)  # w2's measurement of the a-a pair stands


def test_the_slow_link_changes_what_the_planner_prices() -> None:
    j = job()
    fast = j.spec.link("w3", "w4").transfer_seconds(1 << 20)
    send(j, "w3", [link("w4", 6.25e6, 2e-3)])
    assert j.spec.link("w3", "w4").transfer_seconds(1 << 20) > 10 * fast


def test_measurements_of_workers_out_of_the_plan_are_dropped() -> None:
    j = job()
    send(j, "w3", [link("w4", 6.25e6, 2e-3)])
    assert j.spec.inter_host.bandwidth_bytes_per_second == 6.25e6
    # The next plan fences w4: its links no longer count (nor links to it).
    assert j.plan is not None
    j.plan = replace(j.plan, generation=2, excluded=("w4",))
    assert j.spec.inter_host == SPEC.inter_host
    assert j.links_view()["inter_host"]["measured"] is False


def test_links_survive_a_daemon_restart() -> None:
    j = job()
    send(j, "w3", [link("w4", 6.25e6, 2e-3)])
    again = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    restore(again, json.loads(json.dumps(snapshot(j))), j.plan, ready_timeout=60.0)
    assert again.spec.inter_host == LinkSpec(6.25e6, 2e-3)


def test_a_workers_links_are_persisted_with_every_field() -> None:
    links = {"w2": LinkSpec(1.5e9, 2e-5), "w0": LinkSpec(3e8, 1e-4)}
    assert links_to_json(links) == {p: asdict(link) for p, link in sorted(links.items())}
    assert list(links_to_json(links)) == ["w0", "w2"]
    assert links_from_json(json.loads(json.dumps(links_to_json(links)))) == links


def test_a_profile_without_links_keeps_the_newest_and_a_repeat_is_a_duplicate() -> None:
    j = job()
    send(j, "w3", [link("w4", 6.25e6, 2e-3)])
    assert send(j, "w3", [link("w4", 6.25e6, 2e-3)]).label == "duplicate"
    fields = {"type": "profile", "worker": "w3", "data": json.dumps({"layers": LAYERS})}
    dispatch(j, parse_event(fields), "1-0", 1.0)
    assert j.spec.inter_host == LinkSpec(6.25e6, 2e-3)


@pytest.mark.parametrize(
    ("links", "reason"),
    [
        ({"w4": 1}, "'links' must be a list"),
        (["w4"], r"links\[0\] must be an object"),
        ([{"bandwidth_bytes_per_second": 1e9, "latency_seconds": 0}], r"links\[0\].peer"),
        ([link("w4", 0, 1e-3)], "must be > 0"),
        ([link("w4", -1, 1e-3)], "bandwidth_bytes_per_second must be a number"),
        ([link("w4", 2e13, 1e-3)], "bandwidth_bytes_per_second must be a number"),
        ([link("w4", 10**400, 1e-3)], "bandwidth_bytes_per_second must be a number"),
        ([link("w4", "fast", 1e-3)], "bandwidth_bytes_per_second must be a number"),
        ([link("w4", 1e9, 61)], "latency_seconds must be a number"),
        ([link("w4", 1e9, -1e-3)], "latency_seconds must be a number"),
        ([link("w4", 1e9, True)], "latency_seconds must be a number"),
        ([link("w4", 1e9, 1e-3), link("w4", 1e9, 1e-3)], "names peer 'w4' again"),
        ([link(f"x{i}", 1e9, 1e-3) for i in range(7)], "7 links listed, the job has 6"),
    ],
)
def test_malformed_links_are_rejected_and_change_nothing(links: object, reason: str) -> None:
    j = job()
    send(j, "w3", [link("w4", 6.25e6, 2e-3)])
    before = j.spec
    with pytest.raises(EventError, match=reason):
        send(j, "w3", links)
    assert j.spec == before and j.workers["w3"].links == {"w4": LinkSpec(6.25e6, 2e-3)}


def test_nan_and_infinite_figures_do_not_parse_into_the_spec() -> None:
    j = job()
    for bad in ("NaN", "Infinity"):
        entry = f'{{"peer": "w4", "bandwidth_bytes_per_second": {bad}, "latency_seconds": 0.001}}'
        raw = f'{{"layers": [], "links": [{entry}]}}'
        fields = {"type": "profile", "worker": "w3", "data": raw}
        with pytest.raises(EventError):
            dispatch(j, parse_event(fields), "1-0", 1.0)
    assert j.spec.inter_host == SPEC.inter_host
