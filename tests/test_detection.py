"""Honest detection against an in-memory job: a worker that stopped cleanly is finished or left,
never failed; a failed worker is fenced only when heard from after it was declared; registrations
from outside the spec wait for a profile, expire, are bounded, and are never planned before."""

from __future__ import annotations

import itertools
import json

import pytest
from job_harness import SPEC, job, send, training_job

from chameleond.core.machine import DecisionResult, Phase
from chameleond.jobstate.change import UNCHANGED
from chameleond.jobstate.jobspec import profile_to_json
from chameleond.jobstate.records import UNCONFIRMED_MAX
from chameleond.jobstate.snapshot import restore, snapshot
from chameleond.protocol import (
    HEARTBEAT_SECONDS,
    STEP_REPORTS_PER_SECOND,
    EventError,
    heartbeat_seconds,
    step_report_every,
    step_reported,
)

PROFILE = json.dumps({"layers": profile_to_json(dict(enumerate(SPEC.layers)))})


def test_a_worker_that_finished_is_finished_not_failed() -> None:
    j = training_job()
    out = send(j, type="ack", worker="w2", generation=1, phase="stopped", reason="finished")
    assert out.label == "handled" and not out.owed
    # Long silent afterwards: still finished, and nothing is pending about it.
    assert j.worker_state(j.workers["w2"], 1000.0, 3.0) == "finished"
    assert j.ended("w2") and not j.machine.pending_faults
    assert send(j, type="ack", worker="w2", generation=1, phase="stopped").duplicate
    # The state survives a restart of the daemon.
    again = job()
    restore(again, json.loads(json.dumps(snapshot(j))), None, ready_timeout=30.0)
    assert again.worker_state(again.workers["w2"], 1000.0, 3.0) == "finished"


def test_a_worker_that_left_is_taken_out_of_the_plans_without_a_fault_counted() -> None:
    j = training_job()
    out = send(j, "9-0", type="ack", worker="w4", generation=1, phase="stopped", reason="left")
    assert out.owed and "w4" in j.machine.pending_faults  # the next plan lets it go
    assert j.fault_times == []  # no failure for the failure rate
    assert j.worker_state(j.workers["w4"], 1000.0, 3.0) == "left"
    # A peer reporting it afterwards folds into the same decision.
    assert send(j, "10-0", type="fault", worker="w4", cause="peer gone").duplicate


def test_a_worker_stopped_while_a_newer_plan_was_out_still_leaves() -> None:
    """SIGTERM came while the worker was building generation 2; it says it left generation 1."""
    j = training_job()
    send(j, "5-0", now=10.0, type="fault", worker="w3", cause="peer gone")
    request, _ = j.machine.next_request(11.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 11.0)
    out = send(j, "9-0", type="ack", worker="w4", generation=1, phase="stopped", reason="left")
    assert out.owed and "w4" in j.machine.pending_faults
    assert j.worker_state(j.workers["w4"], 1000.0, 3.0) == "left"
    # An old process's word (from before the worker came back) says nothing of the new one.
    send(j, "10-0", now=12.0, type="rejoin", worker="w3")
    request, _ = j.machine.next_request(13.0)
    assert request is not None and "w3" in request.joined
    j.machine.decided(request, DecisionResult(3, "reroute", ("w0", "w1", "w2", "w3", "w5")), 13.0)
    stale = send(j, "11-0", type="ack", worker="w3", generation=1, phase="stopped", reason="left")
    assert not stale.owed and "w3" not in j.machine.pending_faults
    assert j.worker_state(j.workers["w3"], 13.5, 3.0) == "active"


