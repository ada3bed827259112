"""Fail-slow in the cluster simulator: a baseline trains at its plan's pace with the slow worker
in it, chameleon answers with the slow-worker decision, recovery gives the healthy rate back, a
slow worker that fails is a fault, the straggler timeout, and the trace generator and overlay."""

from __future__ import annotations

import json

import pytest
from test_sim import job

from chameleond.cli.ctl import main
from chameleond.core.decide import initial_plan
from chameleond.core.estimator import Estimator
from chameleond.core.policy import Policy
from chameleond.jobstate.slowness import detect_seconds
from chameleond.sim.engine import compare, failure_free_throughput, simulate
from chameleond.sim.policies import POLICIES, SLOW_AWARE, SimConfig
from chameleond.sim.trace import (
    JobEvent,
    JobTrace,
    evict_stragglers,
    job_trace,
    overlay,
    synthetic_slow_trace,
)
from chameleond.traces.replay import parse_trace

NONE: frozenset[str] = frozenset()
BASELINES = [p for p in POLICIES if p not in SLOW_AWARE]


def episode(worker: str, speed: float, start: float, end: float, span: float) -> JobTrace:
    return JobTrace(
        (JobEvent(start, NONE, NONE, {worker: speed}), JobEvent(end, NONE, NONE, {worker: 1.0})),
        1, 8, 0, span,
    )  # fmt: skip


def rate_at(result: object, t: float) -> float:
    return next(s.throughput for s in result.segments if s.start <= t < s.end)  # type: ignore[attr-defined]


def test_a_baseline_trains_at_the_models_pace_with_the_slow_worker() -> None:
    spec = job()
    plan = initial_plan(spec)
    trace = episode("w3", 0.5, 100.0, 1100.0, 2000.0)
    slow_step = Estimator(spec.with_speeds({"w3": 0.5})).step_seconds(
        plan.pipelines, plan.routing, plan.sync_groups
    )
    assert slow_step > plan.estimates.step_seconds * 1.2  # the whole job waits for w3
    batch = spec.training.global_batch
    # without the bubble checkpoints' 1%, a training phase trains B per step of the model
    free = compare(spec, trace, cfg=SimConfig(bubble_checkpoint_overhead=0.0))["_results"]
    for name in ("reroute", "dynamic", "drop-replica"):
        r = free[name]
        assert rate_at(r, 50.0) == pytest.approx(batch / plan.estimates.step_seconds), name
        assert rate_at(r, 500.0) == pytest.approx(batch / slow_step, rel=1e-12), name
        assert rate_at(r, 1500.0) == rate_at(r, 50.0), name  # recovered
        assert r.records == ()  # nothing decided: the baselines ignore slowness
    results = compare(spec, trace)["_results"]
    restart = results["restart"]  # its synchronous checkpoints take the same share throughout
    assert rate_at(restart, 500.0) / rate_at(restart, 50.0) == pytest.approx(
        plan.estimates.step_seconds / slow_step, rel=1e-12
    )
    assert rate_at(restart, 1500.0) == rate_at(restart, 50.0)
    assert rate_at(results["redundant"], 500.0) < rate_at(results["redundant"], 50.0)
    # chameleon trains at the slow pace until the slowness is detected, decides then and at the
    # recovery, and is ahead of every baseline
    ours = results["chameleon"]
    slow_pace = rate_at(results["reroute"], 500.0)
    detected = 100.0 + detect_seconds(batch / slow_pace, len(plan.members))
    assert detected > 105.0
    # w3's stage re-split to fewer layers and its pipeline given fewer micro-batches: w3 stays
    # in the plan, so its recovery is detected as its slowness was, then balanced back
    slow, back = ours.records
    assert slow.seconds == pytest.approx(detected, rel=1e-12)
    assert slow.selected is Policy.DYNAMIC and back.selected is Policy.DYNAMIC
    recovered = 1100.0 + detect_seconds(batch / rate_at(ours, 1102.0), len(plan.members))
    assert back.seconds == pytest.approx(recovered, rel=1e-12) and back.note == "w3 recovered"
    assert rate_at(ours, 102.0) == pytest.approx(slow_pace, rel=1e-12)
    assert rate_at(ours, 500.0) > rate_at(results["reroute"], 500.0)
    assert rate_at(ours, 1500.0) >= rate_at(results["reroute"], 1500.0) * (1 - 1e-9)
    for name in BASELINES:
        assert ours.average_throughput >= results[name].average_throughput, name
    # the ideal counts the slow worker at its speed: half of one of 8 workers for half the run
    ff = failure_free_throughput(spec, plan)
    assert ours.ideal_throughput == pytest.approx(ff * (1 - 0.5 * 1000 / (8 * 2000)), rel=1e-12)


