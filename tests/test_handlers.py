"""The handlers registry and each handler against an in-memory job (handlers do no I/O)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from typing import get_args

import pytest
from job_harness import SPEC, WORKERS, job, send, training_job

from chameleond.core.decide import initial_plan
from chameleond.core.machine import DecisionResult
from chameleond.daemon.dispatch import HANDLERS
from chameleond.events import EVENT_CLASSES, Event
from chameleond.handlers.outcome import DUPLICATE, DUPLICATE_OWED, HANDLED, Outcome
from chameleond.jobstate.change import SNAPSHOT
from chameleond.jobstate.job import Job
from chameleond.jobstate.snapshot import restore, snapshot
from chameleond.protocol import EVENT_TYPES, EventError, parse_event


def test_one_handler_per_event_type() -> None:
    """The daemon's table names a handler for every event the protocol parses, and nothing else."""
    assert set(HANDLERS) == set(EVENT_CLASSES) == set(get_args(Event))
    assert sorted(c.type for c in EVENT_CLASSES) == sorted(EVENT_TYPES)


def test_registration_counts_towards_the_initial_plan() -> None:
    j = job()
    for w in WORKERS[:5]:
        assert send(j, type="register", worker=w, host="localhost", memory_bytes=2**31).label == (
            "handled"
        )
    assert not j.initial_due(0) and j.initial_due(5)
    send(j, type="register", worker="w5", host="localhost", memory_bytes=2**31)
    assert j.initial_due(0)
    assert send(j, type="register", worker="w5", host="localhost", memory_bytes=2**31).duplicate


def test_fault_is_owed_until_its_decision_and_duplicates_fold_into_it() -> None:
    j = training_job()
    first = send(j, "5-0", type="fault", worker="w3", cause="ECC")
    assert first.owed and first.label == "handled"
    again = send(j, "6-0", type="fault", worker="w3", cause="again")
    assert again.owed and again.duplicate
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 3.0)
    assert j.acks_for(request) == ["5-0", "6-0"]
    # Redelivered (or repeated) after the plan excluded w3: no second plan, acked at once.
    late = send(j, "5-0", type="fault", worker="w3", cause="ECC")
    assert late.duplicate and not late.owed
    assert j.machine.next_request(4.0) == (None, [])


def test_fault_naming_a_stranger_is_rejected_with_a_reason() -> None:
    with pytest.raises(EventError, match="not a worker of job"):
        send(training_job(), type="fault", worker="w99")


def test_profile_replaces_layers_with_the_mean_over_reporters() -> None:
    j = training_job()
    layers = [asdict(layer) for layer in SPEC.layers]
    for w, scale in (("w0", 2.0), ("w1", 4.0)):
        data = [{**d, "forward_seconds": d["forward_seconds"] * scale} for d in layers]
        assert send(j, type="profile", worker=w, data=json.dumps({"layers": data})).label == (
            "handled"
        )
    assert j.spec.layers[2].forward_seconds == pytest.approx(SPEC.layers[2].forward_seconds * 3)
    assert j.spec.layers[2].param_bytes == SPEC.layers[2].param_bytes
    partial = {"layers": [{**layers[0], "index": 0, "backward_seconds": 1.0}]}
    send(j, type="profile", worker="w2", data=json.dumps(partial))
    assert j.spec.layers[0].backward_seconds == pytest.approx(
        (SPEC.layers[0].backward_seconds * 2 + 1.0) / 3
    )
    with pytest.raises(EventError, match="must be a number"):
        bad = {"layers": [{**layers[0], "forward_seconds": "fast"}]}
        send(j, type="profile", worker="w0", data=json.dumps(bad))


def test_steps_measure_throughput_and_count_repeats_as_duplicates() -> None:
    j = training_job()
    for w, seconds in zip(WORKERS, (0.1, 0.2, 0.3, 0.1, 0.2, 0.4), strict=True):
        send(j, type="step", worker=w, generation=1, step=0, samples=12, seconds=seconds, loss=5)
    assert j.meter.samples_per_second == pytest.approx(12 / 0.4)
    late = send(j, type="step", worker="w0", generation=1, step=0, samples=12, seconds=1, loss=5)
    assert late.duplicate


