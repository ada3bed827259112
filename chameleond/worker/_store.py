"""A c10d Store backed by Redis: the rendezvous of every process group of a plan generation.

Why Redis and not a TCPStore hosted by rank 0: a TCPStore lives inside one worker, so the loss of
that worker takes the rendezvous with it, and the survivors could not build the next generation's
groups. Redis is already the job's control channel (events, plans), outlives every worker, and can
itself be replicated; so the rendezvous survives the loss of any single worker. Each generation (and
each group inside it) gets a fresh key prefix, so a stale process of an older generation can never
satisfy a newer rendezvous. Keys expire so finished generations leave nothing behind.

Waiting polls Redis with short sleeps. Between polls an optional `abort` callback may raise (for
example because a newer plan was published, or a peer's process is gone), so a rendezvous with a
dead peer ends in milliseconds instead of at the timeout. A Redis outage shorter than the timeout
(a restart) only delays the rendezvous: every call is tried again until Redis answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import redis
import torch.distributed as dist

from chameleond.worker._outbox import through_outage

T = TypeVar("T")

KEY_TTL_SECONDS = 3600
_POLL_SECONDS = 0.002
_POLL_MAX_SECONDS = 0.02


class StoreAborted(RuntimeError):
    """A wait on the store was cut short by the abort callback (the message says why)."""


class RedisStore(dist.Store):
    """`torch.distributed.Store` over one key prefix in Redis."""

    def __init__(
        self,
        client: redis.Redis,
        prefix: str,
        *,
        timeout: timedelta = timedelta(seconds=30),
        abort: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._redis = client
        self._prefix = prefix
        self._timeout = timeout
        self._abort = abort

    def _key(self, key: str) -> str:
        return self._prefix + key

    # The c10d interface ---------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._call(lambda: self._redis.set(self._key(key), data, ex=KEY_TTL_SECONDS))

    def get(self, key: str) -> bytes:
        self._wait_for([key], self._timeout)
        value = self._call(lambda: self._redis.get(self._key(key)))
        if value is None:  # expired between the wait and the read
            raise RuntimeError(f"store key {key!r} vanished")
        return value if isinstance(value, bytes) else str(value).encode()

    def add(self, key: str, value: int) -> int:
        k = self._key(key)

        def add() -> list[object]:
            pipe = self._redis.pipeline()
            pipe.incrby(k, value)
            pipe.expire(k, KEY_TTL_SECONDS)
            return pipe.execute()

        return int(self._call(add)[0])  # type: ignore[call-overload]

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        des = desired.encode() if isinstance(desired, str) else bytes(desired)
        # c10d semantics: set when the current value equals `expected`, or when the key is missing
        # and `expected` is empty; return the value now stored.
        script = (
            "local v = redis.call('GET', KEYS[1]) "
            "if (v == false and ARGV[1] == '') or v == ARGV[1] then "
            "redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) return ARGV[2] end "
            "if v == false then return ARGV[1] end return v"
        )
        args = (script, 1, self._key(key), exp, des, KEY_TTL_SECONDS)
        out = self._call(lambda: self._redis.eval(*args))
        return out if isinstance(out, bytes) else str(out).encode()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, timeout or self._timeout)

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        found = self._call(lambda: self._redis.exists(*[self._key(k) for k in keys]))
        return int(found) == len(keys)

    def delete_key(self, key: str) -> bool:
        return int(self._call(lambda: self._redis.delete(self._key(key)))) > 0

    def num_keys(self) -> int:
        return sum(1 for _ in self._redis.scan_iter(match=self._prefix + "*", count=1000))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    # ----------------------------------------------------------------------------------------------

    def _call(self, call: Callable[[], T]) -> T:
        """A Redis call that rides through an outage shorter than the store's timeout."""
        return through_outage(call, self._timeout.total_seconds(), "a rendezvous")

    def _wait_for(self, keys: list[str], timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        pause = _POLL_SECONDS
        while not self.check(keys):
            if self._abort is not None:
                self._abort()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"store wait timed out after {timeout.total_seconds():.1f}s for {keys}"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_SECONDS)
