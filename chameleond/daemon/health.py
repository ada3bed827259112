"""Whether the daemon is alive, and whether it can take faults: what /healthz and /readyz answer.

The service moves these fields as its lifecycle goes (connected, standing by, leading, stopping);
the HTTP server only reads them. Alive: the read loop, or a commit it waits on, showed a sign of
life recently (a loop stuck on a bug is not alive, a loop waiting on Redis is). Ready: alive,
started, leading the job, and reaching Redis: a daemon that cannot reach Redis retries (it stays
alive) but cannot take faults.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from chameleond.daemon.reachability import Reachability


@dataclass
class Health:
    loop_limit_seconds: float  # the longest the read loop may stay silent while alive
    ready: bool = False  # started and leading; False again once stopping
    standby_for: str = ""  # the daemon that leads the job while this one stands by
    reachability: Reachability | None = None  # the daemon's view of Redis, once it leads
    # Monotonic time of the read loop's last sign of life (its last read, or its last commit
    # attempt); None until the loop exists.
    last_activity: Callable[[], float] | None = None

    def healthy(self) -> tuple[bool, str]:
        now = time.monotonic()
        age = now - (self.last_activity() if self.last_activity is not None else now)
        if self.ready and age > self.loop_limit_seconds:
            return False, f"consumer loop silent for {age:.1f} s"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        ok, why = self.healthy()
        if not ok:
            return False, why
        if self.standby_for:
            return False, f"standing by: job led by {self.standby_for}"
        if not self.ready:
            return False, "starting or stopping"
        if self.reachability is not None and self.reachability.error:
            return False, f"Redis unreachable: {self.reachability.error}"
        return True, "ok"