def test_a_generation_built_again_is_counted_until_the_next_generation() -> None:
    j = training_job()
    assert j.attempt() == 1
    again = send(j, type="ack", worker="w0", generation=1, phase="ready", attempt=2)
    assert again.duplicate  # the generation was acknowledged already: no transition
    assert j.attempt() == 2
    send(j, type="ack", worker="w1", generation=1, phase="ready", attempt=3)
    send(j, type="ack", worker="w2", generation=1, phase="ready", attempt=2)  # late
    assert j.attempt() == 3
    send(j, type="fault", worker="w3", cause="ECC")
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 3.0)
    assert j.attempt() == 1  # a new generation starts at its first build
    send(j, type="ack", worker="w0", generation=1, phase="ready", attempt=9)  # the old one's
    assert j.attempt() == 1
    send(j, type="ack", worker="w0", generation=2, phase="ready", attempt=2)
    assert j.attempt() == 2


def test_ack_stopped_and_rejoin() -> None:
    j = training_job()
    send(j, "7-0", type="fault", worker="w3", cause="x")
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 3.0)
    assert send(j, type="ack", worker="w3", generation=2, phase="stopped").label == "handled"
    assert send(j, type="ack", worker="w3", generation=2, phase="stopped").duplicate
    assert j.worker_state(j.workers["w3"], 4.0, 3.0) == "stopped"
    joined = send(j, "8-0", type="rejoin", worker="w3")
    assert joined.owed and "w3" in j.machine.pending_joins
    with pytest.raises(EventError, match="never registered"):
        send(j, type="rejoin", worker="w42")


def test_a_prepared_follow_up_is_persisted_and_waits_for_a_step_from_every_worker() -> None:
    from chameleond.core.decide import decide, initial_plan
    from chameleond.jobstate.records import FollowUp

    j = training_job()
    plan = initial_plan(SPEC)
    prepared = decide(SPEC, plan, ["w1"], mtbf_seconds=1e6, generation=2, force="dynamic").plan
    assert prepared is not None
    j.follow_up = FollowUp(1, prepared, 12.5)
    snap = json.loads(json.dumps(snapshot(j)))
    k = job()
    restore(k, snap, plan, ready_timeout=30.0)
    assert k.follow_up == j.follow_up
    assert j.switch_due() is None  # acknowledged, no step yet
    for w in WORKERS:
        first = send(j, type="step", worker=w, generation=1, step=0, samples=12, seconds=0.1,
                     loss=5)  # fmt: skip
        assert first.change.snapshot  # the first steps are durable: they gate the switch
    later = send(j, type="step", worker="w0", generation=1, step=1, samples=12, seconds=0.1, loss=5)
    assert later.label == "handled" and not later.change  # soft state, saved with the progress
    assert j.switch_due() == j.follow_up
    assert not j.drop_stale_follow_up()
    # A later plan (another fault) makes the prepared plan stale: dropped, not switched to.
    send(j, "9-0", type="fault", worker="w3", cause="x")
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 3.0)
    assert j.switch_due() is None and j.follow_up is not None
    assert j.drop_stale_follow_up().snapshot and j.follow_up is None


def checkpoint(j: Job, worker: str, step: int, layers: str, generation: int = 1) -> Outcome:
    return send(
        j, type="checkpoint", worker=worker, step=step, layers=layers, generation=generation
    )


