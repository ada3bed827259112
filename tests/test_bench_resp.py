"""The simulated workers' Redis connection (chameleond/bench/resp.py) against a real redis-server:
named as the daemon's connection watch expects, commands and their replies, error replies, an
ACL user, commands sent together on one connection, and pub/sub messages, on asyncio's loop and
on uvloop's (the simulated workers')."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis
import uvloop

from chameleond.bench.resp import Connection, RespError
from chameleond.redis_server import RedisServer

NAME = "chameleon-worker:j:w3:1234-ab"


async def _talk(url: str, client: redis.Redis) -> None:
    conn = await Connection.open(url, NAME)
    assert NAME in {c["name"] for c in client.client_list()}
    entry = await conn.call("XADD", "s", "*", "type", "step", "worker", "w3")
    assert client.xrange("s") == [(entry.decode(), {"type": "step", "worker": "w3"})]
    assert await conn.call("GET", "missing") is None
    client.hset("h", "generation", 7)
    assert int(await conn.call("HGET", "h", "generation")) == 7
    with pytest.raises(RespError, match="WRONGTYPE"):
        await conn.call("GET", "h")
    assert await conn.call("GET", "missing") is None  # the connection goes on after an error
    # A worker's loops share its connection: commands sent together each get their own reply.
    client.mset({f"k{i}": i for i in range(50)})
    replies = await asyncio.gather(*(conn.call("GET", f"k{i}") for i in range(50)))
    assert [int(r) for r in replies] == list(range(50))
    sub = await Connection.open(url, NAME)
    messages = sub.subscribe("plans", "liveness")
    first = asyncio.ensure_future(messages.__anext__())
    async with asyncio.timeout(5):
        while client.pubsub_numsub("plans") != [("plans", 1)]:
            await asyncio.sleep(0.02)
    client.publish("liveness", "gone")
    assert await first == (b"liveness", b"gone")
    await messages.aclose()
    conn.close()
    sub.close()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_commands_replies_and_messages(
    redis_server: RedisServer, redis_client: redis.Redis, run: Callable[[Any], None]
) -> None:
    run(_talk(redis_server.url, redis_client))


def test_an_acl_user_authenticates_from_the_url(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.acl_setuser("sim", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                             commands=["+@all"])  # fmt: skip
    host, port = redis_server.url.split("//")[1].rsplit(":", 1)
    uvloop.run(_talk(f"redis://sim:pw@{host}:{port.split('/')[0]}", redis_client))
    with pytest.raises(RespError, match="WRONGPASS"):
        uvloop.run(Connection.open(f"redis://sim:wrong@{host}:{port.split('/')[0]}", NAME))