def test_workers_that_finished_while_a_newer_plan_was_out_finished_the_job() -> None:
    """Their last step committed under generation 1 while the plan without w3 was on its way: they
    finished, and once every member of the newer plan has, so has the job."""
    j = training_job()
    send(j, "5-0", now=10.0, type="fault", worker="w3", cause="peer gone")
    request, _ = j.machine.next_request(11.0)
    assert request is not None
    survivors = ("w0", "w1", "w2", "w4", "w5")
    j.machine.decided(request, DecisionResult(2, "reroute", survivors), 11.0)
    for i, w in enumerate(survivors):
        assert j.machine.phase is not Phase.FINISHED
        out = send(j, f"{9 + i}-0", type="ack", worker=w, generation=1, phase="stopped",
                   reason="finished")  # fmt: skip
        assert out.label == "handled" and not out.owed
        assert j.worker_state(j.workers[w], 1000.0, 3.0) == "finished"
    assert j.machine.phase is Phase.FINISHED and not j.machine.pending_faults
    # They finished while the decision ran: the plan it makes finds them finished, and so does
    # the daemon, which asks once it is decided (daemon/decisions.py).
    k = training_job()
    send(k, "5-0", now=10.0, type="fault", worker="w3", cause="peer gone")
    request, _ = k.machine.next_request(11.0)
    assert request is not None
    for i, w in enumerate(survivors):
        send(k, f"{9 + i}-0", type="ack", worker=w, generation=1, phase="stopped",
             reason="finished")  # fmt: skip
    assert k.machine.phase is not Phase.FINISHED and not k.finish_if_done(12.0)  # deciding
    k.machine.decided(request, DecisionResult(2, "reroute", survivors), 12.0)
    assert [t.target for t in k.finish_if_done(12.0)] == [Phase.FINISHED]
    # A plain stop (fenced, no reason) of an older generation is not a finish.
    k = training_job()
    send(k, "5-0", now=10.0, type="fault", worker="w3", cause="peer gone")
    request, _ = k.machine.next_request(11.0)
    assert request is not None
    k.machine.decided(request, DecisionResult(2, "reroute", survivors), 11.0)
    send(k, "9-0", type="ack", worker="w0", generation=1, phase="stopped")
    assert k.workers["w0"].ended is None


def test_a_failed_worker_is_fenced_only_when_heard_from_after_it_was_declared() -> None:
    j = training_job()
    send(j, now=10.0, type="heartbeat", worker="w3")  # its last heartbeat before kill -9
    send(j, "5-0", now=10.5, type="fault", worker="w3", cause="peer gone")
    request, _ = j.machine.next_request(11.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 11.0)
    # Its heartbeat is 1 s old, within the timeout, but it came before the fault: dead.
    assert j.worker_state(j.workers["w3"], 11.0, 3.0) == "failed"
    send(j, now=12.0, type="heartbeat", worker="w3")  # heard from after: alive, fenced
    assert j.worker_state(j.workers["w3"], 12.5, 3.0) == "fenced"
    assert j.worker_state(j.workers["w3"], 20.0, 3.0) == "failed"  # then silent again


def test_a_registration_from_outside_the_spec_waits_for_its_profile() -> None:
    j = training_job()
    assert send(j, now=2.0, type="register", worker="x1", host="h", memory_bytes=2**31).label == (
        "handled"
    )
    assert not j.knows("x1") and "x1" in j.unconfirmed and not j.machine.pending_joins
    assert "x1" not in {w.id for w in j.spec.workers}  # the planner cannot place it
    joined = send(j, "20-0", now=3.0, type="profile", worker="x1", data=PROFILE)
    assert j.knows("x1") and "x1" in j.machine.pending_joins and joined.owed
    assert "x1" in {w.id for w in j.spec.workers}


def test_unconfirmed_registrations_expire_and_are_bounded() -> None:
    j = training_job(registration_ttl_seconds=5.0)
    for i in range(UNCONFIRMED_MAX):
        send(j, now=2.0, type="register", worker=f"p{i}", host="h", memory_bytes=2**31)
    with pytest.raises(EventError, match="registrations already wait"):
        send(j, now=3.0, type="register", worker="one-too-many", host="h", memory_bytes=1)
    assert len(j.unconfirmed) == UNCONFIRMED_MAX
    expired, change = j.expire_unconfirmed(8.0)
    assert len(expired) == UNCONFIRMED_MAX and not j.unconfirmed and change.snapshot
    assert j.expire_unconfirmed(8.0) == ([], UNCHANGED)  # nothing left to drop: nothing to save
    send(j, now=9.0, type="register", worker="late", host="h", memory_bytes=2**31)
    assert list(j.unconfirmed) == ["late"]
    assert j.waiting_registrations(14.0) == ["late"] and j.waiting_registrations(14.5) == []
    # Expired: a profile that comes afterwards is from nobody the job knows (the profile's own
    # handling drops what waited too long: nothing else writes the job).
    with pytest.raises(EventError, match="not a worker"):
        send(j, now=21.0, type="profile", worker="late", data=PROFILE)
    assert not j.machine.pending_joins and not j.extra_workers


