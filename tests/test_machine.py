"""The policy state machine: pure, so every path is driven directly with plain data."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.core.machine import DecisionResult, Phase, PolicyMachine

WORKERS = ("w0", "w1", "w2", "w3", "w4", "w5")


def training(ready_timeout: float = 30.0) -> PolicyMachine:
    m = PolicyMachine(ready_timeout_seconds=ready_timeout)
    m.initial(1, WORKERS, now=0.0)
    for w in WORKERS:
        m.ready(w, 1, now=1.0)
    assert m.phase is Phase.TRAINING
    return m


def survivors(failed: frozenset[str]) -> tuple[str, ...]:
    return tuple(w for w in WORKERS if w not in failed)


def test_initial_plan_then_every_ready_ack_means_training() -> None:
    m = PolicyMachine()
    transitions = m.initial(1, WORKERS, now=0.0)
    assert [(t.source, t.target) for t in transitions] == [(Phase.WAITING, Phase.TRANSITIONING)]
    for w in WORKERS[:-1]:
        assert m.ready(w, 1, now=1.0) == (True, [])
    assert m.ready("w0", 1, now=1.0) == (False, [])  # repeated ack
    assert m.ready(WORKERS[-1], 0, now=1.0) == (False, [])  # stale generation
    ok, transitions = m.ready(WORKERS[-1], 1, now=1.0)
    assert ok and transitions[0].target is Phase.TRAINING and transitions[0].generation == 1


def test_fault_to_plan_records_every_transition_with_generation_and_cause() -> None:
    m = training()
    new, t1 = m.fault("w3", "ECC error", now=10.0)
    assert new and [t.target for t in t1] == [Phase.FAULT_DETECTED]
    assert t1[0].cause == "w3: ECC error" and t1[0].generation == 1
    request, t2 = m.next_request(now=10.1)
    assert request is not None and request.failed == {"w3"} and request.generation == 2
    assert [t.target for t in t2] == [Phase.PLANNING]
    commit, t3 = m.decided(request, DecisionResult(2, "reroute", survivors(request.failed)), 10.2)
    assert commit and [t.target for t in t3] == [Phase.TRANSITIONING]
    assert t3[0].generation == 2 and "reroute" in t3[0].cause
    assert m.failed == {"w3"} and m.awaiting_ready == set(survivors(request.failed))


def test_duplicate_faults_are_recognised_pending_in_flight_and_committed() -> None:
    m = training()
    assert m.fault("w3", "x", 1.0)[0]
    assert not m.fault("w3", "again", 1.1)[0]  # pending
    request, _ = m.next_request(1.2)
    assert request is not None
    assert not m.fault("w3", "again", 1.3)[0]  # in flight
    m.decided(request, DecisionResult(2, "reroute", survivors(request.failed)), 1.4)
    assert not m.fault("w3", "again", 1.5)[0]  # excluded by the committed plan
    assert m.next_request(1.6) == (None, [])


def test_faults_during_a_decision_supersede_it_and_fold_into_one_next_decision() -> None:
    m = training()
    m.fault("w1", "a", 1.0)
    first, _ = m.next_request(1.0)
    assert first is not None
    for w in ("w2", "w4"):
        m.fault(w, "b", 1.1)
    assert m.next_request(1.2) == (None, [])  # one decision at a time
    commit, transitions = m.decided(first, DecisionResult(2, "dynamic", survivors(first.failed)), 2)
    assert not commit and transitions[0].target is Phase.FAULT_DETECTED
    assert m.generation == 1  # nothing published
    second, _ = m.next_request(2.1)
    assert second is not None
    assert second.failed == {"w1", "w2", "w4"} and second.generation == 2
    assert second.first_event_at == 1.0  # the oldest folded fault's time is kept
    commit, _ = m.decided(second, DecisionResult(2, "dynamic", survivors(second.failed)), 2.2)
    assert commit and m.generation == 2


def test_fault_of_a_worker_outside_the_plan_needs_no_decision() -> None:
    m = training()
    m.fault("w1", "a", 1.0)
    request, _ = m.next_request(1.0)
    assert request is not None
    m.decided(request, DecisionResult(2, "dynamic", ("w0", "w2", "w3", "w4")), 2.0)  # w5 idle
    new, transitions = m.fault("w5", "gone", 3.0)
    assert new and transitions == [] and "w5" in m.failed
    assert m.next_request(3.1) == (None, [])


def test_unrecoverable_and_rejoin() -> None:
    m = training()
    m.fault("w1", "a", 1.0)
    request, _ = m.next_request(1.0)
    assert request is not None
    commit, transitions = m.decided(request, DecisionResult(None, None, (), "layers 3-5 lost"), 2)
    assert commit and m.phase is Phase.UNRECOVERABLE and transitions[0].cause == "layers 3-5 lost"
    new, _ = m.join("w1", 5.0)
    assert new and "w1" not in m.failed
    request, _ = m.next_request(5.1)
    assert request is not None and request.joined == {"w1"} and not request.faults
    commit, _ = m.decided(request, DecisionResult(2, "dynamic", WORKERS), 6.0)
    assert commit and m.phase is Phase.TRANSITIONING and m.recovery is None


def test_join_waits_for_the_transition_to_finish() -> None:
    m = PolicyMachine()
    m.initial(1, WORKERS[:4], now=0.0)
    assert m.join("w5", 1.0)[0]
    assert m.next_request(1.1) == (None, [])  # transitioning: not now
    for w in WORKERS[:4]:
        m.ready(w, 1, 2.0)
    request, _ = m.next_request(2.1)
    assert request is not None and request.joined == {"w5"}
    commit, transitions = m.decided(request, DecisionResult(None, None), 2.2)
    assert commit and m.phase is Phase.TRAINING and transitions[0].cause == "current plan kept"


def test_a_worker_kept_out_stays_on_standby_and_is_offered_to_the_next_decisions() -> None:
    m = PolicyMachine()
    m.initial(1, WORKERS[:4], now=0.0)
    for w in WORKERS[:4]:
        m.ready(w, 1, 1.0)
    m.join("w4", 2.0)
    request, _ = m.next_request(2.1)
    assert request is not None and request.joined == {"w4"}
    m.decided(request, DecisionResult(None, None), 2.2)  # the current plan was kept
    assert m.standby == {"w4"} and m.next_request(2.3) == (None, [])  # standby alone: no decision
    restored = PolicyMachine.restore(m.snapshot(), ready_timeout_seconds=30.0)
    assert restored.standby == {"w4"}  # a restarted daemon still knows its spares
    # A fault's decision may use w4, though w4 sent nothing new; its cause names the fault only.
    m.fault("w1", "ECC", 3.0)
    request, _ = m.next_request(3.1)
    assert request is not None and request.joined == {"w4"} and request.cause == "w1: ECC"
    # A later rejoin is offered together with w4; a plan that takes w5 only leaves w4 on standby.
    m.decided(request, DecisionResult(2, "reroute", ("w0", "w2", "w3")), 3.2)
    for w in ("w0", "w2", "w3"):
        m.ready(w, 2, 3.5)
    m.join("w5", 4.0)
    request, _ = m.next_request(4.1)
    assert request is not None and request.joined == {"w4", "w5"}
    m.decided(request, DecisionResult(3, "dynamic", ("w0", "w2", "w3", "w5")), 4.2)
    assert m.standby == {"w4"}
    # A worker on standby that fails is no longer offered, and needs no new plan.
    for w in ("w0", "w2", "w3", "w5"):
        m.ready(w, 3, 4.5)
    assert m.fault("w4", "heartbeat lapse", 5.0) == (True, [])
    assert m.standby == set() and "w4" in m.failed and m.next_request(5.1) == (None, [])


def test_a_host_back_one_worker_at_a_time_has_both_on_standby_when_the_plan_is_kept() -> None:
    """w4 and w5 (one host) failed; they come back, w5 while w4's decision runs; both decisions
    keep the plan: both are on standby, neither is failed, and a fault's decision offers both."""
    m = training()
    m.fault("w4", "gone", 2.0)
    m.fault("w5", "gone", 2.0)
    request, _ = m.next_request(2.1)
    assert request is not None
    m.decided(request, DecisionResult(2, "dynamic", survivors(request.failed)), 2.2)
    for w in WORKERS[:4]:
        m.ready(w, 2, 2.5)
    m.join("w4", 3.0)
    request, _ = m.next_request(3.1)
    assert request is not None and request.joined == {"w4"}
    m.join("w5", 3.2)  # while w4's decision runs
    m.decided(request, DecisionResult(None, None), 3.3)  # the current plan was kept
    assert "w5" not in m.failed and "w5" in m.pending_joins
    request, _ = m.next_request(3.4)
    assert request is not None and request.joined == {"w4", "w5"}
    assert not request.failed & request.joined
    m.decided(request, DecisionResult(None, None), 3.5)
    assert m.standby == {"w4", "w5"} and not m.failed & {"w4", "w5"}
    m.fault("w0", "ECC", 4.0)
    request, _ = m.next_request(4.1)
    assert request is not None and request.joined == {"w4", "w5"}


