"""Profiles: the start-up measurement and the in-training meter (in process, no peers)."""

from __future__ import annotations

import time

import pytest
import torch
from worker_harness import builtin_model

from chameleond.jobstate.jobspec import parse_host_report, parse_profile
from chameleond.protocol import (
    PROFILE_EVERY_STEPS,
    PROFILES_PER_SECOND,
    profile_every_steps,
    profile_phase,
)
from chameleond.worker import _profile as profile
from chameleond.worker._model import Arch
from chameleond.worker._profile import TrainingMeter, profile_model

ARCH = Arch(d_model=16, heads=2, blocks=2, seq_len=8, vocab=256, seed=3, lr=1e-2)
MODEL = builtin_model(ARCH)
CPU = torch.device("cpu")


def test_startup_profile_measures_every_layer_and_the_host() -> None:
    data = profile_model(MODEL, 2, CPU, host="h0", workers_on_host=64)
    layers = parse_profile(data, ARCH.n_layers)
    assert len(layers) == ARCH.n_layers
    assert all(p.forward_seconds > 0 and p.backward_seconds > 0 for p in layers.values())
    assert all(p.update_seconds > 0 for p in layers.values())
    assert all(p.optimizer_bytes >= 2 * p.param_bytes for p in layers.values())
    assert layers[ARCH.n_layers - 1].output_bytes == 0
    host = parse_host_report(data)
    assert host is not None and host.host == "h0" and host.step_cpu_seconds is None
    # 64 workers compete for the cores: the job gets this process's share times 64.
    assert host.busy_cores > 0 and host.cores == profile.host_cores()


def test_meter_splits_ops_by_the_startup_shares_and_reports_per_micro_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(profile, "REPORT_STEPS", 2)
    monkeypatch.setattr(profile, "REPORT_SECONDS", 0.0)
    startup = [
        {"name": f"l{i}", "forward_seconds": f, "backward_seconds": 2 * f, "update_seconds": 1.0,
         "param_bytes": 4, "optimizer_bytes": 8, "activation_bytes": 0, "output_bytes": 4}
        for i, f in enumerate((1.0, 3.0, 5.0))
    ]  # fmt: skip
    meter = TrainingMeter(startup, CPU, micro_batch=2, host="h0", workers_on_host=1, generation=7)
    ticks = iter(float(t) for t in range(100))
    meter.clock = lambda: next(ticks)  # each call one "second" later
    for _ in range(2):  # two steps, each: 2 forwards, 2 backwards of layers 0-1, one update
        for forward in (True, True, False, False):
            meter.begin()
            meter.op(forward, range(2))
        meter.begin()
        meter.update((0, 1))
        data = meter.step_done()
    assert data is not None and data["steps"] == 2 and data["source"] == "training"
    assert data["generation"] == 7  # the plan it measured
    got = {d["index"]: d for d in data["layers"]}
    assert set(got) == {0, 1}  # layer 2 never ran here
    # Each op took 1 s, split 1:3 between the layers; per micro-batch.
    assert got[0]["forward_seconds"] == pytest.approx(0.25)
    assert got[1]["backward_seconds"] == pytest.approx(0.75)
    assert got[0]["update_seconds"] == pytest.approx(0.5)  # 1 s per step, split evenly
    assert data["host"]["busy_cores"] == profile.host_cores()  # one worker: no competition
    assert data["host"]["step_cpu_seconds"] >= 0
    assert meter.steps == 0  # a new window after each report


def _reported_steps(worker: str, members: int, steps: int, step_seconds: float) -> list[int]:
    """The steps at which a meter of `worker` in a plan of `members` reports, at steps of
    `step_seconds` on the wall clock."""
    startup = profile_model(MODEL, 2, CPU)["layers"]
    now = [0.0]
    meter = TrainingMeter(startup, CPU, 2, "", 1, 1, worker, members, wall_clock=lambda: now[0])
    reported = []
    for step in range(1, steps):
        meter.begin()
        sum(range(1000))  # some CPU time for the op
        meter.op(True, range(2))
        now[0] += step_seconds
        if meter.step_done() is not None:
            reported.append(step)
    return reported


def test_a_plans_second_report_waits_the_workers_phase_then_every_report_steps() -> None:
    """A job's workers commit steps together: each reports the first window of a plan after
    PROFILE_EVERY_STEPS steps, then the second at its own phase, so that from then on a fifth of
    them report at each step, not all at every fifth."""
    workers = [f"w{i}" for i in range(40)]
    phases = {w: profile_phase(w) for w in workers}
    assert set(phases.values()) == set(range(PROFILE_EVERY_STEPS))  # spread over every step
    for w in ("w0", "w1", "w2"):
        second = 2 * PROFILE_EVERY_STEPS + phases[w]
        later = range(second, 4 * PROFILE_EVERY_STEPS, PROFILE_EVERY_STEPS)
        assert _reported_steps(w, 40, 4 * PROFILE_EVERY_STEPS, 2.0) == [PROFILE_EVERY_STEPS, *later]


def test_a_large_jobs_members_profile_less_often_within_the_jobs_rate() -> None:
    """At 8,192 members and 2 s steps, every 5th step would be 819 profiles a second: after
    the plan's first window each member reports every 8th step (512 a second, spread by phase)."""
    every = profile_every_steps(8192, 2.0)
    assert every == 8 and 8192 / (every * 2.0) <= PROFILES_PER_SECOND
    assert profile_every_steps(1024, 2.0) == PROFILE_EVERY_STEPS  # a smaller job: unchanged
    phases = {profile_phase(f"w{i}", every) for i in range(200)}
    assert phases == set(range(every))
    for w in ("w0", "w1", "w2"):
        second = PROFILE_EVERY_STEPS + every + profile_phase(w, every)
        later = range(second, 60, every)
        assert _reported_steps(w, 8192, 60, 2.0) == [PROFILE_EVERY_STEPS, *later]


def test_meter_waits_for_enough_steps_and_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile, "REPORT_STEPS", 3)
    monkeypatch.setattr(profile, "REPORT_SECONDS", 0.05)
    startup = profile_model(MODEL, 2, CPU)["layers"]
    meter = TrainingMeter(startup, CPU, micro_batch=2, host="", workers_on_host=1)
    meter.begin()
    sum(range(100_000))  # some CPU time for the op
    meter.op(True, range(2))
    assert meter.step_done() is None and meter.step_done() is None
    time.sleep(0.06)
    data = meter.step_done()
    assert data is not None and "host" not in data  # no host name: no host report


def test_startup_profile_warms_up_then_times_after_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer runs once untimed (the process's one-time costs), then `start()` (the host's
    workers begin together), then every layer is timed."""
    calls: list[object] = []
    real = profile.profile_layer

    def spy(model, index, x, batch, device, repeats=3):  # type: ignore[no-untyped-def]
        calls.append(("layer", index, repeats))
        return real(model, index, x, batch, device, repeats)

    monkeypatch.setattr(profile, "profile_layer", spy)
    data = profile_model(MODEL, 2, CPU, start=lambda: calls.append("start"))
    n = ARCH.n_layers
    warm = [("layer", i, 0) for i in range(n)]
    timed = [("layer", i, profile.REPEATS) for i in range(n)]
    assert calls == [*warm, "start", *timed]
    assert all(layer["forward_seconds"] > 0 for layer in data["layers"])