def test_a_slow_worker_that_fails_is_a_fault_for_every_policy() -> None:
    spec = job()
    trace = JobTrace(
        (JobEvent(100.0, NONE, NONE, {"w3": 0.4}), JobEvent(600.0, frozenset({"w3"}), NONE),
         JobEvent(1100.0, NONE, NONE, {"w3": 1.0})),
        1, 8, 0, 2000.0,
    )  # fmt: skip
    fault = JobTrace((JobEvent(600.0, frozenset({"w3"}), NONE),), 1, 8, 0, 2000.0)
    for name in POLICIES:
        slow, only_fault = simulate(spec, trace, name), simulate(spec, fault, name)
        assert 600.0 in [r.seconds for r in slow.records], name  # answered as a fault
        # after it the job runs at the pace it has after the same fault without the slowness
        # (restart's restore weighs the work since its checkpoint, which the slowness changed;
        # chameleon may have moved w3's work away while it was slow)
        after_slow, after_fault = rate_at(slow, 1900.0), rate_at(only_fault, 1900.0)
        assert after_slow == pytest.approx(after_fault, rel=1e-3), name
        # the recovery of a worker that failed changes nothing
        assert rate_at(slow, 1050.0) == rate_at(slow, 1150.0), name


def test_fail_stop_traces_are_unchanged_by_the_slow_machinery() -> None:
    spec = job()
    events = parse_trace(["0,add,node1", "0,add,node2", "0,add,node3", "0,add,node4",
                          "1000000,remove,node2", "3000000,add,node2"])  # fmt: skip
    trace = job_trace(spec, events)
    plain = compare(spec, trace)
    timed = compare(spec, trace, cfg=SimConfig(straggler_timeout_seconds=60.0))
    for p in POLICIES:
        assert plain["policies"][p] == timed["policies"][p]
    # overlaying no episode leaves the trace as it was
    empty = JobTrace((), 1, 8, 0, trace.end_seconds)
    assert overlay(trace, empty) == trace


def test_straggler_timeout_evicts_and_readmits_the_worker() -> None:
    spec = job()
    trace = episode("w3", 0.3, 100.0, 1100.0, 2000.0)
    seen = evict_stragglers(trace, 120.0)
    assert [(e.seconds, sorted(e.failed), sorted(e.joined)) for e in seen.events] == [
        (100.0, [], []), (220.0, ["w3"], []), (1100.0, [], ["w3"]),
    ]  # fmt: skip
    assert evict_stragglers(trace, 5000.0).events == trace.events  # recovered before the timeout
    cfg = SimConfig(straggler_timeout_seconds=120.0)
    r = simulate(spec, trace, "dynamic", cfg)
    patient = simulate(spec, trace, "dynamic")
    assert [x.seconds for x in r.records] == [220.0, 1100.0]  # the fault, then the join
    assert rate_at(r, 150.0) == rate_at(patient, 150.0)  # slow until the timeout
    assert rate_at(r, 800.0) > rate_at(patient, 800.0)  # a 0.3-speed worker is worth dropping
    # chameleon ignores the baselines' timeout
    assert (
        simulate(spec, trace, "chameleon", cfg).records
        == simulate(spec, trace, "chameleon").records
    )


def test_synthetic_episodes_and_overlay() -> None:
    spec = job()
    slow = synthetic_slow_trace(spec, hours=48, seed=2, episodes_per_hour=1.0,
                                factor=(0.3, 0.6), seconds=(60.0, 600.0))  # fmt: skip
    onsets = [(e.seconds, w, f) for e in slow.events for w, f in e.slowed.items() if f < 1.0]
    assert 25 <= len(onsets) <= 75  # a Poisson process at one an hour over 48 hours
    assert all(0.3 <= f <= 0.6 for _, _, f in onsets)
    assert slow == synthetic_slow_trace(spec, hours=48, seed=2, episodes_per_hour=1.0,
                                        factor=(0.3, 0.6), seconds=(60.0, 600.0))  # fmt: skip
    backs = [(e.seconds, w) for e in slow.events for w, f in e.slowed.items() if f >= 1.0]
    for t, w, _ in onsets:  # each episode lasts within the range (or outlasts the trace)
        end = min((b for b, v in backs if v == w and b > t), default=slow.end_seconds)
        assert 60.0 <= end - t <= 600.0 or end == slow.end_seconds
    # on a fail-stop trace: an episode on a worker that is down is left out
    fault = JobTrace((JobEvent(0.5, frozenset({"w0"}), NONE),), 1, 8, 0, 48 * 3600.0)
    both = overlay(fault, slow)
    assert both.events[0].failed == {"w0"}
    assert all("w0" not in e.slowed for e in both.events)
    assert len(both.events) <= len(slow.events) + 1


def test_simulate_cli_overlays_fail_slow(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--spec", "examples/gpt-32.toml", "--trace", "oobleck-1h",
               "--policy", "reroute", "--slow-rate", "2", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slow_episodes"] > 0
    assert out["policies"]["reroute"]["average_throughput"] > 0
