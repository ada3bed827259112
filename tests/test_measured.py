"""The planner's layer figures kept as running sums (chameleond/jobstate/measured.py): after any
sequence of profiles replacing each other, at any speeds, they are the mean over the newest
profiles that `measured_layers` makes from scratch; the planner takes them held still within
STEADY_TOLERANCE (so the search's tables stay filled); a restart keeps the figures (not every
worker's profile); each worker's speed among its peers."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, replace

import pytest
from job_harness import SPEC, job, send, training_job

from chameleond.core.search import tables_key
from chameleond.core.spec import LayerProfile
from chameleond.jobstate.jobspec import measured_layers
from chameleond.jobstate.measured import STEADY_TOLERANCE, MeasuredLayers, SteadyLayers
from chameleond.jobstate.slowness import own_speed
from chameleond.jobstate.snapshot import restore, snapshot

BASE = tuple(LayerProfile(f"l{i}", 1.0, 2.0, 100, 200, 300, 400, 0.5) for i in range(6))


def profile(rnd: random.Random) -> dict[int, LayerProfile]:
    layers = rnd.sample(range(len(BASE)), rnd.randint(1, len(BASE)))
    return {
        i: LayerProfile(
            f"l{i}",
            rnd.uniform(1e-4, 3.0),
            rnd.choice([1e-9, 0.1, 7.3]),
            rnd.randint(0, 2**40),
            rnd.randint(0, 10),
            rnd.randint(0, 10**6),
            3,
            rnd.uniform(0, 1),
        )
        for i in layers
    }


def test_running_sums_stay_the_mean_of_the_newest_profiles() -> None:
    rnd = random.Random(7)
    sums = MeasuredLayers()
    profiles: dict[str, dict[int, LayerProfile]] = {}
    speeds: dict[str, float] = {}
    for _ in range(3000):
        w = f"w{rnd.randrange(12)}"
        roll = rnd.random()
        if roll < 0.1:
            profiles.pop(w, None)  # a worker gone
        elif roll < 0.2:
            speeds[w] = rnd.choice([1.0, 0.5, 0.25])  # became slow, or recovered
        else:
            profiles[w] = profile(rnd)
        got = sums.layers(BASE, profiles, speeds)
        want = measured_layers(BASE, list(profiles.values()),
                               [speeds.get(w, 1.0) for w in profiles])  # fmt: skip
        for g, x in zip(got, want, strict=True):
            assert (g.name, g.param_bytes, g.optimizer_bytes, g.activation_bytes,
                    g.output_bytes) == (x.name, x.param_bytes, x.optimizer_bytes,
                                        x.activation_bytes, x.output_bytes)  # fmt: skip
            seconds = (g.forward_seconds, g.backward_seconds, g.update_seconds)
            assert seconds == pytest.approx(
                (x.forward_seconds, x.backward_seconds, x.update_seconds), rel=1e-12
            )
    # Nothing measured any more: the spec's own figures.
    assert sums.layers(BASE, {}, {}) == BASE


def test_each_workers_speed_is_the_median_of_its_peers_over_its_own() -> None:
    rnd = random.Random(3)
    for _ in range(500):
        group = {
            f"w{i}": rnd.choice([1.0, 2.0, rnd.uniform(0.1, 3)]) for i in range(rnd.randint(1, 9))
        }
        want = {w: statistics.median([c for p, c in group.items() if p != w]) / own
                for w, own in group.items() if len(group) > 1}  # fmt: skip
        assert {w: own_speed(group, w) for w in group if len(group) > 1} == want


def test_a_restart_keeps_the_measured_figures_until_a_worker_measures_the_layer_again() -> None:
    j = training_job()
    layers = [asdict(layer) for layer in SPEC.layers]
    for w, scale in (("w0", 2.0), ("w1", 4.0)):
        data = [{**d, "forward_seconds": d["forward_seconds"] * scale} for d in layers]
        send(j, type="profile", worker=w, data=json.dumps({"layers": data}))
    doc = json.loads(json.dumps(snapshot(j)))
    # The snapshot holds one figure per layer, not each worker's profile.
    assert len(doc["measured_layers"]) == len(SPEC.layers)
    assert all("profile" not in w for w in doc["workers"].values())
    again = job()
    restore(again, doc, j.plan, ready_timeout=30.0)
    assert again.spec.layers == j.spec.layers
    assert again.spec.layers[2].forward_seconds == pytest.approx(SPEC.layers[2].forward_seconds * 3)
    # A worker measuring layer 0 again: its figure is the new measurement, the others stay.
    one = {"layers": [{**layers[0], "index": 0, "forward_seconds": 1.0}]}
    send(again, type="profile", worker="w2", data=json.dumps(one))
    assert again.spec.layers[0].forward_seconds == 1.0
    assert again.spec.layers[2].forward_seconds == pytest.approx(SPEC.layers[2].forward_seconds * 3)


def test_the_planner_figures_hold_still_within_the_tolerance_and_follow_beyond_it() -> None:
    steady = SteadyLayers()
    first = steady.of(BASE)
    assert first is BASE
    tol = STEADY_TOLERANCE
    # Every seconds figure within the tolerance, bytes a little lower: the same figures, the same
    # tuple (the search's tables are found by it).
    near = tuple(
        replace(layer, forward_seconds=layer.forward_seconds * (1 + tol * 0.9),
                backward_seconds=layer.backward_seconds * (1 - tol * 0.9),
                update_seconds=layer.update_seconds * (1 + tol * 0.5),
                activation_bytes=int(layer.activation_bytes / (1 + tol * 0.5)))
        for layer in BASE
    )  # fmt: skip
    assert steady.of(near) is BASE
    # Small moves never add up: each is measured from the figure held, not the last mean.
    for k in range(1, 20):
        drifting = tuple(replace(x, forward_seconds=x.forward_seconds * (1 + tol * 0.05 * k))
                         for x in BASE)  # fmt: skip
        assert steady.of(drifting) is BASE
    # One layer's mean moved beyond: that layer takes the mean, the others stay the objects held.
    moved = list(BASE)
    moved[2] = replace(BASE[2], backward_seconds=BASE[2].backward_seconds * (1 + 2 * tol))
    got = steady.of(tuple(moved))
    assert got[2] == moved[2]
    assert all(got[i] is BASE[i] for i in range(len(BASE)) if i != 2)
    assert steady.of(tuple(moved)) is got
    # A layer's memory is never under-stated: any growth of its bytes is taken at once.
    grown = list(got)
    grown[4] = replace(got[4], activation_bytes=got[4].activation_bytes + 1)
    assert steady.of(tuple(grown))[4] == grown[4]
    # Another layer count (another model): the means as they are.
    shorter = BASE[:3]
    assert steady.of(shorter) is shorter


def test_profiles_that_barely_move_the_means_keep_the_search_tables_key() -> None:
    j = training_job()
    layers = [asdict(layer) for layer in SPEC.layers]

    def measure(worker: str, scale: float) -> None:
        data = [{**d, "forward_seconds": d["forward_seconds"] * scale} for d in layers]
        send(j, type="profile", worker=worker, data=json.dumps({"layers": data}))

    measure("w0", 2.0)
    key = tables_key(j.spec)
    assert j.spec.layers[0].forward_seconds == pytest.approx(SPEC.layers[0].forward_seconds * 2)
    for w, scale in (("w1", 2.0 * (1 + STEADY_TOLERANCE / 2)), ("w2", 2.0), ("w0", 2.001)):
        measure(w, scale)
        assert tables_key(j.spec) == key
    measure("w3", 3.0)  # the mean of 2, 2, 2 and 3 (x the spec's figure): moved by 12%
    assert tables_key(j.spec) != key
    want = SPEC.layers[0].forward_seconds * (2.001 + 2.0 * (1 + STEADY_TOLERANCE / 2) + 2 + 3) / 4
    assert j.spec.layers[0].forward_seconds == pytest.approx(want)
