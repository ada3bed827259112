"""The Redis-backed c10d store: its semantics against a real Redis, and real gloo groups over it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import redis

from chameleond.redis_server import RedisServer
from chameleond.worker._store import KEY_TTL_SECONDS, RedisStore, StoreAborted


@pytest.fixture
def raw_client(redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(redis_server.url)


def test_set_get_add_check_delete(raw_client: redis.Redis) -> None:
    store = RedisStore(raw_client, "job:store:1:world/", timeout=timedelta(seconds=2))
    store.set("a", b"\x00\x01bytes")
    assert store.get("a") == b"\x00\x01bytes"
    store.set("s", "text")
    assert store.get("s") == b"text"
    assert store.add("n", 3) == 3
    assert store.add("n", -1) == 2
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.num_keys() == 3
    assert store.delete_key("a") and not store.delete_key("a")
    assert 0 < raw_client.ttl("job:store:1:world/n") <= KEY_TTL_SECONDS


def test_compare_set_follows_c10d(raw_client: redis.Redis) -> None:
    store = RedisStore(raw_client, "p/")
    assert store.compare_set("k", "", "first") == b"first"  # missing + empty expected: set
    assert store.compare_set("k", "wrong", "second") == b"first"  # mismatch: current value
    assert store.compare_set("k", "first", "second") == b"second"
    assert store.compare_set("other", "x", "y") == b"x"  # missing, non-empty expected: unchanged
    assert not store.check(["other"])


def test_prefixes_are_isolated(raw_client: redis.Redis) -> None:
    gen1 = RedisStore(raw_client, "job:store:1:", timeout=timedelta(milliseconds=200))
    gen2 = RedisStore(raw_client, "job:store:2:", timeout=timedelta(milliseconds=200))
    gen1.set("rank0", b"addr")
    with pytest.raises(RuntimeError, match="timed out"):
        gen2.get("rank0")


def test_wait_times_out_and_abort_cuts_it_short(raw_client: redis.Redis) -> None:
    store = RedisStore(raw_client, "w/", timeout=timedelta(milliseconds=300))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        store.wait(["never"])
    assert 0.25 < time.monotonic() - t0 < 2.0

    def abort() -> None:
        raise StoreAborted("peer w3 gone")

    aborting = RedisStore(raw_client, "w/", timeout=timedelta(seconds=30), abort=abort)
    t0 = time.monotonic()
    with pytest.raises(StoreAborted, match="w3 gone"):
        aborting.get("never")
    assert time.monotonic() - t0 < 1.0


_GROUP = textwrap.dedent(
    """
    import sys, datetime, redis, torch
    from chameleond.worker._backend import parse_device, new_group
    from chameleond.worker._store import RedisStore
    url, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = RedisStore(redis.Redis.from_url(url), "job:store:7:world/")
    pg = new_group(store, rank, size, parse_device("cpu"), bind_address="127.0.0.1",
                   timeout=datetime.timedelta(seconds=10))
    t = torch.full((3,), float(rank + 1))
    pg.allreduce([t]).wait()
    print(t.tolist())
    del pg  # close before interpreter teardown, like the worker does at a generation's end
    """
)


def test_gloo_group_over_the_store_across_processes(redis_server: RedisServer) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _GROUP, redis_server.url, str(r), "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "[6.0, 6.0, 6.0]"
