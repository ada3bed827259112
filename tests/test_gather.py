"""A fault decision gathers the faults of a host's workers: it waits, up to GATHER_SECONDS after
its first fault, for the faults naming the plan's other workers that the connection watch
announced gone, so one decision answers them all instead of each next fault superseding it."""

from __future__ import annotations

from chameleond.core.machine import PolicyMachine
from chameleond.daemon.connwatch import RECONNECT_SECONDS, Connections
from chameleond.daemon.decisions import GATHER_SECONDS, gathering

WORKERS = [f"w{i}" for i in range(8)]


def training() -> PolicyMachine:
    m = PolicyMachine()
    m.initial(1, WORKERS, now=0.0)
    for w in WORKERS:
        m.ready(w, 1, now=1.0)
    return m


def test_a_decision_waits_for_the_faults_of_the_workers_announced_gone_with_the_first() -> None:
    m = training()
    host = frozenset({"w6", "w7"})
    assert not gathering(m, host, 10.0)  # no fault yet: nothing to wait for
    m.fault("w6", "peer process gone", 10.0)
    assert gathering(m, host, 10.1)  # w7 was announced gone too: its fault is on its way
    assert not gathering(m, frozenset({"w6"}), 10.1)  # all named: decide now
    m.fault("w7", "peer process gone", 10.4)
    assert not gathering(m, host, 10.4)
    request, _ = m.next_request(10.4)
    assert request is not None and request.failed == host  # one decision for the host


def test_the_wait_is_bounded_and_counts_only_the_plans_live_members() -> None:
    m = training()
    m.fault("w6", "peer process gone", 10.0)
    # Nobody names w7 (its connection dropped, its peers trained on): the decision goes ahead.
    assert gathering(m, frozenset({"w6", "w7"}), 10.0 + GATHER_SECONDS - 0.01)
    assert not gathering(m, frozenset({"w6", "w7"}), 10.0 + GATHER_SECONDS)
    # A worker outside the plan, or already failed, is waited for by nobody.
    assert not gathering(m, frozenset({"w6", "spare"}), 10.1)
    request, _ = m.next_request(12.5)
    assert request is not None
    m.fault("w5", "peer process gone", 13.0)  # during the decision: folded, not gathered
    assert not gathering(m, frozenset({"w6", "w5", "w4"}), 13.1)


def test_recently_gone_names_the_workers_whose_process_went_and_did_not_come_back() -> None:
    c = Connections()
    a, b, x = ("w6", "inc-a"), ("w7", "inc-b"), ("w1", "x")
    c.update({a, b, x}, RECONNECT_SECONDS, now=100.0)
    c.update({x}, RECONNECT_SECONDS, now=100.5)
    c.update({x}, RECONNECT_SECONDS, now=101.0)  # missing from two listings: gone
    assert c.recently_gone(101.0, 10.0) == {"w6", "w7"}
    c.update({x, ("w7", "inc-c")}, RECONNECT_SECONDS, now=102.0)  # w7 restarted
    assert c.recently_gone(102.0, 10.0) == {"w6"}
    assert c.recently_gone(112.0, 10.0) == frozenset()  # no longer recent
