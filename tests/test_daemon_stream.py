"""The stream consumer against a real redis-server: stale entries of a consumer that read and died
are claimed and handled; entries waiting for their decision are not re-claimed (no creep towards
the dead-letter limit); trimming keeps the stream bounded but never cuts an entry the group has
not acknowledged, pending or not yet delivered."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from daemon_harness import RunningJob, wait_for

from chameleond.daemon.consumer import StreamConsumer
from chameleond.protocol import CONSUMER_GROUP, Keys
from chameleond.redis_server import RedisServer

EVENTS = "chameleon:default:events"


def delivered(client: redis.Redis, entry: str) -> int:
    rows = client.xpending_range(EVENTS, CONSUMER_GROUP, entry, entry, 1)
    return int(rows[0]["times_delivered"]) if rows else 0


def pending_of(client: redis.Redis, consumer: str) -> int:
    found = [c for c in client.xinfo_consumers(EVENTS, CONSUMER_GROUP) if c["name"] == consumer]
    return int(found[0]["pending"]) if found else 0


def _consumer(
    client: aioredis.Redis, keys: Keys, *, block_ms: int = 100, count: int = 100, claim_idle_ms: int
) -> StreamConsumer:
    """Consumer "me" of `keys`' stream."""
    return StreamConsumer(client, keys, "me", block_ms=block_ms, count=count,
                          claim_idle_ms=claim_idle_ms, maxlen=200)  # fmt: skip


async def _add(client: aioredis.Redis, keys: Keys, worker: str, kind: str = "heartbeat") -> str:
    """A `kind` event of `worker` added to the stream; its id."""
    return str((await client.xadd(keys.events, {"type": kind, "worker": worker})).decode())


def test_entries_of_a_consumer_that_died_are_claimed_and_owed_ones_are_left_alone(
    redis_client: redis.Redis, running_job: RunningJob
) -> None:
    workers = running_job.workers
    assert running_job.start_training().terminate() == 0

    # Another daemon (another consumer name, another host) reads two entries and dies.
    fault = workers.send(type="fault", worker="w2", cause="NIC down")
    beat = workers.send(type="heartbeat", worker="w3")
    got = redis_client.xreadgroup(CONSUMER_GROUP, "dead-host", {EVENTS: ">"})
    assert [i for _, entries in got for i, _ in entries] == [fault, beat]
    assert pending_of(redis_client, "dead-host") == 2

    daemon = running_job.start("--claim-idle-seconds", "1", "--decision-delay-seconds", "4")
    # Claimed (XAUTOCLAIM) once idle for a second, then handled: the fault starts a decision.
    wait_for(lambda: daemon.status()["state"] == "planning", 10, "the claimed fault decided")
    assert pending_of(redis_client, "dead-host") == 0
    assert delivered(redis_client, fault) == 2  # once to dead-host, once claimed
    # While its decision is held, claim rounds pass every second; the fault waits for the
    # decision's commit and is not claimed again, so its delivery count stays put.
    time.sleep(2.5)
    assert daemon.status()["state"] == "planning"
    assert delivered(redis_client, fault) == 2
    wait_for(lambda: workers.generation() == 2, 10, "generation 2")
    plan = workers.plan()
    assert plan is not None and plan["excluded"] == ["w2"]
    wait_for(lambda: redis_client.xpending(EVENTS, CONSUMER_GROUP)["pending"] == 0, 5, "acks")
    assert redis_client.xlen("chameleon:default:dead") == 0


