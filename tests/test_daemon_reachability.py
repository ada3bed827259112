"""A commit that fails marks Redis unreachable, as a failed read does: the read loop waits on the
commit it retries, so without this an outage that hits a commit first went unseen by `/readyz`,
`chameleon_redis_up` and the detector (which then declared every silent worker failed)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from chameleond.core.machine import PolicyMachine
from chameleond.daemon.commits import Committer
from chameleond.daemon.config import Config
from chameleond.daemon.lease import Lease
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.reachability import Reachability
from chameleond.jobs import load_default_spec
from chameleond.jobstate.job import Job
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer


async def _commit_through_an_outage(server: RedisServer) -> None:
    client = aioredis.Redis.from_url(server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    metrics = Metrics()
    job = Job("t", load_default_spec(), policy="adaptive", machine=PolicyMachine())
    seen = Reachability(metrics)
    lease = Lease(client, Keys("t"), "test", Config.lease_seconds)
    committer = Committer(client, Keys("t"), job, metrics, seen, lease, persist_interval_seconds=60)

    def redis_up() -> float | None:
        return metrics.registry.get_sample_value("chameleon_redis_up")

    await committer.batch([], [], force_progress=True)
    assert seen.error == "" and redis_up() == 1
    server.stop()
    stopped = time.time()
    task = asyncio.create_task(committer.batch([], [], force_progress=True))
    async with asyncio.timeout(10):
        while not seen.error:
            await asyncio.sleep(0.02)
    assert redis_up() == 0 and not task.done()  # retrying, and known to be away
    server.start()
    await asyncio.wait_for(task, 15)
    assert seen.error == "" and redis_up() == 1
    assert seen.since > stopped  # silence before Redis came back counts against nobody
    await client.aclose()


def test_a_failing_commit_marks_redis_unreachable_until_one_lands(
    redis_server: RedisServer,
) -> None:
    asyncio.run(_commit_through_an_outage(redis_server))
