"""The communicator rebuild the planner prices: the spec's `rebuild_seconds` until the workers have
measured one, then per backend the slowest member's build of the newest generation's groups, from
their `ack` ready events (the fields chameleond/worker/_build.py sends), through the handlers."""

from __future__ import annotations

import pytest
from job_harness import SPEC, WORKERS, send, training_job

from chameleond.core.decide import decide, initial_plan
from chameleond.core.machine import DecisionResult, PolicyMachine
from chameleond.core.spec import parse_spec
from chameleond.daemon.config import Config
from chameleond.daemon.views import status
from chameleond.jobstate.job import Job
from chameleond.jobstate.jobspec import spec_document
from chameleond.jobstate.snapshot import restore, snapshot
from chameleond.protocol import EventError

SURVIVORS = ("w0", "w1", "w2", "w4", "w5")  # w3 lost


def ready(j: Job, worker: str, generation: int, build: float, migration: float = 0.0) -> None:
    """A worker's ready ack, as the worker sends it."""
    send(
        j, type="ack", worker=worker, generation=generation, phase="ready", attempt=1,
        build_seconds=f"{build:.4f}", world_seconds=f"{build - migration:.4f}",
        migration_seconds=f"{migration:.4f}", moves=0,
    )  # fmt: skip


def rerouted(j: Job) -> None:
    """w3 fails; the machine publishes generation 2 over the survivors."""
    send(j, type="fault", worker="w3", cause="ECC")
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", SURVIVORS), 3.0)


def test_ready_acks_replace_the_spec_prior_with_the_slowest_members_rebuild() -> None:
    j = training_job()  # generation 1 acknowledged without figures (an older worker)
    assert j.spec.rebuild_seconds == SPEC.rebuild_seconds == 0.5
    rerouted(j)
    # Each member's build less its migration; the slowest member's is the generation's.
    for w, build, migration in zip(
        SURVIVORS, (0.09, 0.31, 0.12, 0.2, 0.1), (0, 0.25, 0, 0, 0), strict=True
    ):
        ready(j, w, 2, build, migration)
    assert j.spec.rebuild_seconds == pytest.approx(0.2)
    assert j.rebuilds.newest == {"gloo": (2, pytest.approx(0.2))}
    # The planner prices it: a reroute's transition is the rebuild (nothing moves).
    current = initial_plan(j.spec)
    d = decide(j.spec, current, ["w3"], mtbf_seconds=1e6, generation=3, force="reroute")
    assert d.plan is not None
    assert d.plan.estimates.transition_seconds == pytest.approx(0.2)
    prior = decide(SPEC, current, ["w3"], mtbf_seconds=1e6, generation=3, force="reroute")
    assert prior.plan is not None and prior.plan.estimates.transition_seconds == 0.5
    # What the workers read back as the job's spec, and what status shows.
    assert parse_spec(spec_document(j.spec)).rebuild_seconds == pytest.approx(0.2)
    view = status(j, Config())
    assert view["rebuild_seconds"] == pytest.approx(0.2)
    assert view["rebuild_measured_seconds"] == {"gloo": pytest.approx(0.2)}


def test_a_newer_generation_replaces_the_figure_and_an_older_ones_ack_does_not() -> None:
    j = training_job()
    rerouted(j)
    ready(j, "w0", 2, 0.4)
    assert j.spec.rebuild_seconds == pytest.approx(0.4)
    send(j, type="fault", worker="w4", cause="ECC")
    request, _ = j.machine.next_request(4.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(3, "reroute", ("w0", "w1", "w2", "w5")), 5.0)
    ready(j, "w1", 3, 0.07)
    assert j.spec.rebuild_seconds == pytest.approx(0.07)  # the newest generation's
    ready(j, "w2", 2, 0.9)  # a late ack of generation 2
    ready(j, "w4", 3, 0.9)  # not a member of generation 3
    assert j.spec.rebuild_seconds == pytest.approx(0.07)
    # An ack built again (attempt 2) is the same generation: the slower build counts.
    send(
        j, type="ack", worker="w5", generation=3, phase="ready", attempt=2,
        build_seconds="0.15", migration_seconds="0",
    )  # fmt: skip
    assert j.spec.rebuild_seconds == pytest.approx(0.15)


def test_each_backend_has_its_own_figure_and_the_job_is_priced_at_the_one_it_runs() -> None:
    """The job's workers come back on GPUs (registered with cuda devices): they build NCCL groups,
    whose rebuild gloo's figure says nothing about. The spec's prior stands until NCCL's is
    measured."""
    j = training_job()
    for w in WORKERS:
        ready(j, w, 1, 0.01)
    assert j.rebuilds.newest == {"gloo": (1, pytest.approx(0.01))}
    assert j.spec.rebuild_seconds == pytest.approx(0.01)
    for i, w in enumerate(WORKERS):
        send(j, type="register", worker=w, host="localhost", memory_bytes=2**31, device=f"cuda:{i}")
    assert j.spec.rebuild_seconds == SPEC.rebuild_seconds  # the prior: nothing measured on NCCL
    rerouted(j)
    for w, build in zip(SURVIVORS, (0.61, 0.55, 0.98, 0.7, 0.58), strict=True):
        ready(j, w, 2, build)
    assert j.rebuilds.newest == {"gloo": (1, pytest.approx(0.01)), "nccl": (2, pytest.approx(0.98))}
    assert j.spec.rebuild_seconds == pytest.approx(0.98)


def test_the_measured_rebuild_survives_a_daemon_restart() -> None:
    j = training_job()
    rerouted(j)
    ready(j, "w0", 2, 0.12)
    again = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    restore(again, snapshot(j), j.plan, ready_timeout=30.0)
    assert again.spec.rebuild_seconds == pytest.approx(0.12)


def test_a_ready_ack_with_a_malformed_figure_is_rejected_with_a_reason() -> None:
    j = training_job()
    with pytest.raises(EventError, match="'build_seconds' must be a number, got 'soon'"):
        send(j, type="ack", worker="w0", generation=1, phase="ready", build_seconds="soon")
    with pytest.raises(EventError, match="'migration_seconds' must be a finite number"):
        send(j, type="ack", worker="w0", generation=1, phase="ready", migration_seconds="-1")
