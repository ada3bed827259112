"""Redis that fails over: a job trained through `redis+sentinel://` by chameleond and four real
workers (gloo, CPU), with a real master, a real replica and three real sentinels. The master is
killed with SIGKILL mid-training and a worker with kill -9 half a second later, before the
sentinels have even found the master down.

Training must go on on the promoted replica: the dead worker's fault is not lost (a plan without
it is published and trained on), no worker applies a plan generation twice, no step is committed
twice (no sample trained twice), and nothing the job's stream held before the failover is missing
after it, but for the entries of the master's last moment (not a fault: those wait for the
replica) that asynchronous replication may lose."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chameleond.bench.failover import (
    FailoverRun,
    duplicate_applications,
    lost_events,
    run_failover,
)
from chameleond.core.plan import plan_from_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_training_goes_on_through_a_sentinel_failover(tmp_path: Path) -> None:
    run = run_failover(tmp_path, kill_worker=True)
    assert run.promoted, "the sentinels never promoted the replica"
    faults = [f for _, f in run.seen if f.get("type") == "fault"]
    assert faults and {f["worker"] for f in faults} == {run.victim}, faults
    # The fault was answered: a plan without the dead worker, trained on.
    after = [g for g, _ in run.commits if g in run.plans and run.victim not in _members(run, g)]
    assert after, f"no step committed on a plan without {run.victim}"
    # Nothing written with WAIT (the fault) and nothing older than the master's last moment is
    # missing on the promoted replica; an entry of that moment may be (asynchronous replication).
    assert lost_events(run) == []
    assert duplicate_applications(run) == 0, run.ready
    # No sample trained twice: every committed step is a new one, and no worker trained a step
    # again (the steps the dead worker took with it are not committed, and never re-done). A
    # report is delivered at least once: one whose XADD the old master took but never answered
    # is sent again to the new one, the same report (its step, generation and time), which the
    # daemon counts once.
    steps = [s for _, s in run.commits]
    assert steps == sorted(set(steps)) and steps[:10] == list(range(10)), steps
    reported = [f for _, f in run.seen if f.get("type") == "step"]
    for w in {f["worker"] for f in reported}:
        reports = {(int(f["step"]), f["generation"], f.get("at")) for f in reported
                   if f["worker"] == w}  # fmt: skip
        mine = sorted(step for step, _, _ in reports)
        assert mine == sorted(set(mine)), f"{w} trained a step twice: {sorted(reports)}"
    assert run.resumed_at - run.killed_at < 30
    assert _left_running(tmp_path) == []
    print(f"\nresumed {run.resumed_at - run.killed_at:.2f} s after the master's kill; "
          f"{len(run.commits)} steps, generations {sorted(run.plans)}")  # fmt: skip


def _members(run: FailoverRun, generation: int) -> set[str]:
    return set(plan_from_dict(run.plans[generation]).workers)


def _left_running(where: Path) -> list[str]:
    """Processes whose command line names `where` (the run's redis-servers, sentinels, daemon and
    workers all do)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(where) in Path(f"/proc/{pid}/cmdline").read_text():
                out.append(pid)
        except OSError:
            continue
    return out
