"""The start-up barrier of a host's workers, against a real Redis."""

from __future__ import annotations

import threading
import time

import redis

from chameleond.redis_server import RedisServer
from chameleond.worker._rendezvous import start_together


def test_workers_start_together_once_the_last_arrives(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    returned: dict[str, tuple[int, float]] = {}

    def arrive(me: str, delay: float) -> None:
        time.sleep(delay)
        n = start_together(client, "job:profiling:h", me, 3, timeout_seconds=10)
        returned[me] = (n, time.monotonic())

    threads = [threading.Thread(target=arrive, args=(w, d)) for w, d in [("a", 0), ("b", 0)]]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not returned, "nobody starts before every worker of the host is ready"
    last_arrived = time.monotonic()
    arrive("c", 0)
    for t in threads:
        t.join(timeout=5)
    assert {w: n for w, (n, _) in returned.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(at >= last_arrived for _, at in returned.values())
    assert 0 < client.ttl("job:profiling:h") <= 60
    client.close()


def test_a_worker_counts_once_and_a_missing_one_only_delays(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert start_together(client, "k", "a", 3, timeout_seconds=0) == 1
    t0 = time.monotonic()
    assert start_together(client, "k", "a", 3, timeout_seconds=0.3) == 1  # again: still one
    assert time.monotonic() - t0 >= 0.3
    assert start_together(client, "k", "b", 2, timeout_seconds=5) == 2
    client.close()
