"""The plan watcher against a real redis-server that is away when it starts, and lost later."""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import redis
from worker_harness import tiny_spec

from chameleond.auth import Keyring, signed_document
from chameleond.core.decide import initial_plan
from chameleond.core.plan import plan_to_dict
from chameleond.core.plandelta import plan_delta
from chameleond.core.spec import parse_spec
from chameleond.protocol import PLAN_POLL_SECONDS, Keys
from chameleond.redis_server import RedisServer
from chameleond.worker._link import PlanWatcher


@contextlib.contextmanager
def running(watcher: PlanWatcher) -> Iterator[PlanWatcher]:
    watcher.start()
    try:
        yield watcher
    finally:
        watcher.stop()
        watcher.join(timeout=5)


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

    try:
        with running(watcher):
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
        client.close()
        server.stop()
    assert not watcher.is_alive()


def test_the_watcher_reads_the_packed_plan_only_when_a_newer_generation_is_committed(
    redis_server: RedisServer,
) -> None:
    """Workers read the zlib-packed plan; a repeated announcement costs no read, and a lost one is
    caught up by the committed generation (a few bytes, polled), not by re-reading the plan."""
    keys = Keys("packed")
    admin = redis.Redis.from_url(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    watcher = PlanWatcher(client, "packed")
    plan = initial_plan(parse_spec(tiny_spec("packed")), generation=1, mtbf_seconds=3600.0)

    def commit(generation: int, *, announce: bool = True) -> None:
        doc = plan_to_dict(plan)
        doc["generation"] = generation
        admin.set(keys.plan, json.dumps(doc))
        admin.set(keys.plan_packed, zlib.compress(json.dumps(doc).encode()))
        admin.hset(keys.state, "generation", generation)
        if announce:
            admin.publish(keys.plans_channel, str(generation))

    def plan_reads() -> int:
        return int(admin.info("commandstats").get("cmdstat_get", {}).get("calls", 0))

    commit(1, announce=False)
    admin.set(keys.plan, "not what the workers read: they read the packed copy")
    try:
        with running(watcher):
            seen = watcher.wait_newer(0, timeout=15)
            assert seen is not None and seen.generation == 1
            commit(2)
            seen = watcher.wait_newer(1, timeout=15)
            assert seen is not None and seen.generation == 2
            reads = plan_reads()
            for _ in range(20):  # repeats (a fenced worker's nudge): nothing newer to read
                admin.publish(keys.plans_channel, "2")
            time.sleep(0.5)
            assert plan_reads() == reads
            commit(3, announce=False)  # the announcement lost
            seen = watcher.wait_newer(2, timeout=PLAN_POLL_SECONDS + 5)
            assert seen is not None and seen.generation == 3
    finally:
        client.close()
        admin.close()


def test_a_worker_holding_the_plan_before_reads_only_its_delta(redis_server: RedisServer) -> None:
    """The daemon writes a plan's delta from the one before beside it: a worker holding that one
    reads the delta alone (here the packed plan is gone, so the delta is all it can read), checks
    what it makes against the job's signature, and reads the whole plan when it holds another."""
    keyring = Keyring((b"k" * 32,))
    keys = Keys("delta")
    admin = redis.Redis.from_url(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    watcher = PlanWatcher(client, "delta", keyring)
    plan = initial_plan(parse_spec(tiny_spec("delta")), generation=1, mtbf_seconds=3600.0)
    docs: dict[int, dict[str, object]] = {}

    def commit(generation: int, *, excluded: tuple[str, ...] = (), delta_from: int = 0) -> None:
        body = plan_to_dict(replace(plan, generation=generation, excluded=excluded))
        text, docs[generation] = signed_document(keyring, "plan", "delta", body)
        admin.set(keys.plan, text)
        admin.set(keys.plan_packed, zlib.compress(text.encode()))
        admin.delete(keys.plan_delta)
        if delta_from:
            delta = plan_delta(docs[delta_from], docs[generation])
            admin.set(keys.plan_delta, zlib.compress(json.dumps(delta).encode()))
            admin.delete(keys.plan_packed)  # the delta is all there is to read
        admin.hset(keys.state, "generation", generation)
        admin.publish(keys.plans_channel, str(generation))

    commit(1)
    try:
        with running(watcher):
            assert (seen := watcher.wait_newer(0, timeout=15)) is not None and seen.generation == 1
            w = plan.workers[-1]
            commit(2, excluded=(w,), delta_from=1)
            seen = watcher.wait_newer(1, timeout=15)
            assert seen is not None and seen.generation == 2 and seen.excluded == (w,)
            assert (
                len(admin.get(keys.plan_delta) or b"")
                < len(zlib.compress(json.dumps(docs[2]).encode())) / 2
            )

            # A delta made with another key: what it makes is refused, the plan held is kept.
            stranger = Keyring((b"s" * 32,))
            forged = signed_document(
                stranger, "plan", "delta", plan_to_dict(replace(plan, generation=3))
            )[1]
            admin.set(
                keys.plan_delta, zlib.compress(json.dumps(plan_delta(docs[2], forged)).encode())
            )
            admin.hset(keys.state, "generation", 3)
            admin.publish(keys.plans_channel, "3")
            time.sleep(1.0)
            assert watcher.newest is not None and watcher.newest.generation == 2

            # A delta from a plan it does not hold (4 from 3, plan 3 never published: a watcher
            # quick enough would read it, and then hold the delta's base): the whole plan is read.
            docs[3] = signed_document(
                keyring, "plan", "delta", plan_to_dict(replace(plan, generation=3))
            )[1]
            commit(4, delta_from=3)
            admin.set(keys.plan_packed, zlib.compress(admin.get(keys.plan) or b""))
            seen = watcher.wait_newer(2, timeout=15)
            assert seen is not None and seen.generation == 4
    finally:
        client.close()
        admin.close()
