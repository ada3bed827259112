"""The daemon's event loop gives way to a plan search under way (daemon/ingest.py)."""

from __future__ import annotations

import asyncio
import time

import redis
import redis.asyncio as aioredis
from test_daemon_commits import KEYS, _committer, _pending, _run

from chameleond.daemon.commits import ACK_SPACING_SECONDS
from chameleond.daemon.config import Config
from chameleond.daemon.consumer import StreamConsumer
from chameleond.daemon.decisions import Decisions
from chameleond.daemon.ingest import PLANNING_FIRST_SECONDS, Ingest
from chameleond.daemon.reachability import Reachability
from chameleond.protocol import CONSUMER_GROUP
from chameleond.redis_server import RedisServer


def test_a_plan_search_under_way_goes_before_the_events_at_most_a_while(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The search runs on a thread that shares the interpreter's lock with the event loop: while
    it runs, the events read wait in the stream, at most PLANNING_FIRST_SECONDS a batch, then
    are handled as before."""
    redis_client.xgroup_create(KEYS.events, CONSUMER_GROUP, id="0", mkstream=True)
    worker = "w0"
    for _ in range(2):
        redis_client.xadd(KEYS.events, {"type": "heartbeat", "worker": worker})

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        cfg = Config()
        decisions = Decisions(c.job, cfg, c, c.metrics)
        consumer = StreamConsumer(client, KEYS, "a", block_ms=10, count=2, claim_idle_ms=60_000,
                                  maxlen=1000)  # fmt: skip
        ingest = Ingest(c.job, consumer, c, decisions, c.metrics, Reachability(c.metrics),
                        max_deliveries=5)  # fmt: skip
        entries = await consumer.read()
        assert len(entries) == 2
        searched = asyncio.get_running_loop().create_future()
        decisions.planning = searched
        began = time.monotonic()
        handling = asyncio.create_task(ingest.process(entries))
        await asyncio.sleep(PLANNING_FIRST_SECONDS / 2)
        assert c.job.worker(worker).last_heartbeat == 0.0  # nothing handled while it searches
        searched.set_result(None)
        await asyncio.sleep(0.1)
        assert c.job.worker(worker).last_heartbeat > 0.0  # the search done: handled
        await handling
        assert time.monotonic() - began < PLANNING_FIRST_SECONDS
        # A search longer than that: each batch waits for it that long at most.
        redis_client.xadd(KEYS.events, {"type": "heartbeat", "worker": worker})
        heard = c.job.worker(worker).last_heartbeat
        decisions.planning = asyncio.get_running_loop().create_future()
        began = time.monotonic()
        await ingest.process(await consumer.read())
        assert c.job.worker(worker).last_heartbeat > heard
        assert PLANNING_FIRST_SECONDS <= time.monotonic() - began < 2 * PLANNING_FIRST_SECONDS
        # Heartbeats change nothing durable: their acknowledgements go with the next commit,
        # ACK_SPACING_SECONDS on at the latest.
        deadline = time.monotonic() + 2.0
        while _pending(redis_client) and time.monotonic() < deadline:
            await asyncio.sleep(ACK_SPACING_SECONDS)

    _run(redis_server, body)
    assert _pending(redis_client) == set()