def test_overdue_acks_and_recovery_time() -> None:
    m = training(ready_timeout=5.0)
    m.fault("w3", "x", 100.0)
    request, _ = m.next_request(100.0)
    assert request is not None
    workers = survivors(request.failed)
    m.decided(request, DecisionResult(2, "reroute", workers), 100.5)
    assert m.overdue(104.0) == ()
    # Past the deadline with nobody acknowledged: nothing tells the workers apart.
    assert m.overdue(106.0) == ()
    m.ready("w0", 2, 101.0)
    assert m.overdue(104.0) == ()
    assert m.overdue(106.0) == ("w1", "w2", "w4", "w5")
    recovery = None
    for w in workers:
        recovery, _ = m.step(w, 2, 107.0)
    assert recovery is not None and recovery.policy == "reroute"
    assert recovery.seconds == pytest.approx(7.0) and recovery.generation == 2
    assert m.phase is Phase.TRAINING  # a step proves the plan was taken up


def test_snapshot_restores_the_committed_state_only() -> None:
    m = training()
    m.fault("w3", "x", 1.0)
    request, _ = m.next_request(1.0)
    assert request is not None
    m.decided(request, DecisionResult(2, "reroute", survivors(request.failed)), 2.0)
    m.fault("w4", "y", 3.0)  # pending: its stream entry is unacknowledged, so it is not persisted
    restored = PolicyMachine.restore(m.snapshot(), ready_timeout_seconds=30.0)
    assert restored.generation == 2 and restored.failed == {"w3"}
    assert restored.phase is Phase.TRANSITIONING and restored.pending_faults == {}
    assert restored.recovery is not None and restored.recovery.policy == "reroute"


