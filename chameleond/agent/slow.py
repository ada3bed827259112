"""The agent's part in fail-slow injection: the job's `slow` requests applied to its workers.

`chameleonctl inject slow` writes a request into the job's hash `chameleon:{job}:slow` (field: the
worker; value: the JSON document {"worker", "factor", "until"} signed as kind "slow" with the
job's keyring). Every second the agent reads the hash, keeps the requests for its own workers that
verify (an unsigned or forged one is refused and logged, once per value), and runs each such
worker's current process at the requested factor (chameleond.local.slowdown) until the field is
deleted or `until` (unix time) passes. A restarted worker is slowed again: the request names the
worker, not a process.

The request itself (`SlowRequest`, `read_request`, `in_force`) is chameleond.local.slowdown's;
`SlowControl` holds the slowdowns and reads Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import redis

from chameleond.auth import Keyring
from chameleond.local.slowdown import Slowdown, SlowRequest, in_force, read_request
from chameleond.protocol import Keys

log = logging.getLogger("chameleon.agent")
POLL_SECONDS = 1.0


class SlowControl:
    """One agent's slowdowns, one per worker at most, kept in line with the job's requests."""

    def __init__(self, job: str, keyring: Keyring | None, client: redis.Redis) -> None:
        self.job = job
        self.keyring = keyring
        self.client = client
        self.slowdowns: dict[str, Slowdown] = {}
        self.refused: dict[str, str] = {}  # worker -> the value last refused (logged once)
        self.next_at = 0.0

    def tick(self, pids: Mapping[str, int], now: float) -> None:
        """Every POLL_SECONDS (`now` monotonic): read the requests, apply them to `pids` (the
        host's running workers). Redis away: the slowdowns stay as they are."""
        if now < self.next_at:
            return
        self.next_at = now + POLL_SECONDS
        try:
            raw: Mapping[Any, Any] = self.client.hgetall(Keys(self.job).slow)
        except redis.RedisError as e:
            log.debug("slow requests not read: %s", e)
            return
        requests = [r for w, v in raw.items() if w in pids and (r := self._read(w, v))]
        self.apply(in_force(requests, time.time()), pids)

    def _read(self, worker: str, value: str) -> SlowRequest | None:
        try:
            request = read_request(worker, value, self.job, self.keyring)
        except ValueError as e:
            if self.refused.get(worker) != value:
                log.warning("slow request for %s refused: %s", worker, e)
                self.refused[worker] = value
            return None
        self.refused.pop(worker, None)
        return request

    def apply(self, factors: Mapping[str, float], pids: Mapping[str, int]) -> None:
        """Slow each worker of `factors` (its process in `pids`), and no other."""
        for worker, s in list(self.slowdowns.items()):
            if worker not in factors or pids.get(worker) != s.pid:
                s.stop()
                del self.slowdowns[worker]
                if worker not in factors:
                    log.info("worker %s back to full speed", worker)
        for worker, factor in factors.items():
            pid = pids.get(worker)
            current = self.slowdowns.get(worker)
            if pid is None or (current is not None and current.factor == factor):
                continue
            if current is None:
                self.slowdowns[worker] = Slowdown(pid, factor).start()
            else:
                current.set_factor(factor)
            log.warning("worker %s (pid %d) slowed to %g of its speed", worker, pid, factor)

    def close(self) -> None:
        """Every worker back to full speed (before it is stopped: a stopped process would take
        its SIGTERM only once continued)."""
        for s in self.slowdowns.values():
            s.stop()
        self.slowdowns.clear()
