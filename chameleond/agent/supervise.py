"""What chameleon-agent decides about its host's workers, as plain data: no process, no Redis, no
clock (every function is given the time).

    exit code -> Outcome (done, restart, device failed, failed; reported as a fault or not)
    consecutive failures -> backoff before a restart (1 s doubling, capped; reset by a long run)
    deaths held up to `together_seconds` -> reports: one fault each, or the host's deaths as one

`Roster` holds the host's workers (state, pid, restarts, last exit) and turns what the I/O edge
observes (a start, an exit, the time) into what it must do (faults to write, workers to start).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from chameleond.exits import WorkerExit

# A worker that ran this long has its consecutive-failure count (its backoff) reset.
STEADY_SECONDS = 60.0
FIRST_BACKOFF_SECONDS = 1.0


class State(StrEnum):
    """A worker's state in the agent's status hash."""

    RUNNING = "running"
    BACKOFF = "backoff"  # exited; restarted once its fault is reported and its backoff is over
    DONE = "done"  # exited 0: finished or stopped
    DEVICE_FAILED = "device_failed"  # exited 7: its device failed; not restarted
    FAILED = "failed"  # exited 2, 4, 6 or 8: a restart cannot help


@dataclass(frozen=True)
class Outcome:
    """What the agent does about one exit."""

    state: State  # the worker's state after it
    restart: bool
    report: bool  # write a `fault` for it (a death the job has not heard of)
    meaning: str


DONE = Outcome(State.DONE, restart=False, report=False, meaning="finished or stopped")
FENCED = Outcome(State.BACKOFF, restart=True, report=False, meaning="fenced: restarted to rejoin")
DEVICE_FAILED = Outcome(
    State.DEVICE_FAILED, restart=False, report=False, meaning="its device failed"
)


def _failed(meaning: str) -> Outcome:
    return Outcome(State.FAILED, restart=False, report=False, meaning=meaning)


CRASHED = Outcome(State.BACKOFF, restart=True, report=True, meaning="died: restarted")

# The worker's exit codes (chameleond.exits, docs/worker.md) and what each means to its supervisor.
# A worker that reported itself (7) or was fenced (9) is known to the job already: no fault is
# written for it.
EXITS: dict[int, Outcome] = {
    WorkerExit.OK: DONE,
    WorkerExit.FENCED: FENCED,
    WorkerExit.DEVICE: DEVICE_FAILED,
    WorkerExit.USAGE: _failed("bad command line"),
    WorkerExit.SPEC: _failed("bad job spec"),
    WorkerExit.DATA: _failed("training data unusable"),
    WorkerExit.MODEL: _failed("malformed model"),
}


def outcome(returncode: int) -> Outcome:
    """What an exit means (`returncode` as subprocess gives it: -N for killed by signal N).
    Anything not in EXITS (3 Redis unreachable, 5 backend, a signal, other codes) is a death a
    restart may cure."""
    return EXITS.get(returncode, CRASHED)


def describe_exit(returncode: int) -> str:
    """'exited: killed by SIGKILL' or 'exited with code 3'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"exited: killed by {name}"
    return f"exited with code {returncode}"


def backoff_seconds(failures: int, most: float) -> float:
    """The wait before restarting a worker after its `failures`-th consecutive failure (>= 1):
    1 s, 2 s, 4 s, ... up to `most`."""
    return min(most, FIRST_BACKOFF_SECONDS * 2.0 ** max(0, failures - 1))


def consecutive_failures(previous: int, ran_seconds: float) -> int:
    """The count after one more failure: a run of STEADY_SECONDS or more starts it again at 1."""
    return 1 if ran_seconds >= STEADY_SECONDS else previous + 1


@dataclass(frozen=True)
class Death:
    """A reportable death, held until it is known whether the host's other workers follow."""

    worker: str
    cause: str  # describe_exit's text
    at: float
    generation: int | None = None  # the job's plan when the death was seen (None: no plan)


@dataclass(frozen=True)
class Report:
    """Faults written together, in one transaction."""

    faults: tuple[Death, ...]  # each with the cause to report
    host_fault: bool = False

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(d.worker for d in self.faults)


def host_cause(host: str, n: int, together_seconds: float) -> str:
    return f"host {host} lost its workers: {n} exited within {together_seconds:g} s"