def test_running_means_every_worker_acknowledged_and_committed_a_step() -> None:
    m = training()
    assert not m.running()  # acknowledged, but no step committed yet
    for w in WORKERS[:-1]:
        m.step(w, 1, 2.0)
    m.step(WORKERS[-1], 0, 2.0)  # a stale generation's step proves nothing
    assert not m.running() and m.awaiting_step == {WORKERS[-1]}
    restored = PolicyMachine.restore(m.snapshot(), ready_timeout_seconds=30.0)
    assert restored.awaiting_step == {WORKERS[-1]}  # persisted: gates the follow-up switch
    m.step(WORKERS[-1], 1, 2.1)
    assert m.running()
    m.fault("w2", "x", 3.0)
    assert not m.running()  # a fault waits for a decision


def test_no_initial_plan_is_a_recorded_transition_and_answers_the_faults() -> None:
    m = PolicyMachine()
    assert m.fault("w1", "before any plan", 1.0)[0] and m.pending_faults
    transitions = m.unrecoverable("no initial plan: pipeline 0 does not fit", 2.0)
    assert [(t.source, t.target, t.generation) for t in transitions] == [
        (Phase.WAITING, Phase.UNRECOVERABLE, 0)
    ]
    assert transitions[0].cause.startswith("no initial plan")
    assert m.failed == {"w1"} and not m.pending_faults
    # Without any plan there is nothing to decide from: joins and faults start no decision.
    assert m.join("w1", 3.0) == (False, [])
    assert m.fault("w2", "x", 3.0) == (True, []) and "w2" in m.failed
    assert m.next_request(3.1) == (None, [])
    assert PolicyMachine.restore(m.snapshot(), ready_timeout_seconds=30.0).phase is (
        Phase.UNRECOVERABLE
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fault", "join", "decide", "keep", "ready"]),
                          st.sampled_from(WORKERS)), max_size=40))  # fmt: skip
def test_generations_only_increase_whatever_the_interleaving(ops: list[tuple[str, str]]) -> None:
    """Generations only increase, and a worker is never both failed and back (joining or on
    standby), whatever the order of faults, joins and decisions."""
    m = training()
    now, published = 2.0, [1]
    request = None
    for op, worker in ops:
        now += 0.1
        if op == "fault":
            m.fault(worker, "x", now)
        elif op == "join":
            m.join(worker, now)
        elif op == "ready":
            m.ready(worker, m.generation, now)
        if request is None:
            request, _ = m.next_request(now)
        elif op in ("decide", "keep"):
            gen = m.generation + 1
            workers = tuple(sorted(set(survivors(request.failed)) | request.joined))
            result = DecisionResult(gen, "reroute", workers) if op == "decide" else (
                DecisionResult(None, None)
            )  # fmt: skip
            commit, _ = m.decided(request, result, now)
            if commit and op == "decide":
                published.append(gen)
            request = None
        assert not m.failed & (m.pending_joins | m.standby), (op, worker)
    assert published == sorted(set(published))
    assert m.generation == published[-1]


