"""A fail-slow fault for real: one process run at a fraction of its speed, as a throttled device.

Every CPU second the process spends costs it 1/factor seconds of wall time: a controller reads the
CPU time of all its threads (/proc/PID/stat, in the kernel's 10 ms ticks) every TICK_SECONDS and,
once it owes a pause of at least MIN_PAUSE_SECONDS, stops it (SIGSTOP) for (1/factor - 1) x the
CPU time it used, then continues it (SIGCONT). So its compute goes at about
`factor` of its speed whether the process is busy or mostly waiting on its peers, as on a device
clocked down; a pause for a fixed share of wall time would fall on a waiting worker's idle time
and slow nothing. The pauses are short against the worker's heartbeat (every 0.5 s) and the
daemon's heartbeat timeout (3 s), so a slowed worker is slow, never missed.

`pause_for` is the pure part: the pause a process owes for the CPU time it used. `Slowdown` is a
daemon thread that applies it to one pid until it is stopped, its time is up, or the process is
gone, and always leaves the process continued (also on an exception, and at interpreter exit).
`SlowRequest` is the ask for one: the hash `chameleon:{job}:slow`, signed as kind "slow", which
`chameleonctl inject slow` writes and chameleon-agent applies (`read_request`, `in_force`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chameleond.auth import Keyring

log = logging.getLogger("chameleon.slowdown")
TICK_SECONDS = 0.01  # the kernel counts CPU time in ticks of 10 ms (SC_CLK_TCK = 100)
MIN_PAUSE_SECONDS = TICK_SECONDS  # a pause owed is paid once it is a tick long
_CLK_TCK = os.sysconf("SC_CLK_TCK")
MIN_FACTOR = 0.01  # a hundred times slower; below that the tick's own granularity dominates


def check_factor(factor: float) -> float:
    """`factor` when it is a speed a Slowdown can run a process at (MIN_FACTOR to 1), else
    ValueError saying so."""
    if not (math.isfinite(factor) and MIN_FACTOR <= factor <= 1.0):
        raise ValueError(f"factor must be between {MIN_FACTOR} and 1, got {factor}")
    return factor


def pause_for(cpu_seconds: float, factor: float) -> float:
    """The wall seconds a process at `factor` of its speed owes for `cpu_seconds` of work."""
    check_factor(factor)
    return max(cpu_seconds, 0.0) * (1.0 / factor - 1.0)


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system, every thread) process `pid` has used; None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def gone(pid: int) -> bool:
    """Whether the process has exited (a zombie not yet reaped has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


_active: set[Slowdown] = set()
_active_lock = threading.Lock()


class Slowdown:
    """Run process `pid` at `factor` of its speed, for `seconds` (None: until stopped)."""

    def __init__(
        self,
        pid: int,
        factor: float,
        *,
        seconds: float | None = None,
    ) -> None:
        self.pid = pid
        self.factor = check_factor(factor)
        self._ends_at = None if seconds is None else time.monotonic() + seconds
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"slowdown-{pid}", daemon=True)

    def start(self) -> Slowdown:
        with _active_lock:
            _active.add(self)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether it still slows the process."""
        return self._thread.is_alive()

    def set_factor(self, factor: float) -> None:
        """Change the speed from the next tick on (1.0: full speed, the thread stays)."""
        self.factor = check_factor(factor)

    def stop(self, timeout: float = 2.0) -> None:
        """End it; the process is left continued."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread.is_alive():  # else it continued the process on its way out
            self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> bool:
        """Send `sig`; False once the process is gone (or not ours to signal)."""
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return not gone(self.pid)

    def _run(self) -> None:
        try:
            used = cpu_seconds(self.pid)
            owed = 0.0
            while used is not None and not self._stopping.is_set():
                if self._ends_at is not None and time.monotonic() >= self._ends_at:
                    break
                self._stopping.wait(TICK_SECONDS)
                now = cpu_seconds(self.pid)
                if now is None or gone(self.pid):
                    break
                owed += pause_for(now - used, self.factor)
                used = now
                if owed >= MIN_PAUSE_SECONDS:
                    if not self._signal(signal.SIGSTOP):
                        break
                    self._stopping.wait(owed)
                    owed = 0.0
                    if not self._signal(signal.SIGCONT):
                        break
                    used = cpu_seconds(self.pid)  # a stopped process spends none
        except Exception:
            log.exception("slowdown of pid %d failed", self.pid)
        finally:
            self._signal(signal.SIGCONT)
            with _active_lock:
                _active.discard(self)


@atexit.register
def _continue_all() -> None:
    """At interpreter exit no process is left stopped."""
    with _active_lock:
        left = list(_active)
    for s in left:
        with contextlib.suppress(Exception):
            s.stop(timeout=0.5)


# ---- a request for one, as chameleonctl inject slow writes it and chameleon-agent reads it ----

SLOW_KIND = "slow"  # the kind its signature covers (a signed plan or spec is no slow request)


@dataclass(frozen=True)
class SlowRequest:
    worker: str
    factor: float  # the fraction of full speed
    until: float | None = None  # unix time it ends at (None: until the field is deleted)

    def document(self) -> dict[str, Any]:
        return {"worker": self.worker, "factor": self.factor, "until": self.until}


def read_request(worker: str, raw: str, job: str, keyring: Keyring | None) -> SlowRequest:
    """The request stored under field `worker`; ValueError (AuthError for an unsigned or forged
    one, with a keyring) says why it is refused."""
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    if keyring is not None:
        keyring.verify_doc(SLOW_KIND, job, doc)
    if doc.get("worker") != worker:
        raise ValueError(f"it is for worker {doc.get('worker')!r}, stored under {worker!r}")
    factor, until = doc.get("factor"), doc.get("until")
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise ValueError(f"factor must be a number, got {factor!r}")
    bad_until = isinstance(until, bool) or not isinstance(until, int | float | None)
    if bad_until or (until is not None and not math.isfinite(until)):
        raise ValueError(f"until must be a unix time or null, got {until!r}")
    return SlowRequest(worker, check_factor(float(factor)), until)


def in_force(requests: Collection[SlowRequest], now: float) -> dict[str, float]:
    """worker -> factor of the requests that slow their worker at unix time `now`."""
    return {
        r.worker: r.factor
        for r in requests
        if r.factor < 1.0 and (r.until is None or now < r.until)
    }
