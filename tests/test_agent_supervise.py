"""chameleon-agent's pure core: what a worker's exit means, the backoff before a restart, and which
deaths are reported as one host fault (chameleond/agent/supervise.py), with plain data."""

from __future__ import annotations

import pytest

from chameleond.agent.supervise import (
    Death,
    Report,
    Roster,
    State,
    backoff_seconds,
    consecutive_failures,
    describe_exit,
    due_reports,
    outcome,
)


@pytest.mark.parametrize(
    ("code", "state", "restart", "report"),
    [
        (0, State.DONE, False, False),  # finished or stopped
        (9, State.BACKOFF, True, False),  # fenced: started again, it rejoins
        (7, State.DEVICE_FAILED, False, False),  # its device failed; it reported itself
        (2, State.FAILED, False, False),
        (4, State.FAILED, False, False),
        (6, State.FAILED, False, False),
        (8, State.FAILED, False, False),
        (3, State.BACKOFF, True, True),  # Redis unreachable: a restart may cure it
        (5, State.BACKOFF, True, True),
        (1, State.BACKOFF, True, True),
        (-9, State.BACKOFF, True, True),  # killed by SIGKILL
        (-11, State.BACKOFF, True, True),
    ],
)
def test_exit_table(code: int, state: State, restart: bool, report: bool) -> None:
    out = outcome(code)
    assert (out.state, out.restart, out.report) == (state, restart, report)


def test_exits_are_described_for_the_fault_cause() -> None:
    assert describe_exit(-9) == "exited: killed by SIGKILL"
    assert describe_exit(-15) == "exited: killed by SIGTERM"
    assert describe_exit(3) == "exited with code 3"


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [backoff_seconds(n, 60.0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff_seconds(3, 2.5) == 2.5


def test_a_long_run_resets_the_failure_count() -> None:
    assert consecutive_failures(0, 1.0) == 1
    assert consecutive_failures(4, 59.9) == 5
    assert consecutive_failures(4, 60.0) == 1


def test_a_lone_death_is_reported_once_the_window_passed() -> None:
    held = [Death("w1", "exited: killed by SIGKILL", at=10.0)]
    assert due_reports(held, running=3, now=10.2, together_seconds=0.5, host="h") == (
        (),
        tuple(held),
    )
    reports, kept = due_reports(held, running=3, now=10.5, together_seconds=0.5, host="h")
    assert reports == (Report((held[0],)),) and kept == ()


def test_deaths_together_with_nobody_left_are_one_host_fault() -> None:
    held = [Death(w, "exited: killed by SIGKILL", 10.0 + i * 0.1, 4) for i, w in enumerate("ab")]
    reports, kept = due_reports(held, running=0, now=10.1, together_seconds=0.5, host="gpu7")
    cause = "host gpu7 lost its workers: 2 exited within 0.5 s"
    together = (Death("a", cause, 10.0, 4), Death("b", cause, 10.1, 4))
    assert reports == (Report(together, host_fault=True),) and kept == ()


def test_deaths_with_a_sibling_still_running_are_reported_one_by_one() -> None:
    held = [Death(w, "exited with code 3", at=10.0) for w in "ab"]
    assert due_reports(held, running=1, now=10.1, together_seconds=0.5, host="h") == ((), (*held,))
    reports, _ = due_reports(held, running=1, now=10.5, together_seconds=0.5, host="h")
    assert [r.host_fault for r in reports] == [False, False]


def test_deaths_further_apart_than_the_window_are_not_one_host_fault() -> None:
    held = [Death("a", "x", at=10.0), Death("b", "y", at=10.6)]
    reports, kept = due_reports(held, running=0, now=10.6, together_seconds=0.5, host="h")
    assert reports == (Report((held[0],)),) and kept == (held[1],)


def roster() -> Roster:
    r = Roster.of("h", [("w0", "cuda:0"), ("w1", "cuda:1")], backoff_max=60.0, together=0.5)
    assert r.due_starts(0.0) == ("w0", "w1")
    r.started("w0", 100, 0.0)
    r.started("w1", 101, 0.0)
    return r


def test_a_killed_worker_is_reported_then_restarted_after_its_backoff() -> None:
    r = roster()
    r.exited("w1", -9, now=5.0, generation=3)
    assert r.slots["w1"].state is State.BACKOFF and r.due_starts(6.0) == ()  # not reported yet
    assert r.reports(5.2) == ()
    assert r.reports(5.5) == (Report((Death("w1", "exited: killed by SIGKILL", 5.0, 3),)),)
    assert r.due_starts(5.9) == () and r.due_starts(6.0) == ("w1",)
    r.restarting("w1")
    r.started("w1", 102, 6.0)
    r.exited("w1", -9, now=7.0)  # again, quickly: twice the wait
    r.reports(7.5)
    assert r.due_starts(8.9) == () and r.due_starts(9.0) == ("w1",)
    assert r.status(1, 9.0)["restarts"] == 1
    assert r.status(1, 9.0)["workers"]["w1"] == {
        "pid": None, "state": "backoff", "restarts": 1, "last_exit": "exited: killed by SIGKILL",
    }  # fmt: skip


def test_device_failed_and_fenced_are_not_reported() -> None:
    r = roster()
    r.exited("w0", 7, now=1.0)
    r.exited("w1", 9, now=1.0)
    assert r.reports(5.0) == ()
    assert r.slots["w0"].state is State.DEVICE_FAILED and r.due_starts(100.0) == ("w1",)


def test_the_agent_exits_once_nothing_runs_or_waits() -> None:
    r = roster()
    r.exited("w0", 0, now=1.0)
    assert r.exit_code() is None
    r.exited("w1", 0, now=1.0)
    assert r.exit_code() == 0
    r = roster()
    r.exited("w0", 0, now=1.0)
    r.exited("w1", 7, now=1.0)
    assert r.exit_code() == 1
