"""Whether the daemon's Redis calls succeed: one view for every path that calls Redis.

The service makes one. The read loop and the commits (the read loop's own, and each decision's)
report each failure and success to it; `/readyz`, `chameleon_redis_up` and the detector read it.
A commit can fail while no read does (the read loop waits on the commit it is retrying), so the
reads alone would not see an outage that hits a commit first, and the detector would count the
silence it causes against the workers.
"""

from __future__ import annotations

import logging
import time

from chameleond.daemon.metrics import Metrics

log = logging.getLogger("chameleond")


class Reachability:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.error = ""  # why the last Redis call failed; "" once one succeeds
        # When calls last began to succeed: at start, and again when Redis is back after an
        # outage. Nobody's silence before then counts against them (daemon/detector.py).
        self.since = time.time()
        metrics.redis_up.set(1)

    def failed(self, error: BaseException) -> None:
        self.error = str(error) or type(error).__name__
        self.metrics.redis_up.set(0)

    def succeeded(self) -> None:
        if self.error:
            log.info("Redis reachable again")
            self.error = ""
            self.since = time.time()
        self.metrics.redis_up.set(1)