def test_checkpoints_count_once_their_files_cover_every_layer_and_survive_a_restart() -> None:
    j = training_job()
    n = len(j.spec.layers)
    half = ",".join(map(str, range(n // 2)))
    rest = ",".join(map(str, range(n // 2, n)))
    assert checkpoint(j, "w0", 9, half) == HANDLED.having(SNAPSHOT)
    assert j.checkpoints.newest(n) is None  # half the model is on storage: nothing to restore
    assert checkpoint(j, "w2", 9, half) == DUPLICATE  # nothing to save
    assert checkpoint(j, "w1", 9, rest) == HANDLED.having(SNAPSHOT)
    assert j.checkpoints.newest(n) == 9
    with pytest.raises(EventError, match="the job has layers"):
        checkpoint(j, "w1", 9, str(n))
    with pytest.raises(EventError, match="not a worker"):
        checkpoint(j, "w99", 9, half)
    again = job()
    restore(again, json.loads(json.dumps(snapshot(j))), None, ready_timeout=30.0)
    assert again.checkpoints.newest(n) == 9


def test_a_checkpoint_written_before_a_restore_of_an_earlier_step_is_stale() -> None:
    j = training_job()
    n = len(j.spec.layers)
    every = ",".join(map(str, range(n)))
    assert checkpoint(j, "w0", 9, every).label == "handled"
    j.machine.generation = 3  # the restore plan was published...
    j.checkpoints.restored(3, 9)  # ...and generation 3 trains again from step 9
    # Written under generation 2, reported late: its worker deletes the file in the restore.
    assert checkpoint(j, "w1", 14, every, generation=2) == DUPLICATE
    assert checkpoint(j, "w1", 4, every, generation=2).label == "handled"  # still on disk
    assert j.checkpoints.newest(n) == 9
    assert checkpoint(j, "w1", 14, every, generation=3).label == "handled"  # trained again
    assert j.checkpoints.newest(n) == 14
    again = job()
    restore(again, json.loads(json.dumps(snapshot(j))), None, ready_timeout=30.0)
    assert again.checkpoints == j.checkpoints


def restoring_job() -> Job:
    """Checkpoints of steps 4 and 9 cover every layer; w3 failed and generation 2 restores 9."""
    j = training_job()
    n = len(j.spec.layers)
    every = ",".join(map(str, range(n)))
    checkpoint(j, "w0", 4, every)
    checkpoint(j, "w0", 9, every)
    send(j, "5-0", type="fault", worker="w3", cause="x")
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    plan = replace(initial_plan(SPEC, 2, mtbf_seconds=3600.0), policy="restore", restore_step=9)
    j.machine.decided(request, DecisionResult(2, "restore", plan.workers), 3.0)
    j.acks_for(request)
    j.checkpoints.restored(2, 9)
    j.plan = plan
    return j


def unrestorable(j: Job, entry: str, worker: str, generation: int = 2, step: int = 9) -> Outcome:
    return send(j, entry, type="ack", worker=worker, generation=generation, phase="unrestorable",
                step=step, cause="no readable file")  # fmt: skip


def test_a_worker_that_cannot_load_the_restore_moves_it_to_an_older_checkpoint() -> None:
    j = restoring_job()
    n = len(j.spec.layers)
    assert unrestorable(j, "7-0", "w1", step=4) == DUPLICATE  # not this plan's step
    assert unrestorable(j, "7-1", "w1", generation=1) == DUPLICATE
    moved = unrestorable(j, "8-0", "w1")
    assert (moved.label, moved.owed) == ("handled", True)
    assert moved.change.snapshot and [r.to_fields()["to"] for r in moved.change.records] == [
        "fault_detected"
    ]
    assert j.checkpoints.newest(n) == 4
    assert unrestorable(j, "8-1", "w1") == DUPLICATE_OWED  # redelivered
    assert unrestorable(j, "8-2", "w2") == DUPLICATE  # the same redo answers it
    request, _ = j.machine.next_request(4.0)
    assert request is not None and set(request.unrestorable) == {"w1"}
    # The report is acknowledged only with the decision that answers it.
    assert j.acks_for(request) == ["8-0", "8-1"]
    # Files of step 9 reported late, from before the failed restore, are never offered again;
    # the step trained again and written anew is.
    every = ",".join(map(str, range(n)))
    assert checkpoint(j, "w1", 9, every, generation=1) == DUPLICATE
    again = job()
    restore(again, json.loads(json.dumps(snapshot(j))), None, ready_timeout=30.0)
    assert again.checkpoints == j.checkpoints
    j.machine.generation = 3
    assert checkpoint(j, "w1", 9, every, generation=3) == HANDLED.having(SNAPSHOT)
    assert j.checkpoints.newest(n) == 9


def test_an_unrestorable_ack_needs_its_step() -> None:
    with pytest.raises(EventError, match="'step'"):
        parse_event({"type": "ack", "worker": "w1", "generation": "2", "phase": "unrestorable"})


def test_a_fault_seen_before_the_worker_came_back_is_about_its_earlier_process() -> None:
    j = training_job()
    j.plan = j.adopt(initial_plan(SPEC, 1, mtbf_seconds=3600.0), set())
    assert send(j, "5-0", type="fault", worker="w3", cause="x", generation=1).owed
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 3.0)
    j.plan = j.adopt(replace(initial_plan(SPEC, 2, mtbf_seconds=3600.0), excluded=("w3",)), {"w3"})
    assert send(j, "6-0", type="rejoin", worker="w3").owed  # a new process of w3
    # Another peer's report of the first death, held in its outbox through an outage.
    late = send(j, "7-0", type="fault", worker="w3", cause="peer lost", generation=2)
    assert late.duplicate and not late.owed and "w3" in j.machine.pending_joins
    for w in ("w0", "w1", "w2", "w4", "w5"):
        send(j, type="ack", worker=w, generation=2, phase="ready")
    request, _ = j.machine.next_request(4.0)
    assert request is not None and request.joined == {"w3"}
    j.machine.decided(request, DecisionResult(3, "dynamic", WORKERS), 5.0)
    j.plan = j.adopt(initial_plan(SPEC, 3, mtbf_seconds=3600.0), set())
    again = job()
    restore(again, json.loads(json.dumps(snapshot(j))), j.plan, ready_timeout=30.0)
    for k in (j, again):
        assert send(k, "8-0", type="fault", worker="w3", generation=2).duplicate
        assert send(k, "9-0", type="fault", worker="w3", generation=3).label == "handled"
    # An operator's fault names no generation: always about the worker as it is now.
    assert send(job(), type="fault", worker="w3").label == "handled"
    with pytest.raises(EventError, match="'generation'"):
        send(j, type="fault", worker="w3", generation="x")


def test_a_return_feeds_the_window_and_survives_a_restart() -> None:
    """w3 is out from t=2 to t=1002: a 1,000 s repair (with two earlier ones of 1,000 s, enough
    to expect returns). When w4 has been out 900 s, the window is the time to the next fault or
    w4's return 100 s later, whichever first."""
    j = training_job()
    assert j.window(5.0) == j.mtbf(5.0)  # nobody out
    send(j, "7-0", type="fault", worker="w3", cause="x", now=2.0)
    assert j.workers["w3"].down_since == 2.0
    assert j.window(500.0) == j.mtbf(500.0)  # no repair seen yet: no return expected
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w4", "w5")), 3.0)
    j.repairs = [(-5000.0, 1000.0), (-3000.0, 1000.0)]
    send(j, "8-0", type="rejoin", worker="w3", now=1002.0)
    assert j.repairs[-1] == (2.0, 1000.0) and j.workers["w3"].down_since == 0.0
    send(j, "9-0", type="fault", worker="w4", cause="x", now=1100.0)
    d = j.mtbf(2000.0)
    assert j.window(2000.0) == pytest.approx(d * (1 - math.exp(-100.0 / d)))
    again = job()
    restore(again, json.loads(json.dumps(snapshot(j))), None, ready_timeout=30.0)
    assert again.repairs == j.repairs and again.workers["w4"].down_since == 1100.0
    assert again.window(2000.0) == j.window(2000.0)


def test_a_worker_out_before_a_running_decision_that_comes_back_joins_the_next() -> None:
    """w3 failed in generation 2; its host comes back while another worker's return is being
    decided: w3's registration is a join for the next decision, not folded into the running
    one (which lists w3 among the workers out) and lost."""
    j = training_job()
    send(j, "5-0", type="fault", worker="w3", cause="host lost")
    send(j, "5-1", type="fault", worker="w4", cause="host lost")
    request, _ = j.machine.next_request(2.0)
    assert request is not None
    j.machine.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w5")), 3.0)
    assert j.acks_for(request) == ["5-0", "5-1"]
    for w in ("w0", "w1", "w2", "w5"):
        send(j, type="ack", worker=w, generation=2, phase="ready")
    send(j, "6-0", type="register", worker="w4", host="localhost", memory_bytes=2**31)
    running, _ = j.machine.next_request(4.0)
    assert running is not None and running.joined == {"w4"} and "w3" in running.failed
    back = send(j, "7-0", type="register", worker="w3", host="localhost", memory_bytes=2**31)
    assert back.label == "handled" and "w3" in j.machine.pending_joins
    j.machine.decided(running, DecisionResult(3, "dynamic", ("w0", "w1", "w2", "w4", "w5")), 5.0)
    assert "7-0" not in j.acks_for(running)  # answered by the decision that takes w3 in
    for w in ("w0", "w1", "w2", "w4", "w5"):
        send(j, type="ack", worker=w, generation=3, phase="ready")
    after, _ = j.machine.next_request(6.0)
    assert after is not None and after.joined == {"w3"}
    assert j.acks_for(after) == ["7-0"]
