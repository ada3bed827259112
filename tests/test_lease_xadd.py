"""The leader's own writes to its event stream (the detector's suspicions): many entries in order,
a few round trips for a host's thousands, and nothing written once another daemon leads."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from chameleond.daemon.config import Config
from chameleond.daemon.lease import XADD_BATCH, Lease, LeaseLost
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

KEYS = Keys("t")


async def _write(server: RedisServer) -> None:
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    lease = Lease(client, KEYS, "test", Config.lease_seconds)
    assert await lease.acquire(asyncio.Event(), lambda holder: None)
    n = 2 * XADD_BATCH + 7  # three script calls
    await lease.xadd(KEYS.events, [{"type": "fault", "worker": f"w{i}"} for i in range(n)])
    entries = await client.xrange(KEYS.events)
    assert [fields["worker"] for _, fields in entries] == [f"w{i}" for i in range(n)]
    await client.set(KEYS.leader, "elsewhere 1", px=60_000)  # another daemon leads now
    with pytest.raises(LeaseLost):
        await lease.xadd(KEYS.events, [{"type": "fault", "worker": "late"}])
    assert await client.xlen(KEYS.events) == n
    await client.aclose()


def test_the_leader_writes_many_entries_in_order_and_none_once_it_lost_the_lease(
    redis_server: RedisServer,
) -> None:
    asyncio.run(_write(redis_server))
