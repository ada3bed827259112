"""The cluster simulator: traces onto workers, the timeline's accounting, each policy's answer,
the selector choosing reroute or re-partition where each must win, and the same decision as the
daemon's core for the same cluster state."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest

from chameleond.cli.ctl import main
from chameleond.core.decide import decide, initial_plan
from chameleond.core.holdings import of_plan
from chameleond.core.selector import estimate_mtbf
from chameleond.core.spec import CostSpec, JobSpec, parse_spec
from chameleond.jobstate.jobspec import spec_document
from chameleond.sim.engine import compare, simulate
from chameleond.sim.policies import POLICIES, Choose, DropReplica, SimConfig, rejoin_seconds
from chameleond.sim.timeline import Phase, Timeline
from chameleond.sim.trace import JobEvent, JobTrace, job_trace, synthetic_trace
from chameleond.traces.replay import TraceEvent, parse_trace


def job(pipes: int = 4, stages: int = 2, layers: int = 4, **extra: Any) -> JobSpec:
    """pipes x stages workers, 2 per host; uniform layers."""
    return parse_spec(
        {
            "workers": [{"id": f"w{i}", "host": f"h{i // 2}", "memory_bytes": 10**12}
                        for i in range(pipes * stages)],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 1e-5},
                "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 1e-4},
            },
            "model": {"layers": [{"forward_seconds": 0.01, "backward_seconds": 0.02,
                                  "param_bytes": 10**6, "optimizer_bytes": 2 * 10**6,
                                  "activation_bytes": 10**5, "output_bytes": 10**4,
                                  "count": layers}]},
            "training": {"global_batch": pipes * 8, "micro_batch": 1},
            "plan": {"stages": stages},
            "job": {"rebuild_seconds": 0.5, **extra},
        }
    )  # fmt: skip


def one_fault(at: float, workers: set[str], end: float) -> JobTrace:
    return JobTrace((JobEvent(at, frozenset(workers), frozenset()),), 1, 8, 0, end)


def test_nodes_take_groups_of_workers() -> None:
    spec = job()
    events = parse_trace(["0,add,node1", "0,add,node2", "0,add,node3", "0,add,node4",
                          "1000,remove,node2", "5000,add,node9", "6000,remove,node7"])  # fmt: skip
    tr = job_trace(spec, events)
    assert tr.devices_per_node == 2  # 8 devices over a peak of 4 nodes
    assert [(e.seconds, sorted(e.failed), sorted(e.joined)) for e in tr.events] == [
        (1.0, ["w2", "w3"], []),
        (5.0, [], ["w2", "w3"]),  # a new node takes the free group
    ]
    assert tr.skipped == 1  # node7 never held a group


def test_synthetic_trace_follows_the_rate_and_repairs() -> None:
    events = synthetic_trace(1024, 8, hours=24 * 30, seed=3)
    removes = [e for e in events if e.action == "remove"]
    # Llama 3's rate: 1,024 devices, one interruption per 49.6 h: about 14.5 in 30 days.
    assert 5 <= len(removes) <= 30
    assert all(isinstance(e, TraceEvent) for e in events)
    assert events == synthetic_trace(1024, 8, hours=24 * 30, seed=3)


def test_timeline_cuts_phases_and_counts_lost_work() -> None:
    tl = Timeline("a", checkpoint_seconds=10.0)
    tl.follow([Phase("transition", 2.0, 0.0, "b"), Phase("training", float("inf"), 5.0, "c")])
    tl.play(1.0)
    assert tl.state == "b"  # the transition started; the plan after it not yet
    tl.play(25.0)
    assert tl.state == "c"
    assert tl.samples == pytest.approx(23 * 5.0)
    # Checkpoints every 10 s of training: at 10 and 20 s of it; 3 s since the last.
    assert tl.lost_samples() == pytest.approx(3 * 5.0)
    kinds = [(s.kind, s.start, s.end) for s in tl.segments]
    assert kinds == [("transition", 0.0, 2.0), ("training", 2.0, 25.0)]


def test_every_policy_accounts_for_the_whole_run() -> None:
    spec = job()
    trace = JobTrace(
        (JobEvent(100.0, frozenset({"w3"}), frozenset()),
         JobEvent(500.0, frozenset(), frozenset({"w3"}))), 1, 8, 0, 1000.0,
    )  # fmt: skip
    out = compare(spec, trace)
    results = out.pop("_results")
    assert set(out["policies"]) == set(POLICIES)
    for name, r in results.items():
        assert sum(r.breakdown.values()) == pytest.approx(1000.0), name
        assert 0 < r.average_throughput <= r.ideal_throughput * 1.2, name
    assert set(out["chameleon_ratio"]) == set(POLICIES) - {"chameleon"}
    # restart pays relaunch + load + lost work at the fault; redundant pays every step.
    assert results["restart"].breakdown["restart"] >= SimConfig().relaunch_seconds
    assert results["redundant"].average_throughput < results["chameleon"].average_throughput


def test_short_window_reroute_must_win() -> None:
    # Faults every 60 s, and a re-partition that stops training for its search (0.1 s per plan
    # considered: about 12 s here) and migration: its faster step never pays that back.
    spec = job(mtbf_prior_seconds=60.0, rebuild_seconds=0.0)
    spec = replace(spec, costs=CostSpec(search_seconds_per_plan=0.1))
    trace = JobTrace(tuple(JobEvent(60.0 * k, frozenset({f"w{k}"}), frozenset())
                           for k in (1, 2)), 1, 8, 0, 180.0)  # fmt: skip
    res = {p: simulate(spec, trace, p) for p in ("chameleon", "reroute", "dynamic")}
    assert [r.selected for r in res["chameleon"].records] == ["reroute", "reroute"]
    assert res["reroute"].average_throughput > res["dynamic"].average_throughput
    # Chameleon may still switch later, once its search ran hidden behind the rerouted steps.
    assert res["chameleon"].average_throughput >= res["reroute"].average_throughput


def test_long_window_repartition_must_win() -> None:
    # One fault, a day of training after it: the faster re-partitioned step pays for its move.
    spec = job(mtbf_prior_seconds=86400.0)
    trace = one_fault(10.0, {"w1"}, 86400.0)
    res = {p: simulate(spec, trace, p) for p in ("chameleon", "reroute", "dynamic")}
    assert [r.selected for r in res["chameleon"].records] == ["dynamic"]
    assert res["chameleon"].average_throughput == pytest.approx(res["dynamic"].average_throughput)
    assert res["chameleon"].average_throughput > res["reroute"].average_throughput


def test_the_simulator_decides_as_the_daemon_core() -> None:
    spec = job(mtbf_prior_seconds=3600.0)
    trace = one_fault(50.0, {"w1"}, 1000.0)
    pol = Choose(spec, SimConfig(), "chameleon", None)
    tl = pol.start()
    tl.play(50.0)
    pol.event(tl, trace.events[0], frozenset({"w1"}))
    # What the daemon's decisions.py passes for the same state: the current plan, the
    # cumulative failed set, D from the fault history, what the workers hold, the checkpoint.
    current = initial_plan(spec)
    step = int(tl.samples // spec.training.global_batch)
    ckpt = step - int(tl.lost_samples() // spec.training.global_batch)
    d = decide(spec, current, ["w1"], generation=2, holdings=of_plan(current),
               mtbf_seconds=estimate_mtbf([50.0], 50.0, 0.0, spec.mtbf_prior_seconds),
               joined=[], checkpoint_step=ckpt, step=step)  # fmt: skip
    assert d.plan is not None
    (record,) = pol.records
    assert record.selected == d.selected
    assert record.step_seconds == d.plan.estimates.step_seconds
    assert record.transition_seconds == d.plan.estimates.transition_seconds
    assert tl.pending[-1].state.plan == d.plan


def test_simulate_cli_json_and_plot(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path = tmp_path / "job.json"
    spec_path.write_text(json.dumps(spec_document(job())))
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n60000,remove,node3\n")
    png = tmp_path / "out.png"
    assert main(["simulate", "--spec", str(spec_path), "--trace", str(trace), "--json",
                 "--plot", str(png)]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    for name in POLICIES:
        assert {"average_throughput", "gap_to_ideal"} <= set(out["policies"][name])
    assert png.stat().st_size > 1000
    assert main(["simulate", "--spec", str(spec_path), "--trace", str(trace),
                 "--policy", "nope"]) == 2  # fmt: skip
    assert "unknown policy" in capsys.readouterr().err
    assert main(["simulate", "--spec", str(spec_path), "--trace", str(tmp_path / "none")]) == 2


def fail_then_back(worker: str) -> JobTrace:
    return JobTrace(
        (JobEvent(100.0, frozenset({worker}), frozenset()),
         JobEvent(500.0, frozenset(), frozenset({worker}))), 1, 8, 0, 1000.0,
    )  # fmt: skip


def training_rates(segments: Any) -> list[float]:
    return [s.throughput for s in segments if s.kind == "training"]


def test_drop_replica_drops_the_pipeline_then_takes_it_back() -> None:
    r = simulate(job(), fail_then_back("w3"), "drop-replica")
    first, dropped, *_, last = training_rates(r.segments)
    assert dropped == pytest.approx(first * 3 / 4, rel=0.02)  # 3 of 4 pipelines train
    assert last == pytest.approx(first, rel=1e-3)  # the checkpoint cadence follows D
    assert [x.selected for x in r.records] == ["drop", "rejoin"]


def test_reroute_gives_a_returning_worker_its_slot_back() -> None:
    r = simulate(job(), fail_then_back("w3"), "reroute")
    rates = training_rates(r.segments)
    assert [x.selected for x in r.records] == ["reroute", "reroute"]
    assert rates[1] < rates[0] and rates[-1] == pytest.approx(rates[0], rel=1e-3)


def test_redundant_takes_over_a_failed_stage_and_falls_back_when_neighbours_fail() -> None:
    spec = job()
    one = simulate(spec, one_fault(100.0, {"w1"}, 1000.0), "redundant")
    assert [x.selected for x in one.records] == ["redundant"]
    assert one.breakdown["restart"] == 0.0
    both = simulate(spec, one_fault(100.0, {"w0", "w1"}, 1000.0), "redundant")
    assert [x.selected for x in both.records] == ["restore"]
    assert both.breakdown["restart"] > 0


def test_drop_replica_rejoin_stops_training_beyond_one_step() -> None:
    # rebuild 5 s + a 4 s fetch, 1.5 s steps: one step overlaps, 7.5 s train nothing.
    assert rejoin_seconds(5.0, 4.0, 1.5) == (7.5, 1.5)
    # A step longer than rebuild + fetch hides both: nothing stops.
    assert rejoin_seconds(0.5, 0.25, 2.0) == (0.0, 0.75)


def test_drop_replica_rejoin_is_priced_as_its_quorum_step() -> None:
    spec = job()
    r = simulate(spec, fail_then_back("w3"), "drop-replica")
    rejoin = r.records[-1]
    # The returning pipeline (w2, w3, both on h1) fetches its 4 layers over h1's interface (the
    # inter-host link, 1e8 B/s), 3 MB of parameters and optimizer state each: 0.12 s; rebuild
    # 0.5 s.
    assert rejoin.transition_seconds == pytest.approx(0.62)
    pol = DropReplica(spec, SimConfig())
    pol.start()
    _, _, step = pol.live_plan(initial_plan(spec), {"w3"})
    after = [s for s in r.segments if s.start >= 500.0]
    assert [s.kind for s in after] == ["training", "transition", "training"]
    assert after[0].end - after[0].start == pytest.approx(min(step, 0.62))
    assert after[1].end - after[1].start == pytest.approx(0.62 - min(step, 0.62))
    assert after[0].throughput < after[2].throughput  # 3 pipelines, then 4


def test_the_simulator_and_the_daemon_expect_the_same_window() -> None:
    """The same faults and returns give the simulator's policy and the daemon's Job the same D
    and the same window to the next fault or return (Job's clock starts at T0, the trace's at 0)."""
    from chameleond.core.machine import PolicyMachine
    from chameleond.jobstate.job import Job

    spec = job(mtbf_prior_seconds=3600.0)
    t0 = 1000.0
    history = [(10.0, "w1", 1010.0), (1100.0, "w2", 2100.0), (2200.0, "w3", 3200.0)]
    # w5 and w6 out together (one event, 1,000 s on average), w7 out alone and not back.
    history += [(3300.0, "w5", 4290.0), (3300.5, "w6", 4310.0)]
    events = sorted(
        [JobEvent(a, frozenset({w}), frozenset()) for a, w, _ in history]
        + [JobEvent(b, frozenset(), frozenset({w})) for _, w, b in history]
        + [
            JobEvent(5000.0, frozenset({"w4"}), frozenset()),
            JobEvent(5100.0, frozenset({"w7"}), frozenset()),
        ],
        key=lambda e: e.seconds,
    )
    pol = Choose(spec, SimConfig(), "chameleon", None)
    tl = pol.start()
    daemon = Job("t", spec, policy="adaptive", machine=PolicyMachine())
    daemon.started = t0
    down: frozenset[str] = frozenset()
    for ev in events:
        tl.play(ev.seconds)
        down = (down | ev.failed) - ev.joined
        pol.event(tl, ev, down)
        for w in ev.failed:
            daemon.count_fault(w, t0 + ev.seconds)
        for w in ev.joined:
            daemon.count_return(w, t0 + ev.seconds)
    now = 5400.0  # w4 out 400 s; repair events of 1,000 s (three) and 999.75 s (w5 and w6)
    d = pol.mtbf(now)
    assert daemon.mtbf(t0 + now) == pytest.approx(d)
    assert daemon.window(t0 + now) == pytest.approx(pol.window(now))
    back = (3 * 600.0 + 599.75) / 4  # w4's expected return; w7's (out 300 s) is later
    assert pol.window(now) == pytest.approx(d * (1 - math.exp(-back / d)))