def due_reports(
    held: Sequence[Death], running: int, now: float, together_seconds: float, host: str
) -> tuple[tuple[Report, ...], tuple[Death, ...]]:
    """The reports due now, and the deaths still held. Two or more deaths within
    `together_seconds` of each other, with no worker of the host left running, are one host
    fault (one report, every fault with the host's cause). Otherwise a death is reported on its
    own once it has been held `together_seconds` (its siblings did not follow)."""
    if len(held) >= 2 and running == 0 and held[-1].at - held[0].at <= together_seconds:
        cause = host_cause(host, len(held), together_seconds)
        return (Report(tuple(replace(d, cause=cause) for d in held), host_fault=True),), ()
    due = [d for d in held if now - d.at >= together_seconds]
    kept = tuple(d for d in held if now - d.at < together_seconds)
    return tuple(Report((d,)) for d in due), kept


@dataclass
class Slot:
    """One worker of the host, as the agent sees it."""

    worker: str
    device: str
    state: State = State.BACKOFF  # not started yet: due at once
    pid: int | None = None
    restarts: int = 0
    last_exit: str | None = None
    failures: int = 0  # consecutive: the backoff's exponent
    started_at: float = 0.0
    restart_at: float | None = 0.0  # when it may start (None: not until its fault is reported)

    def view(self) -> dict[str, Any]:
        return {
            "pid": self.pid, "state": self.state.value, "restarts": self.restarts,
            "last_exit": self.last_exit,
        }  # fmt: skip


@dataclass
class Roster:
    """The host's workers and the deaths held for reporting."""

    host: str
    slots: dict[str, Slot]
    backoff_max: float = 60.0
    together_seconds: float = 0.5
    held: list[Death] = field(default_factory=list)

    @classmethod
    def of(
        cls, host: str, slots: Sequence[tuple[str, str]], backoff_max: float, together: float
    ) -> Roster:
        """A roster of (worker, device) pairs, none started yet."""
        return cls(host, {w: Slot(w, d) for w, d in slots}, backoff_max, together)

    def running(self) -> int:
        return sum(s.state is State.RUNNING for s in self.slots.values())

    def pids(self) -> dict[str, int]:
        """worker -> pid of each running worker."""
        return {w: s.pid for w, s in self.slots.items() if s.state is State.RUNNING and s.pid}

    def started(self, worker: str, pid: int, now: float) -> None:
        s = self.slots[worker]
        s.state, s.pid, s.started_at, s.restart_at = State.RUNNING, pid, now, None

    def exited(
        self, worker: str, returncode: int, now: float, generation: int | None = None
    ) -> Outcome:
        """A worker's process ended (in the plan of `generation`): its new state; a death to
        report is held (due_reports)."""
        s = self.slots[worker]
        out = outcome(returncode)
        s.state, s.pid, s.last_exit = out.state, None, describe_exit(returncode)
        if not out.restart:
            s.restart_at = None
            return out
        s.failures = consecutive_failures(s.failures, now - s.started_at)
        if out.report:
            self.held.append(Death(worker, s.last_exit, now, generation))
            s.restart_at = None  # set once reported: its fault goes out before it restarts
        else:
            s.restart_at = now + backoff_seconds(s.failures, self.backoff_max)
        return out

    def reports(self, now: float) -> tuple[Report, ...]:
        """The faults to write now; their workers' restarts are scheduled from their deaths."""
        due, kept = due_reports(self.held, self.running(), now, self.together_seconds, self.host)
        self.held = list(kept)
        for report in due:
            for death in report.faults:
                s = self.slots[death.worker]
                s.restart_at = death.at + backoff_seconds(s.failures, self.backoff_max)
        return due

    def due_starts(self, now: float) -> tuple[str, ...]:
        """Workers to start (or restart) now."""
        return tuple(
            w
            for w, s in self.slots.items()
            if s.state is State.BACKOFF and s.restart_at is not None and s.restart_at <= now
        )

    def unstartable(self, worker: str, why: str) -> None:
        """Its command could not be started at all (not found, not executable): not retried."""
        s = self.slots[worker]
        s.state, s.pid, s.restart_at, s.last_exit = State.FAILED, None, None, why

    def restarting(self, worker: str) -> None:
        """Count a restart (every start after the first)."""
        s = self.slots[worker]
        if s.last_exit is not None:
            s.restarts += 1

    def exit_code(self) -> int | None:
        """The agent's own exit once nothing runs or waits to restart: 0 when every worker is
        done, 1 when some ended device_failed or failed; None while it supervises."""
        states = {s.state for s in self.slots.values()}
        if states & {State.RUNNING, State.BACKOFF}:
            return None
        return 0 if states == {State.DONE} else 1

    def status(self, pid: int, now: float) -> dict[str, Any]:
        """The agent's entry in the job's agents hash."""
        return {
            "pid": pid, "at": round(now, 3),
            "workers": {w: s.view() for w, s in self.slots.items()},
            "restarts": sum(s.restarts for s in self.slots.values()),
        }  # fmt: skip