def restoring(m: PolicyMachine) -> None:
    """w3 failed and generation 2, a restore plan, is published (its recovery is under way)."""
    m.fault("w3", "ECC error", now=10.0)
    request, _ = m.next_request(now=10.1)
    assert request is not None
    m.decided(request, DecisionResult(2, "restore", survivors(request.failed)), 10.2)


def test_a_restore_a_worker_cannot_load_is_decided_again_and_its_recovery_goes_on() -> None:
    m = training()
    restoring(m)
    new, transitions = m.unrestorable("w1", "no file of step 9", now=11.0)
    assert new and [t.target for t in transitions] == [Phase.FAULT_DETECTED]
    assert not m.unrestorable("w2", "no file of step 9", now=11.1)[0]  # the same redo answers it
    assert not m.running()
    request, _ = m.next_request(now=11.2)
    assert request is not None and request.generation == 3
    assert request.unrestorable == {"w1": "no file of step 9"} and not request.faults
    assert request.failed == {"w3"} and "w1 cannot restore" in request.cause
    assert request.first_event_at == 11.0
    assert not m.unrestorable("w1", "again", now=11.3)[0]  # in flight
    workers = survivors(request.failed)
    commit, _ = m.decided(request, DecisionResult(3, "restore", workers), 11.4)
    assert commit and m.generation == 3 and m.phase is Phase.TRANSITIONING
    for w in workers[:-1]:
        assert m.step(w, 3, now=12.0)[0] is None
    recovery, _ = m.step(workers[-1], 3, now=12.0)
    # Measured from the fault the failed restore answered, not from the report.
    assert recovery is not None and recovery.generation == 3 and recovery.seconds == 2.0


def test_a_failed_restore_reported_while_a_decision_runs_supersedes_it() -> None:
    m = training()
    restoring(m)
    m.fault("w4", "link down", now=11.0)
    request, _ = m.next_request(now=11.1)
    assert request is not None
    assert m.unrestorable("w1", "no file of step 9", now=11.2)[0]
    workers = survivors(request.failed)
    commit, _ = m.decided(request, DecisionResult(3, "restore", workers), 11.3)
    assert not commit and m.generation == 2  # it counted loads that are void
    again, _ = m.next_request(now=11.4)
    assert again is not None and again.generation == 3
    assert set(again.faults) == {"w4"} and set(again.unrestorable) == {"w1"}


def test_a_worker_outside_the_plan_cannot_fail_its_restore() -> None:
    m = training()
    restoring(m)
    assert m.unrestorable("w3", "no file", now=11.0) == (False, [])  # failed, fenced
    assert m.phase is Phase.TRANSITIONING


def test_a_job_whose_plan_workers_all_finished_is_finished_until_one_trains_again() -> None:
    m = training()
    transitions = m.finish(now=5.0)
    assert [(t.source, t.target) for t in transitions] == [(Phase.TRAINING, Phase.FINISHED)]
    assert "finished its steps" in transitions[0].cause and transitions[0].generation == 1
    assert m.finish(now=5.1) == []  # once
    restored = PolicyMachine.restore(m.snapshot(), ready_timeout_seconds=30.0)
    assert restored.phase is Phase.FINISHED  # a restarted daemon still shows it finished
    request, _ = m.next_request(now=6.0)
    assert request is None  # nothing to decide
    _, back = m.step("w0", 1, now=7.0)  # a step of the plan after all
    assert [t.target for t in back] == [Phase.TRAINING]


def test_a_job_with_a_fault_to_answer_is_not_finished() -> None:
    m = training()
    m.fault("w3", "ECC error", now=1.0)
    assert m.finish(now=2.0) == [] and m.phase is Phase.FAULT_DETECTED
    request, _ = m.next_request(now=2.1)
    assert request is not None and m.finish(now=2.2) == []  # a decision is running


def test_a_faults_raw_detail_goes_with_its_decision_and_survives_a_superseded_one() -> None:
    m = training()
    m.fault("w3", "connection closed (gloo)", now=1.0, detail="RuntimeError: [pair.cc:1] GLHF!")
    m.fault("w4", "ECC error", now=1.0)  # an operator's cause: nothing shortened, no detail
    request, _ = m.next_request(now=1.1)
    assert request is not None and request.cause == "w3: connection closed (gloo); w4: ECC error"
    assert request.details == {"w3": "RuntimeError: [pair.cc:1] GLHF!"}
    m.fault("w0", "x", now=1.2)  # the plan would use w0: superseded, folded into the next
    commit, _ = m.decided(request, DecisionResult(2, "reroute", ("w0", "w1", "w2", "w5")), 1.3)
    assert not commit
    again, _ = m.next_request(now=1.4)
    assert again is not None and again.details == {"w3": "RuntimeError: [pair.cc:1] GLHF!"}
