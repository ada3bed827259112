"""The plan watcher against a real redis-server that is away when it starts, and lost later."""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis
from worker_harness import tiny_spec

from chameleond.core.decide import initial_plan
from chameleond.core.plan import plan_to_dict
from chameleond.core.spec import parse_spec
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer
from chameleond.worker._link import PlanWatcher


def test_the_watcher_sees_plans_once_redis_is_there(tmp_path: Path) -> None:
    keys = Keys("watch")
    server = RedisServer(tmp_path / "redis")  # not started yet: nothing listens on its port
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=1)
    watcher = PlanWatcher(client, "watch")
    plan = initial_plan(parse_spec(tiny_spec("watch")), generation=1, mtbf_seconds=3600.0)

    def publish(generation: int) -> None:
        admin = redis.Redis.from_url(server.url)
        try:
            doc = plan_to_dict(plan)
            doc["generation"] = generation
            admin.set(keys.plan, json.dumps(doc))
            admin.publish(keys.plans_channel, str(generation))
        finally:
            admin.close()

    watcher.start()
    try:
        time.sleep(0.6)  # several subscriptions refused
        assert watcher.is_alive() and watcher.newest is None
        server.start()
        publish(1)
        seen = watcher.wait_newer(0, timeout=15)
        assert seen is not None and seen.generation == 1
        server.stop()  # lost while watching, then back (the same port)
        time.sleep(0.6)
        server.start()
        publish(2)
        seen = watcher.wait_newer(1, timeout=15)
        assert seen is not None and seen.generation == 2
    finally:
        watcher.stop()
        watcher.join(timeout=5)
        client.close()
        server.stop()
    assert not watcher.is_alive()
