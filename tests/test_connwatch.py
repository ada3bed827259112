"""Peer death without per-worker polling: the daemon's connection watch announces a killed
worker's process, and a worker whose Redis user may not run CLIENT LIST learns of it in time."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio as aioredis

from chameleond.auth import Keyring, signed_json
from chameleond.daemon.connwatch import (
    MAX_LISTING_PAUSE,
    RECONNECT_SECONDS,
    Connections,
    ConnWatch,
    listed,
)
from chameleond.daemon.metrics import Metrics
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer
from chameleond.worker._link import PlanWatcher, connection_name
from chameleond.worker._liveness import NOTICE_WAIT_SECONDS, PeerNotices

JOB = "cw"
RING = Keyring((b"a-job-secret-of-enough-length",))
PERIOD = 0.25


def test_connections_announce_the_gone_and_the_live_again() -> None:
    c = Connections()
    a, b = ("w1", "inc-a"), ("w1", "inc-b")
    assert not c.update({a, ("w2", "x")}, RECONNECT_SECONDS, now=100.0)  # first seen: no news
    # Missing from one listing: a live worker reopening its connection may be; not yet gone.
    assert not c.update({("w2", "x")}, RECONNECT_SECONDS, now=101.0)
    gone = c.update({("w2", "x")}, RECONNECT_SECONDS, now=101.1)
    assert gone.gone == (a,) and gone.live == ()
    assert c.current().gone == (a,)
    # A new process of w1: announced live (the id is alive again); the old one stays gone.
    back = c.update({("w2", "x"), b}, RECONNECT_SECONDS, now=102.0)
    assert back.gone == () and back.live == (b,)
    assert c.current().gone == (a,) and c.current().live == (b,)
    # A worker never seen gone is not announced when it appears.
    assert not c.update({("w2", "x"), b, ("w3", "y")}, RECONNECT_SECONDS, now=103.0)


def test_a_replaced_process_dying_leaves_its_worker_alive() -> None:
    """A new process of w1 starts while the old one lives; the old one is then killed: w1's id
    stays alive for the workers (its new process is announced live with the death)."""
    c = Connections()
    a, b = ("w1", "inc-a"), ("w1", "inc-b")
    c.update({a, b}, RECONNECT_SECONDS, now=1.0)
    c.update({b}, RECONNECT_SECONDS, now=1.9)
    notice = c.update({b}, RECONNECT_SECONDS, now=2.0)
    assert notice.gone == (a,) and notice.live == (b,)
    n = PeerNotices(JOB, RING)
    assert n.take(signed_json(RING, "liveness", JOB, notice.doc(2.0)))
    assert n.gone({"w1": None}) == [] and n.gone({"w1": "inc-a"}) == ["w1"]
    late = PeerNotices(JOB, RING)  # from the Keys.gone document
    assert late.take(signed_json(RING, "liveness", JOB, c.current().doc(2.0)))
    assert late.gone({"w1": None}) == [] and late.gone({"w1": "inc-a"}) == ["w1"]


def test_a_connection_reopened_between_two_listings_is_no_death() -> None:
    c = Connections()
    c.update({("w1", "a")}, RECONNECT_SECONDS, now=0.0)
    assert not c.update(set(), RECONNECT_SECONDS, now=0.1)
    assert not c.update({("w1", "a")}, RECONNECT_SECONDS, now=0.2)
    assert not c.update(set(), RECONNECT_SECONDS, now=0.3)
    assert not c.update({("w1", "a")}, RECONNECT_SECONDS, now=0.4)


def test_no_connection_old_enough_is_no_evidence() -> None:
    """Right after a Redis restart or failover every live worker is reconnecting."""
    c = Connections()
    c.update({("w1", "a"), ("w2", "b")}, RECONNECT_SECONDS, now=1.0)
    assert not c.update(set(), oldest=1, now=2.0)
    assert not c.update({("w2", "b")}, RECONNECT_SECONDS, now=5.0)
    assert c.update({("w2", "b")}, RECONNECT_SECONDS, now=5.1).gone == (("w1", "a"),)


def test_gone_incarnations_are_forgotten_after_a_while() -> None:
    c = Connections()
    c.update({("w1", "a")}, RECONNECT_SECONDS, now=0.0)
    c.update(set(), RECONNECT_SECONDS, now=1.0)
    assert c.update(set(), RECONNECT_SECONDS, now=1.1).gone == (("w1", "a"),)
    c.update(set(), RECONNECT_SECONDS, now=2000.0)
    assert c.current().gone == ()


def test_notices_by_incarnation_and_by_id() -> None:
    n = PeerNotices(JOB, RING)
    doc = {"gone": [["w1", "a"]], "live": [], "at": 1.0}
    assert n.take(signed_json(RING, "liveness", JOB, doc))
    assert n.gone({"w1": "a", "w2": None}) == ["w1"]
    assert n.gone({"w1": None}) == ["w1"]  # the newest notice about w1 is its death
    assert n.gone({"w1": "b"}) == []  # another process of w1 was not announced gone
    assert n.take(signed_json(RING, "liveness", JOB, {"gone": [], "live": [["w1", "b"]]}))
    assert n.gone({"w1": None}) == [] and n.gone({"w1": "a"}) == ["w1"]
    # Unsigned, or signed with another job's key: not the job's daemon; ignored.
    assert not n.take(signed_json(None, "liveness", JOB, {"gone": [["w2", "c"]], "live": []}))
    other = Keyring((b"not-this-job-secret-at-all!!",))
    assert not n.take(signed_json(other, "liveness", JOB, {"gone": [["w2", "c"]], "live": []}))
    assert n.gone({"w2": None}) == []


def test_listings_are_spaced_by_their_round_trip_up_to_a_bound() -> None:
    """20 round trips apart (Redis's share), but never further than MAX_LISTING_PAUSE: a round
    trip measured on a busy event loop says little of Redis, and two pauses bound how soon a
    worker learns of a peer's death."""
    watch = ConnWatch(None, Keys("j"), 0.1, Metrics())  # type: ignore[arg-type]
    assert watch.pause == 0.1
    watch.listing_seconds = 0.01
    assert watch.pause == pytest.approx(0.2)
    watch.listing_seconds = 0.6  # a daemon busy with 8,192 workers' events
    assert watch.pause == MAX_LISTING_PAUSE
    assert ConnWatch(None, Keys("j"), 5.0, Metrics()).pause == 5.0  # type: ignore[arg-type]
    # A connection missing from the last listing is confirmed (or not) after the base period.
    watch.connections.update({("w1", "a"), ("w2", "b")}, RECONNECT_SECONDS, 0.0)
    watch.connections.update({("w1", "a")}, RECONNECT_SECONDS, 1.0)
    assert watch.pause == 0.1
    gone = watch.connections.update({("w1", "a")}, RECONNECT_SECONDS, 1.1)
    assert gone.gone == (("w2", "b"),) and watch.pause == MAX_LISTING_PAUSE


def test_listed_reads_the_jobs_connections(redis_server: RedisServer) -> None:
    names = [connection_name(JOB, "w1", "i1"), connection_name(JOB, "w:2", "i2"), "other"]
    clients = [redis.Redis.from_url(redis_server.url, client_name=n) for n in names]
    try:
        for c in clients:
            c.ping()
        raw = clients[0].execute_command("CLIENT", "LIST", "TYPE", "normal")
        live, oldest = listed(raw, JOB)
        assert live == {("w1", "i1"), ("w:2", "i2")} and oldest >= 0
        assert listed(raw, "another-job")[0] == set()
    finally:
        for c in clients:
            c.close()


def test_the_daemons_own_connections_say_redis_did_not_just_restart(
    redis_server: RedisServer,
) -> None:
    """A worker killed in the job's first seconds: its peers' connections are all young, the
    daemon's are not, and that is enough for its absence to be evidence."""
    daemon = redis.Redis.from_url(redis_server.url, client_name="chameleond:d1")
    daemon.ping()
    time.sleep(2.2)
    worker = redis.Redis.from_url(redis_server.url, client_name=connection_name(JOB, "w1", "i1"))
    try:
        worker.ping()
        raw = daemon.execute_command("CLIENT", "LIST", "TYPE", "normal")
        # Ages are whole seconds of Redis's cached clock: one just made may read 1.
        assert listed(raw, JOB)[1] <= 1  # the worker's connection alone: just made
        live, oldest = listed(raw, JOB, "chameleond:d1")
        assert live == {("w1", "i1")} and oldest >= 2
        assert listed(raw, JOB, "chameleond:other")[1] <= 1
    finally:
        worker.close()
        daemon.close()


def peer_process(url: str, worker: str, incarnation: str) -> subprocess.Popen[bytes]:
    """A process holding a worker's named connection, as a real worker's (killed with -9)."""
    code = (
        "import sys, time, redis\n"
        "c = redis.Redis.from_url(sys.argv[1], client_name=sys.argv[2]); c.ping()\n"
        "print('up', flush=True); time.sleep(600)\n"
    )
    name = connection_name(JOB, worker, incarnation)
    proc = subprocess.Popen([sys.executable, "-c", code, url, name], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


@pytest.fixture
def connwatch(redis_server: RedisServer) -> Iterator[None]:
    """The daemon's watch, on its own loop and full-rights client, for the test's duration."""
    stop: list[asyncio.Event] = []
    loop = asyncio.new_event_loop()

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url)
        stop.append(asyncio.Event())
        try:
            await ConnWatch(client, Keys(JOB), PERIOD, Metrics(), RING).run(stop[0])
        finally:
            await client.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    yield
    loop.call_soon_threadsafe(stop[0].set)
    thread.join(10)
    loop.close()


def test_a_worker_without_client_list_learns_of_a_killed_peer_in_time(
    redis_server: RedisServer, connwatch: None
) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", "job-cw", "on", ">pw", *Keys(JOB).acl_rules())
    user_url = redis_server.url.replace("redis://", "redis://job-cw:pw@")
    me = redis.Redis.from_url(user_url, client_name=connection_name(JOB, "w0", "i0"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        me.client_list()  # the worker's user may not list clients, and needs not
    notices = PeerNotices(JOB, RING)
    watcher = PlanWatcher(me, JOB, RING, notices=notices)
    watcher.start()
    peer = peer_process(redis_server.url, "w1", "i1")
    try:
        time.sleep(RECONNECT_SECONDS + 4 * PERIOD)  # connections old enough to be evidence
        assert notices.gone({"w1": "i1"}) == []
        killed = time.monotonic()
        os.kill(peer.pid, signal.SIGKILL)
        found = notices.wait_gone({"w1": "i1"}, timeout=10)
        learned = time.monotonic() - killed
        assert found == ["w1"]
        # Within the wait a survivor gives the notices before it builds the generation again.
        assert learned < NOTICE_WAIT_SECONDS, learned

        # A worker that subscribes later reads the gone incarnations from Keys.gone.
        late = PeerNotices(JOB, RING)
        late_watcher = PlanWatcher(me, JOB, RING, notices=late)
        late_watcher.start()
        assert late.wait_gone({"w1": None}, timeout=10) == ["w1"]
        late_watcher.stop()

        # w1 restarted (a new process): its id is alive again; the old process stays gone.
        peer.wait(5)
        peer = peer_process(redis_server.url, "w1", "i2")
        deadline = time.monotonic() + 10
        while notices.gone({"w1": None}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert notices.gone({"w1": None}) == [] and notices.gone({"w1": "i1"}) == ["w1"]
    finally:
        peer.kill()
        peer.wait(5)
        watcher.stop()
        watcher.join(5)
        me.close()
        admin.close()
