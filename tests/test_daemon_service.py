"""`Service` in-process against a real redis-server: `async with` stops it and waits for its one
shutdown sequence, `shutdown()` is idempotent, a service runs once, and an unreachable Redis is
an exit status, not a crash."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis

from chameleond.daemon import Config
from chameleond.daemon.service import Service
from chameleond.jobs import load_default_spec
from chameleond.redis_server import RedisServer, free_port


def settings(job: str) -> Config:
    return Config(job=job, consumer=job, http="127.0.0.1:0", block_ms=100,
                  socket_timeout_seconds=2.0, log_level="warning")  # fmt: skip


async def _lifecycle(url: str) -> None:
    async with Service(settings("inproc"), load_default_spec(), url) as svc:
        task = asyncio.create_task(svc.run())
        async with asyncio.timeout(15):
            while not svc.ready:
                await asyncio.sleep(0.01)
        assert svc.http is not None and svc.http.port > 0
        assert svc.healthy() == (True, "ok") and svc.status()["state"] == "waiting"
        svc.shutdown()
        svc.shutdown()  # idempotent
    # Leaving the block waited for the shutdown sequence to finish.
    assert task.done() and task.result() == 0 and not svc.ready
    svc.shutdown()
    with pytest.raises(RuntimeError, match="runs once"):
        await svc.run()


def test_async_with_stops_and_waits_and_shutdown_is_idempotent(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    asyncio.run(_lifecycle(redis_server.url))
    # The shutdown sequence wrote the progress record and the stored spec.
    state = redis_client.hgetall("chameleon:inproc:state")
    assert "progress" in state and "base_spec" in state
    assert json.loads(redis_client.get("chameleon:inproc:spec") or "{}")["workers"]


def test_unreachable_redis_is_exit_status_1() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert asyncio.run(Service(settings("nowhere"), load_default_spec(), url).run()) == 1
