"""A worker's Redis writes through an outage (chameleond/worker/_outbox.py), and what a survivor may
conclude about its peers right after a Redis restart (chameleond/worker/_link.py): a real
redis-server, stopped and started again on the same port and data directory."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import redis
from worker_harness import wait_until

from chameleond.redis_server import RedisServer
from chameleond.worker._outbox import Outbox, OutboxFull
from chameleond.worker._store import RedisStore

STREAM = "chameleon:t:events"


def test_kept_writes_arrive_in_order_after_a_redis_restart(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    box = Outbox(retry_seconds=0.1)
    box.start()

    def xadd(seq: int) -> None:
        box.put(lambda: redis_client.xadd(STREAM, {"seq": seq}))

    for seq in range(10):
        xadd(seq)
    wait_until(lambda: box.pending() == 0, 5, "the outbox to empty")
    redis_server.stop()
    for seq in range(10, 20):
        xadd(seq)
    # redis-py's own retries come first (about 4 s)
    wait_until(lambda: box.down_since is not None, 15, "the outage to be noticed")
    for seq in range(20, 30):
        xadd(seq)
        box.put(lambda: redis_client.xadd(STREAM, {"heartbeat": 1}), keep=False)
    assert box.pending() == 20  # kept, and the heartbeats dropped
    redis_server.start()
    assert box.close(20) == 0
    entries = redis_client.xrange(STREAM)
    assert [int(f["seq"]) for _, f in entries] == list(range(30))


def test_a_refused_write_is_raised_to_the_next_put(redis_client: redis.Redis) -> None:
    redis_client.set("not-a-stream", "x")
    box = Outbox()
    box.start()
    box.put(lambda: redis_client.xadd("not-a-stream", {"a": 1}))
    box.join(timeout=5)  # the sender ends at an error that is not an outage
    assert not box.is_alive()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        box.put(lambda: redis_client.xadd(STREAM, {"a": 1}))


def test_a_full_outbox_refuses_more() -> None:
    box = Outbox(max_kept=2)  # not started: nothing leaves
    box.put(lambda: None)
    box.put(lambda: None)
    with pytest.raises(OutboxFull, match="2 unsent"):
        box.put(lambda: None)


def test_a_store_wait_rides_through_a_redis_restart(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    store = RedisStore(client, "t/", timeout=timedelta(seconds=30))
    done: list[bytes] = []
    waiter = threading.Thread(target=lambda: done.append(store.get("key")), daemon=True)
    try:
        waiter.start()
        time.sleep(0.2)
        redis_server.stop()
        time.sleep(1.0)
        redis_server.start()
        RedisStore(redis.Redis.from_url(redis_server.url), "t/").set("key", "v")
        waiter.join(timeout=20)
        assert done == [b"v"]
    finally:
        client.close()
