"""The worker's writes to Redis, in order, from one thread: training never waits on Redis.

Every event a worker sends (register, profile, ack, step, fault) and its one key write go into the
outbox; a sender thread applies them to Redis in the order they were put. When Redis cannot be
reached (a restart, a failover, a cut link) the sender keeps them and tries again every
RETRY_SECONDS, and training goes on: a step needs only the process groups. Once Redis answers,
the kept writes go out in order. A write whose reply was lost in the cut may be applied twice; the
daemon takes a repeated event as a duplicate (at-least-once, like any stream producer).

* A heartbeat put while Redis is away is dropped, not kept: it says nothing once it is late.
* An error that is not an outage (a command the ACL denies, a wrong type) is kept and raised in
  the thread that next puts a write; the worker ends with it (exit 3).
* The outbox keeps at most `max_kept` writes (hours of steps); past that the worker ends rather
  than grow without bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import redis

log = logging.getLogger("chameleon.worker")

Write = Callable[[], object]
T = TypeVar("T")

# What an outage looks like from redis-py once its own retries are spent. A server still loading
# its append-only file after a restart answers LOADING: BusyLoadingError, a ConnectionError.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
)
RETRY_SECONDS = 0.5
MAX_KEPT = 100_000


class RedisUnreachable(RuntimeError):
    """Redis stayed away longer than a rendezvous or a reconciliation may wait."""


class OutboxFull(redis.ConnectionError):
    """Redis stayed away while the outbox filled up."""


class Outbox(threading.Thread):
    def __init__(self, *, max_kept: int = MAX_KEPT, retry_seconds: float = RETRY_SECONDS) -> None:
        super().__init__(name="outbox", daemon=True)
        self._queue: deque[Write] = deque()
        self._cond = threading.Condition()
        self._max_kept = max_kept
        self._retry_seconds = retry_seconds
        self._error: redis.RedisError | None = None
        self._closing = False
        self.down_since: float | None = None  # monotonic time of the first failed write

    def put(self, write: Write, *, keep: bool = True) -> None:
        """Queue `write`; with keep=False it is dropped while Redis is away."""
        with self._cond:
            if self._error is not None:
                raise self._error
            if not keep and self.down_since is not None:
                return
            if len(self._queue) >= self._max_kept:
                away = time.monotonic() - (self.down_since or time.monotonic())
                raise OutboxFull(f"Redis unreachable for {away:.0f} s; {len(self._queue)} unsent")
            self._queue.append(write)
            self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                write = self._queue[0]
            try:
                write()
            except OUTAGE_ERRORS as e:
                self._on_outage(e)
                continue
            except redis.RedisError as e:
                log.error("Redis refused a write: %s", e)
                with self._cond:
                    self._error = e
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._queue.popleft()
                if self.down_since is not None:
                    log.info(
                        "Redis reachable again after %.1f s; sending %d kept writes",
                        time.monotonic() - self.down_since,
                        len(self._queue) + 1,
                    )
                    self.down_since = None
                self._cond.notify_all()

    def _on_outage(self, e: BaseException) -> None:
        with self._cond:
            if self.down_since is None:
                self.down_since = time.monotonic()
                log.warning("Redis unreachable (%s): keeping events, training goes on", e)
            self._cond.wait(self._retry_seconds)

    def close(self, timeout: float) -> int:
        """Send what is queued, waiting at most `timeout` seconds; the number left unsent."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._queue and self._error is None and self.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            return len(self._queue)


def through_outage(call: Callable[[], T], seconds: float, what: str) -> T:
    """`call()`, tried again through a Redis outage for up to `seconds`; then a RuntimeError
    naming `what`, which fails the generation like any other rendezvous error."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except OUTAGE_ERRORS as e:
            if time.monotonic() > deadline:
                raise RedisUnreachable(
                    f"Redis unreachable for {seconds:g} s during {what}: {e}"
                ) from e
            time.sleep(RETRY_SECONDS)