async def _trim_scenario(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    keys = Keys("trim")
    consumer = StreamConsumer(client, keys, "me", block_ms=100, count=10_000,
                              claim_idle_ms=60_000, maxlen=200)  # fmt: skip
    try:
        await consumer.ensure_group()
        # Ids one millisecond apart, so the maxlen point the trim estimates from them is known.
        pipe = client.pipeline(transaction=False)
        for i in range(1000):
            pipe.xadd(keys.events, {"type": "heartbeat", "worker": "w1"}, id=f"{1000 + i}-1")
        ids = [i.decode() for i in await pipe.execute()]

        async def present() -> set[str]:
            return {i.decode() for i, _ in await client.xrange(keys.events)}

        # Nothing delivered yet: 1000 entries over maxlen 200, and not one may go.
        await consumer.trim()
        assert await present() == set(ids)

        # 600 delivered, the first 500 acknowledged: entries 500..599 are pending, 600.. are not
        # delivered. Everything before the first pending entry may go, nothing after it.
        await client.xreadgroup(CONSUMER_GROUP, "me", {keys.events: ">"}, count=600)
        await client.xack(keys.events, CONSUMER_GROUP, *ids[:500])
        await consumer.trim()
        left = await present()
        assert set(ids[500:]) <= left and len(left) < 1000

        # The group is far behind (100 delivered, all acknowledged, 900 waiting): same rule.
        await client.delete(keys.events)
        await consumer.ensure_group()
        pipe = client.pipeline(transaction=False)
        for i in range(1000):
            pipe.xadd(keys.events, {"type": "heartbeat", "worker": "w1"}, id=f"{5000 + i}-1")
        ids = [i.decode() for i in await pipe.execute()]
        await client.xreadgroup(CONSUMER_GROUP, "me", {keys.events: ">"}, count=100)
        await client.xack(keys.events, CONSUMER_GROUP, *ids[:100])
        await consumer.trim()
        assert set(ids[100:]) <= await present()

        # Everything acknowledged: the stream is cut to about maxlen (whole 100-entry nodes).
        await client.xreadgroup(CONSUMER_GROUP, "me", {keys.events: ">"}, count=10_000)
        await client.xack(keys.events, CONSUMER_GROUP, *ids[100:])
        await consumer.trim()
        assert 200 <= await client.xlen(keys.events) < 900
        assert set(ids[-200:]) <= await present()
    finally:
        await client.aclose()


def test_trimming_keeps_the_stream_bounded_and_never_cuts_an_unacknowledged_entry(
    redis_server: RedisServer,
) -> None:
    asyncio.run(_trim_scenario(redis_server.url))


async def _claim_deleted(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    keys = Keys("claim")
    consumer = _consumer(client, keys, claim_idle_ms=0)
    try:
        await consumer.ensure_group()
        kept = await _add(client, keys, "w1")
        gone = await _add(client, keys, "w2", "fault")
        await client.xreadgroup(CONSUMER_GROUP, "died", {keys.events: ">"})
        await client.xdel(keys.events, gone)  # deleted while pending (an operator, a trim)
        claimed = {e.id: e.fields for e in await consumer.claim_stale()}
        assert set(claimed) == {kept, gone}  # the deleted one is named, to be dead-lettered
        assert claimed[gone] is None and claimed[kept] is not None
    finally:
        await client.aclose()


def test_claiming_names_entries_deleted_while_pending(tmp_path: Path) -> None:
    """Redis 7 drops a deleted entry from the pending list while XAUTOCLAIM passes it and names
    it only in its reply (6.2 answers nil instead, handled when the pending list is re-read);
    run against the system's redis-server 7."""
    server = RedisServer(tmp_path / "redis7", executable="/usr/bin/redis-server").start()
    try:
        assert int(redis.Redis.from_url(server.url).info()["redis_version"].split(".")[0]) >= 7
        asyncio.run(_claim_deleted(server.url))
    finally:
        server.stop()


def test_a_restarted_consumer_rereads_its_pending_entries_and_names_a_deleted_one(
    redis_server: RedisServer,
) -> None:
    """After a restart the consumer re-reads what it read before and never acknowledged, in order
    and with the deliveries counted; an entry deleted meanwhile comes back without its fields (to
    be dead-lettered), whichever reply protocol the client speaks."""
    for protocol in (2, 3):
        asyncio.run(_reread_pending(redis_server.url, protocol))


async def _reread_pending(url: str, protocol: int) -> None:
    client = aioredis.Redis.from_url(url, protocol=protocol)
    keys = Keys(f"reread{protocol}")
    try:
        before = _consumer(client, keys, claim_idle_ms=60_000)
        await before.ensure_group()
        ids = [await _add(client, keys, f"w{i}") for i in range(3)]
        read = await before.read()
        assert [e.id for e in read] == ids and read[1].fields == {b"type": b"heartbeat",
                                                                  b"worker": b"w1"}  # fmt: skip
        await client.xdel(keys.events, ids[1])  # deleted while pending (an operator, a trim)
        after = _consumer(client, keys, claim_idle_ms=60_000)  # the same name after a restart
        pending = await after.own_pending()
        assert [e.id for e in pending] == ids
        assert [e.fields is None for e in pending] == [False, True, False]
        assert pending[2].fields == {b"type": b"heartbeat", b"worker": b"w2"}
        # The read before and this one (Redis counts no delivery of a deleted entry).
        assert [pending[0].deliveries, pending[2].deliveries] == [2, 2]
        assert await after.own_pending(ids[-1]) == []  # nothing after the last
        assert await after.read() == []  # nothing new: the read blocks, then comes back empty
    finally:
        await client.aclose()


def test_a_read_cut_short_leaves_no_reply_behind(redis_server: RedisServer) -> None:
    """A blocking read cancelled while it waits (the daemon stopping, a timeout) closes its
    connection: the next read gets its own reply, not the late one of the read cut short, and a
    connection Redis closed is replaced."""
    asyncio.run(_cut_short(redis_server.url))


async def _cut_short(url: str) -> None:
    client = aioredis.Redis.from_url(url)
    keys = Keys("cut")
    consumer = _consumer(client, keys, block_ms=2_000, count=1, claim_idle_ms=60_000)
    try:
        await consumer.ensure_group()
        waiting = asyncio.create_task(consumer.read())
        await asyncio.sleep(0.2)  # blocked in XREADGROUP
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        first, second = await _add(client, keys, "w1"), await _add(client, keys, "w2")
        assert [e.id for e in await consumer.read()] == [first]
        await client.client_kill_filter(_type="normal", skipme=True)  # the reads' connection
        with pytest.raises(redis.ConnectionError):
            await consumer.read()
        assert [e.id for e in await consumer.read()] == [second]  # on a new connection
        assert [e.id for e in await consumer.own_pending()] == [first]  # a page of COUNT 1
        assert [e.id for e in await consumer.own_pending(first)] == [second]
    finally:
        await client.aclose()
