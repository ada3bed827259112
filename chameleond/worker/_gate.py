"""The step gate of `chameleonctl bench worker`: lets two trainings take turns on one machine.

The bench compares the library with a plain torch loop on a shared host whose load drifts. Runs
one after the other see different loads; so both trainings are started once and take turns in
blocks of a few steps (plain, library, plain, ...), each pausing between two steps while the other
runs. Both time their steps with this same class, in the same way: wall and CPU time (the whole
process: gloo's and the library's threads included) from the start of a step to the start of the
next, the pause left out.

The gate file holds one line `PLAIN LIBRARY`: the step a training of each kind may not start yet.
A process waits before step s until s is below its kind's limit, and appends one line per step
to its own record file, `STEP WALL_SECONDS CPU_SECONDS`. A worker of the library takes the gate
from the environment (`CHAMELEON_BENCH_GATE`: the gate file; its record file is the gate file's
name + `.` + the worker id); it is instrumentation, off unless that is set.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TextIO

GATE_ENV = "CHAMELEON_BENCH_GATE"
KINDS = ("plain", "library")
POLL_SECONDS = 0.005


class StepGate:
    def __init__(self, gate: Path, kind: str, record: Path) -> None:
        if kind not in KINDS:
            raise ValueError(f"gate kind {kind!r}: expected one of {KINDS}")
        self.gate = gate
        self.column = KINDS.index(kind)
        self._record: TextIO = record.open("a", buffering=1)  # one line per step, flushed
        self._started: tuple[int, float, float] | None = None

    @classmethod
    def from_env(cls, worker: str) -> StepGate | None:
        path = os.environ.get(GATE_ENV)
        if not path:
            return None
        return cls(Path(path), "library", Path(f"{path}.{worker}"))

    def before(self, step: int) -> None:
        """Record the step that just ended, wait until `step` may start, then start timing it."""
        self._ended()
        while step >= self._limit():
            time.sleep(POLL_SECONDS)
        self._started = (step, time.perf_counter(), time.process_time())

    def close(self) -> None:
        """Record the last step (a training that ends after it), and close the record."""
        self._ended()
        self._record.close()

    def _ended(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        if self._started is not None:
            s, wall0, cpu0 = self._started
            self._record.write(f"{s} {wall - wall0:.6f} {cpu - cpu0:.6f}\n")
            self._started = None

    def _limit(self) -> int:
        try:
            fields = self.gate.read_text().split()
            return int(fields[self.column])
        except (OSError, IndexError, ValueError):  # being rewritten: ask again
            return -1


def read_record(path: Path) -> dict[int, tuple[float, float]]:
    """A record file: step -> (wall seconds, CPU seconds)."""
    out: dict[int, tuple[float, float]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) == 3:
            out[int(fields[0])] = (float(fields[1]), float(fields[2]))
    return out


def open_gate(gate: Path, plain: int, library: int) -> None:
    """Let plain trainings start steps below `plain`, the library's below `library` (written
    whole, then renamed into place: a reader never sees half a line)."""
    tmp = gate.with_name(gate.name + ".tmp")
    tmp.write_text(f"{plain} {library}\n")
    tmp.replace(gate)