def test_a_bad_profile_leaves_the_registration_waiting() -> None:
    j = training_job()
    send(j, now=2.0, type="register", worker="x1", host="h", memory_bytes=2**31)
    bad = json.dumps({"layers": [{"forward_seconds": 0.01, "index": 999}]})
    with pytest.raises((EventError, ValueError, KeyError, TypeError)):
        send(j, now=3.0, type="profile", worker="x1", data=bad)
    assert "x1" in j.unconfirmed and not j.knows("x1") and "x1" not in j.extra_workers


def test_liveness_names_a_killed_worker_dead_and_a_fenced_one_heartbeating() -> None:
    j = training_job()
    send(j, now=10.0, type="heartbeat", worker="w3")
    send(j, "5-0", now=10.5, type="fault", worker="w3", cause="peer gone")
    assert j.liveness(j.workers["w3"], 11.0, 3.0) == "dead"
    send(j, now=11.5, type="heartbeat", worker="w3")
    assert j.liveness(j.workers["w3"], 12.0, 3.0) == "heartbeating"
    assert j.liveness(j.workers["w0"], 12.0, 3.0) == "silent"  # nothing since 1.0
    send(j, type="ack", worker="w1", generation=1, phase="stopped", reason="finished")
    assert j.liveness(j.workers["w1"], 12.0, 3.0) == "stopped"


def test_a_large_jobs_members_report_every_few_steps_yet_every_step_and_every_period() -> None:
    """Beyond STEP_REPORTS_PER_SECOND a member reports one step in a few (its first of a plan and
    one with an evaluation always, in chameleond/worker/_loop.py): still every step by some
    member, about the budget in all, and each member once per heartbeat period."""
    assert step_report_every(7, 0.05) == step_report_every(1024, 2.0) == 1
    assert step_report_every(2048, 2.0) == 1 and step_report_every(8192, 8.0) == 1
    assert step_report_every(8192, 2.0) == 4 and step_report_every(8192, 1.0) == 8
    # A plan a host short (and one spare short) reports as sparsely: the period is whole seconds.
    assert step_report_every(8184, 2.0) == step_report_every(8191, 2.0) == 4
    assert heartbeat_seconds(8191) == heartbeat_seconds(8192) == 8.0
    members = [f"w{i}" for i in range(8192)]
    for seconds in (0.5, 1.0, 2.0, 3.0):
        steps = range(1, 49)
        reported = {s: {w for w in members if step_reported(w, s, 8192, seconds)} for s in steps}
        assert all(reported.values())
        per_second = sum(map(len, reported.values())) / len(steps) / seconds
        assert per_second <= 1.5 * STEP_REPORTS_PER_SECOND
        for w in members[:64]:
            mine = [s for s in steps if w in reported[s]]
            gaps = [b - a for a, b in itertools.pairwise(mine)]
            assert max(gaps) * seconds <= heartbeat_seconds(8192)


def test_a_large_jobs_workers_beat_less_often_and_its_heartbeat_timeout_grows_as_much() -> None:
    assert heartbeat_seconds(6) == heartbeat_seconds(1024) == HEARTBEAT_SECONDS
    assert heartbeat_seconds(1025) == heartbeat_seconds(2048) == 2 * HEARTBEAT_SECONDS
    assert heartbeat_seconds(8192) == 8 * HEARTBEAT_SECONDS
    j = training_job()
    assert j.heartbeat_timeout(3.0) == 3.0
    for i in range(8192 - len(j.workers)):
        j.worker(f"x{i}")
    assert j.heartbeat_timeout(3.0) == 24.0
