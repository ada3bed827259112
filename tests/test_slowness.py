"""Fail-slow detection from training profiles (chameleond/jobstate/slowness.py): the peers by layer
coverage, the hold and the hysteresis, the episode duration, and the fold of a slow worker's
measurements into the spec the planner sees."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chameleond.core.decide import initial_plan
from chameleond.core.machine import PolicyMachine
from chameleond.core.spec import LayerProfile
from chameleond.jobs import load_default_spec
from chameleond.jobstate.job import Job
from chameleond.jobstate.jobspec import measured_layers, parse_profile
from chameleond.jobstate.slowness import (
    HOLD_SECONDS,
    MARGIN,
    MIN_SAMPLES,
    RECOVER_MARGIN,
    WINDOW_SECONDS,
    Measure,
    PeerGroup,
    Slowness,
    expected_episode_seconds,
    measure_of,
    own_speed,
    peer_speeds,
)
from chameleond.jobstate.snapshot import restore, snapshot

STAGES = (frozenset({0, 1}), frozenset({2, 3}))
WORKERS = {"a0": STAGES[0], "a1": STAGES[1], "b0": STAGES[0], "b1": STAGES[1],
           "c0": STAGES[0], "c1": STAGES[1]}  # fmt: skip


def m(layers: frozenset[int], compute: float = 1.0) -> Measure:
    return Measure(1, layers, compute)


def test_a_worker_is_compared_with_the_workers_that_ran_the_same_layers() -> None:
    speeds = peer_speeds({"a0": m(STAGES[0], 2.0), "b0": m(STAGES[0]), "c0": m(STAGES[0]),
                          "a1": m(STAGES[1], 5.0), "b1": m(STAGES[1], 5.0)})  # fmt: skip
    assert speeds["a0"] == pytest.approx(0.5)  # median of its peers (1, 1) over its 2
    assert speeds["b0"] == pytest.approx(1.5)  # median of (2, 1) over its 1
    assert speeds["a1"] == speeds["b1"] == pytest.approx(1.0)  # a slower stage is not slow


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]))))
def test_a_peer_group_kept_sorted_gives_each_worker_the_speed_of_its_peers(
    reports: list[tuple[str, float]],
) -> None:
    """The detector's sorted groups, reports replacing reports and workers leaving: every
    worker's speed is the median of the others' computes over its own, ties included."""
    group, computes = PeerGroup(), {}
    for i, (worker, compute) in enumerate(reports):
        if i % 5 == 4:  # now and then a worker leaves the group
            group.discard(worker)
            computes.pop(worker, None)
        else:
            group.set(worker, compute)
            computes[worker] = compute
        for w in "abcdefg":
            assert group.speed(w) == own_speed(computes, w)


def test_the_members_are_taken_up_whether_they_changed_or_came_again() -> None:
    """Members that change regroup the peers; members that come again as a new but equal set (a
    plan of the same workers) are kept as given, so that every later profile finds them the same
    at a glance rather than by comparing every name."""
    det = Slowness()
    everyone = frozenset(WORKERS)
    for w, layers in WORKERS.items():
        det.observe(w, m(layers, 2.0 if w == "a0" else 1.0), everyone, 0.0)
    again = frozenset(WORKERS)
    assert again is not everyone
    det.observe("b0", m(STAGES[0]), again, 1.0)
    assert det._members is again
    assert det._groups[STAGES[0]].speed("a0") == pytest.approx(0.5)
    without = frozenset(WORKERS) - {"c0"}  # a0 against b0 alone
    det.observe("a0", m(STAGES[0], 4.0), without, 2.0)
    assert det._groups[STAGES[0]].computes == {"a0": 4.0, "b0": 1.0}
    assert det._groups[STAGES[0]].speed("a0") == pytest.approx(0.25)


def test_without_peers_there_is_no_speed_and_no_detection() -> None:
    assert peer_speeds({"a0": m(STAGES[0], 9.0), "a1": m(STAGES[1])}) == {}
    det = Slowness()
    for t in range(30):
        assert det.observe("a0", m(STAGES[0], 9.0 + t), {"a0", "a1"}, float(t)) == []
    assert det.speeds() == {}


def feed(det: Slowness, slow: float, t0: float, t1: float, step: float = 1.0) -> list[str]:
    """Every worker reports each `step` seconds from t0 to t1; a0 at speed `slow`."""
    causes = []
    t = t0
    while t <= t1:
        for w, layers in WORKERS.items():
            compute = 1.0 / slow if w == "a0" else 1.0
            causes += [x.cause for x in det.observe(w, m(layers, compute), WORKERS, t)]
        t += step
    return causes


def test_the_windows_median_held_below_is_slow_held_above_recovered_with_hysteresis() -> None:
    det = Slowness()
    assert feed(det, 1.0, 0, 40) == []
    # Just under the slow threshold from t=41, a profile a second: the window's median is under
    # once most of the window is (half of it later), and slow once that held HOLD_SECONDS.
    below = 0.95 / MARGIN
    crossed = 41 + int(WINDOW_SECONDS // 2)
    assert feed(det, below, 41, crossed + HOLD_SECONDS - 1) == []
    assert feed(det, below, crossed + HOLD_SECONDS, crossed + HOLD_SECONDS) == [
        f"a0 slow: speed {below:.2f} for {HOLD_SECONDS:.0f} s"
    ]
    assert det.speeds() == {"a0": pytest.approx(below)}
    # Between the two thresholds it stays slow however long (hysteresis).
    between = (1 / MARGIN + 1 / RECOVER_MARGIN) / 2
    assert feed(det, between, 60, 120) == []
    assert det.speeds() == {"a0": pytest.approx(between)}
    # Back over the recovery threshold, the same way round.
    back = 121 + int(WINDOW_SECONDS // 2)
    assert feed(det, 1.0, 121, back + HOLD_SECONDS - 1) == []
    assert feed(det, 1.0, back + HOLD_SECONDS, back + HOLD_SECONDS) == ["a0 recovered"]
    assert det.speeds() == {}
    # The episode: from the first slow observation to the recovery.
    assert det.episodes == [(crossed, back + HOLD_SECONDS - crossed)]
    assert (det.detected, det.recovered) == (1, 1)


def test_a_slow_workers_change_of_speed_is_decided_on_again_either_way() -> None:
    """Slow at 0.4; then at 0.6 (over MARGIN faster than decided, still under the recovery
    threshold): a change of speed, held as a transition is; at 0.45 (MARGIN slower than 0.6):
    another; within MARGIN of the speed decided on: nothing. One episode throughout."""
    det = Slowness()
    feed(det, 1.0, 0, 20)
    causes = feed(det, 0.4, 21, 50)
    assert causes == [f"a0 slow: speed 0.40 for {HOLD_SECONDS:.0f} s"]
    faster = feed(det, 0.6, 51, 90)
    assert faster == ["a0 slow: speed 0.60 (was 0.40)"]
    assert det.speeds() == {"a0": pytest.approx(0.6)} and det.workers["a0"].decided == 0.6
    assert feed(det, 0.6 * 0.9, 91, 130) == []  # within MARGIN of 0.6
    assert feed(det, 0.45, 131, 170) == ["a0 slow: speed 0.45 (was 0.60)"]
    assert feed(det, 1.0, 171, 210) == ["a0 recovered"]
    assert (det.detected, det.recovered) == (1, 1) and len(det.episodes) == 1
    assert det.workers["a0"].decided == 1.0
    # The speed decided on survives a restart of the daemon (the job's snapshot).
    feed(det, 0.4, 211, 250)
    again = Slowness.from_json(json.loads(json.dumps(det.to_json())))
    assert again.workers["a0"].decided == pytest.approx(0.4)
    old = {**det.to_json()["workers"]["a0"]}
    del old["decided"]  # a snapshot written before it was kept: the speed observed stands in
    assert Slowness.from_json({"workers": {"a0": old}}).workers["a0"].decided == old["speed"]


def test_single_slow_profiles_in_a_healthy_window_change_nothing() -> None:
    det = Slowness()
    t = 0.0
    for _ in range(12):  # every third profile of a0 at a fifth of its speed, for a minute
        assert feed(det, 1.0, t, t + 3) == []
        assert feed(det, 0.2, t + 4, t + 4) == []
        t += 5
    assert det.speeds() == {} and det.workers["a0"].speed == 1.0


def test_a_short_dip_is_not_an_episode() -> None:
    det = Slowness()
    for start in (0.0, 20.0, 40.0):
        assert feed(det, 0.3, start, start + HOLD_SECONDS - 1) == []
        assert feed(det, 1.0, start + HOLD_SECONDS, start + 19) == []
    assert det.speeds() == {} and det.episodes == []


def test_a_dead_slow_worker_leaves_the_speeds() -> None:
    det = Slowness()
    feed(det, 0.5, 0, 15)
    assert set(det.speeds()) == {"a0"}
    assert det.forget("a0") is True
    assert det.speeds() == {} and det.forget("b0") is False


def test_the_expected_duration_is_the_mean_of_past_episodes_else_the_prior() -> None:
    assert expected_episode_seconds([], 600.0) == 600.0
    assert expected_episode_seconds([100.0, 300.0], 600.0) == 200.0
    det = Slowness()
    assert det.expected_seconds(450.0) == 450.0
    feed(det, 0.5, 0, 15)
    feed(det, 1.0, 16, 60)
    assert det.expected_seconds() == pytest.approx(det.episodes[0][1])


def test_only_training_profiles_naming_their_plan_are_measures() -> None:
    layer = LayerProfile("l", 0.25, 0.5, 0, 0, 0, 0)
    profile = {0: layer, 1: layer}
    assert measure_of({"source": "training", "generation": 3}, profile) == Measure(
        3, frozenset({0, 1}), 1.5
    )
    assert measure_of({"generation": 3}, profile) is None  # a start-up profile
    assert measure_of({"source": "training"}, profile) is None
    assert measure_of({"source": "training", "generation": True}, profile) is None


def test_a_slow_workers_seconds_count_at_a_healthy_workers_pace() -> None:
    base = (LayerProfile("l", 1.0, 1.0, 0, 0, 0, 0),)
    healthy = {0: LayerProfile("l", 0.1, 0.2, 0, 0, 0, 0, update_seconds=0.05)}
    slow = {0: LayerProfile("l", 0.2, 0.4, 8, 0, 0, 0, update_seconds=0.1)}
    (mean,) = measured_layers(base, [healthy, slow], [1.0, 0.5])
    assert (mean.forward_seconds, mean.backward_seconds) == pytest.approx((0.1, 0.2))
    assert mean.update_seconds == pytest.approx(0.05) and mean.param_bytes == 4
    (plain,) = measured_layers(base, [healthy, slow])
    assert plain.forward_seconds == pytest.approx(0.15)


SPEC = load_default_spec()


def send(j: Job, worker: str, layers: list[dict[str, object]], now: float) -> None:
    """What the `profile` handler does with a training report."""
    data = {"layers": layers, "source": "training", "generation": 1}
    profile = parse_profile(data, len(SPEC.layers))
    j.worker(worker).profile = profile
    j.spec_changed()
    j.observe_profile(worker, data, profile, now)


def test_the_job_spec_carries_the_slow_speed_and_healthy_layer_figures() -> None:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    j.plan = initial_plan(j.spec)
    stages = {st.worker: st.layers for p in j.plan.pipelines for st in p.stages}
    mine = {w: [{**asdict(SPEC.layers[i]), "index": i} for i in layers]
            for w, layers in stages.items()}  # fmt: skip
    halved = [{**x, "forward_seconds": 2 * x["forward_seconds"],
               "backward_seconds": 2 * x["backward_seconds"]} for x in mine["w0"]]  # fmt: skip
    for t in range(MIN_SAMPLES + int(HOLD_SECONDS) + 1):
        for w in stages:
            send(j, w, halved if w == "w0" else mine[w], float(t))
    assert j.slow_due["w0"].slow and set(j.slow_due) == {"w0"}
    assert j.spec.worker("w0").speed == pytest.approx(0.5)
    assert j.spec.worker("w1").speed == 1.0
    # The planner's layer figures are the healthy ones: w0's doubled seconds count halved.
    for i in stages["w0"]:
        assert j.spec.layers[i].forward_seconds == pytest.approx(SPEC.layers[i].forward_seconds)
    # The state and the episodes survive a restart; a slow worker's fault drops it.
    again = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    restore(again, json.loads(json.dumps(snapshot(j))), j.plan, ready_timeout=30.0)
    assert again.slowness.speeds() == j.slowness.speeds()
    assert again.spec.worker("w0").speed == pytest.approx(0.5)
    j.count_fault("w0", 20.0)
    assert j.spec.worker("w0").speed == 1.0 and "w0" not in j.slow_due


def test_episodes_are_persisted() -> None:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    j.slowness.episodes = [(10.0, 40.0)]
    again = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    restore(again, json.loads(json.dumps(snapshot(j))), None, ready_timeout=30.0)
    assert again.slowness.expected_seconds() == 40.0
    assert replace(again.slowness, detected=0) == replace(j.slowness, detected=0)
