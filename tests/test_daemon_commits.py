"""The commit path against a real Redis: a change made while a commit waits on Redis is committed
next (not lost behind a flag cleared after the wait), a daemon that lost the job's leader lease
cannot write, and a Redis that came back empty gets the job's state written again."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import replace

import pytest
import redis
import redis.asyncio as aioredis

from chameleond.core.decide import decide, initial_plan
from chameleond.core.holdings import of_plan
from chameleond.core.machine import PolicyMachine
from chameleond.core.plandelta import apply_delta
from chameleond.daemon.commits import (
    ACK_SPACING_SECONDS,
    SNAPSHOT_MEASURED_SPACING,
    SNAPSHOT_WAIT_MAX_SECONDS,
    Committer,
)
from chameleond.daemon.config import Config
from chameleond.daemon.lease import Lease, LeaseLost
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.reachability import Reachability
from chameleond.jobs import load_default_spec
from chameleond.jobstate.change import MEASURED, SNAPSHOT
from chameleond.jobstate.job import Job
from chameleond.protocol import CONSUMER_GROUP, Keys, unpacked_plan
from chameleond.records import DecisionRecord
from chameleond.redis_server import RedisServer

KEYS = Keys("t")


def _committer(client: aioredis.Redis, consumer: str = "a") -> Committer:
    metrics = Metrics()
    job = Job("t", load_default_spec(), policy="adaptive", machine=PolicyMachine())
    lease = Lease(client, KEYS, consumer, Config.lease_seconds)
    return Committer(
        client, KEYS, job, metrics, Reachability(metrics), lease, persist_interval_seconds=60
    )


async def _publish_initial(c: Committer) -> None:
    job = c.job
    plan = initial_plan(job.spec, 1)
    async with c.lock:
        job.machine.initial(1, plan.workers, time.time(), of_plan(plan))
        await c.publish(plan, DecisionRecord(1, "initial", "initial plan", time.time()), [])


def _run(server: RedisServer, body: Callable[[aioredis.Redis], Awaitable[None]]) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(server.url, socket_timeout=5.0)
        try:
            await body(client)
        finally:
            await client.aclose()

    asyncio.run(main())


def _pending(r: redis.Redis) -> set[str]:
    """The entries read and not acknowledged."""
    rows = r.xpending_range(KEYS.events, CONSUMER_GROUP, "-", "+", 10)
    return {str(row["message_id"]) for row in rows}


def _read(r: redis.Redis, n: int) -> list[str]:
    """`n` entries added to the job's stream and read by consumer "a", not acknowledged."""
    r.xgroup_create(KEYS.events, CONSUMER_GROUP, id="0", mkstream=True)
    ids = [str(r.xadd(KEYS.events, {"type": "x"})) for _ in range(n)]
    r.xreadgroup(CONSUMER_GROUP, "a", {KEYS.events: ">"})
    return ids


def _snapshot(r: redis.Redis) -> dict[str, object]:
    raw = r.hget(KEYS.state, "snapshot")
    assert raw is not None
    return dict(json.loads(raw))


def test_a_change_made_while_a_commit_waits_goes_into_the_next_commit(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        c.note(SNAPSHOT)
        redis_client.execute_command("CLIENT", "PAUSE", "600", "WRITE")  # Redis is slow to answer
        commit = asyncio.create_task(c.batch([], []))
        await asyncio.sleep(0.2)
        assert not commit.done()  # its snapshot is taken; it waits on Redis
        # A handler runs meanwhile: a checkpoint of every layer at step 7.
        layers = list(range(len(c.job.spec.layers)))
        assert c.job.checkpoints.add(7, layers, 1)
        c.note(SNAPSHOT)
        await commit
        assert c.unsaved.snapshot  # the handler's change is still to be committed...
        assert "7" not in json.dumps(_snapshot(redis_client)["checkpoints"])
        await c.batch([], [])  # ...and the next commit carries it
        assert _snapshot(redis_client)["checkpoints"] == c.job.checkpoints.to_json()

    _run(redis_server, body)


def test_a_daemon_without_the_lease_cannot_commit(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async def body(client: aioredis.Redis) -> None:
        leader, other = _committer(client, "a"), _committer(client, "b")
        assert await leader.lease.acquire(asyncio.Event(), lambda holder: None)
        await _publish_initial(leader)
        before = redis_client.hgetall(KEYS.state)
        other.note(SNAPSHOT)
        with pytest.raises(LeaseLost, match="lease lost: a "):
            await other.batch(["0-1"], [], force_progress=True)
        assert redis_client.hgetall(KEYS.state) == before  # nothing of it was written
        # A standby finds the lease held, and takes it once the leader gives it up.
        held: list[str] = []
        stop = asyncio.Event()
        standby = asyncio.create_task(other.lease.acquire(stop, held.append))
        await asyncio.sleep(0.1)
        assert not standby.done() and held and held[0].startswith("a ")
        await leader.lease.release()
        assert await asyncio.wait_for(standby, 10)
        with pytest.raises(LeaseLost):
            await leader.batch([], [], force_progress=True)

    _run(redis_server, body)


def test_a_redis_that_came_back_empty_gets_the_state_written_again(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        await _publish_initial(c)
        plan = redis_client.get(KEYS.plan)
        redis_client.flushall()  # a restart without persistence, or a failover that lost it
        c.note(SNAPSHOT)
        await c.batch([], [], force_progress=True)
        assert redis_client.hget(KEYS.state, "generation") == "1"
        assert redis_client.get(KEYS.plan) == plan
        assert _snapshot(redis_client)["machine"] == c.job.machine.snapshot()
        assert redis_client.hexists(KEYS.state, "base_spec")
        assert redis_client.get(KEYS.leader) == c.lease.token

    _run(redis_server, body)


def test_a_batch_waits_unacknowledged_for_a_snapshot_too_costly_to_make_again_at_once(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A large job's snapshot is made at most every few times its cost: a batch that changed the
    job meanwhile is acknowledged only by the commit of the snapshot that holds its change."""
    first, second = _read(redis_client, 2)

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        c.note(SNAPSHOT)
        await c.batch([first], [])
        assert _pending(redis_client) == {second}
        c._snapshot_cost = 1.0  # as a snapshot of thousands of workers takes
        layers = list(range(len(c.job.spec.layers)))
        assert c.job.checkpoints.add(7, layers, 1)
        c.note(SNAPSHOT)
        await c.batch([second], [])
        assert _pending(redis_client) == {second} and c.held() == {second}
        assert "7" not in json.dumps(_snapshot(redis_client)["checkpoints"])
        await c.batch([], [])  # too soon still: nothing is written
        assert _pending(redis_client) == {second}
        await asyncio.sleep(SNAPSHOT_WAIT_MAX_SECONDS)
        await c.batch([], [])  # the housekeeping tick's commit: the snapshot and its entries
        assert _pending(redis_client) == set() and not c.held()
        assert _snapshot(redis_client)["checkpoints"] == c.job.checkpoints.to_json()

    _run(redis_server, body)


def test_behind_a_backlog_a_costly_snapshot_waits_for_the_daemons_own_work(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Behind a backlog the spacing is the daemon's CPU time: time passing while the daemon gets
    no CPU (other processes hold the cores) brings the next snapshot no nearer; its work on the
    events does. Without a backlog it is the wall time, as before."""
    first, second = _read(redis_client, 2)

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        c.note(SNAPSHOT)
        await c.batch([first], [])  # a snapshot
        c._snapshot_cost, c._snapshot_cpu = 1.0, 0.05  # 1 s of wall time, 50 ms of CPU
        c._snapshot_at -= SNAPSHOT_WAIT_MAX_SECONDS  # as long ago as the wall time allows
        c.note(SNAPSHOT)
        await c.batch([second], [], behind=True)
        assert c.held() == {second}  # the daemon did no work since: it waits
        assert c._snapshot_spaced(behind=False)
        spun = time.process_time() + 4 * c._snapshot_cpu
        while time.process_time() < spun:  # the daemon at work on the backlog
            pass
        await c.batch([], [], behind=True)
        assert not c.held() and _pending(redis_client) == set()

    _run(redis_server, body)


def test_measurements_alone_wait_longer_for_a_costly_snapshot_and_are_acknowledged_meanwhile(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Measurements alone (a large job's profiles move them with nearly every batch) ride with
    the progress, but a costly snapshot for them waits SNAPSHOT_MEASURED_SPACING times its cost;
    their batches are acknowledged with the progress meanwhile (the workers send them again)."""
    ids = _read(redis_client, 3)

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        c.persist_interval_seconds = 0.0  # the progress is due with every batch
        c.note(SNAPSHOT)
        await c.batch([ids[0]], [])  # a snapshot
        c._snapshot_cost = 1.0  # as a snapshot of thousands of workers takes
        c._snapshot_at -= SNAPSHOT_WAIT_MAX_SECONDS  # long enough ago for a change that named it
        c.job.started = 1234.5  # in the snapshot: shows whether one was written
        c.note(MEASURED)
        await c.batch([ids[1]], [])
        assert _pending(redis_client) == {ids[2]} and not c.held()  # acknowledged, with progress
        assert _snapshot(redis_client)["started"] != 1234.5  # no snapshot for the measurements
        c._snapshot_at -= SNAPSHOT_MEASURED_SPACING * c._snapshot_cost
        await c.batch([ids[2]], [])
        assert _pending(redis_client) == set() and _snapshot(redis_client)["started"] == 1234.5

    _run(redis_server, body)


def test_batches_that_only_acknowledge_are_committed_together_soon_after(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A batch whose commit would carry acknowledgements alone, right after a commit, waits for
    the next one, which comes ACK_SPACING_SECONDS later at most; one with a durable change is
    committed at once, with those before it."""
    ids = _read(redis_client, 4)

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        c.note(SNAPSHOT)
        await c.batch([ids[0]], [])  # a commit: its snapshot
        await c.batch([ids[1]], [])  # acknowledgements alone, just after it: later
        assert _pending(redis_client) == set(ids[1:]) and c.held() == {ids[1]}
        await asyncio.sleep(3 * ACK_SPACING_SECONDS)  # committed by the flush
        assert _pending(redis_client) == set(ids[2:]) and not c.held()
        await c.batch([ids[2]], [])
        c.note(SNAPSHOT)
        await c.batch([ids[3]], [])  # a change: committed at once, with the one before
        assert _pending(redis_client) == set() and not c.held()

    _run(redis_server, body)


def test_a_batch_that_only_acknowledges_never_waits_for_a_commit(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """The read loop awaits no commit for acknowledgements alone: not one of its own, also long
    after the last commit, and not one on its way under the lock (a decision's); they go with
    the flush's commit once the lock is free."""
    ids = _read(redis_client, 2)

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        await c.batch([], [], force_progress=True)  # the progress: next due in a minute
        await asyncio.sleep(2 * ACK_SPACING_SECONDS)  # long after that commit
        await c.batch([ids[0]], [])
        assert _pending(redis_client) == set(ids) and c.held() == {ids[0]}  # not committed here
        async with c.lock:  # a decision's commit on its way
            await asyncio.wait_for(c.batch([ids[1]], []), timeout=ACK_SPACING_SECONDS)
            await asyncio.sleep(3 * ACK_SPACING_SECONDS)
            assert _pending(redis_client) == set(ids)  # the flush waits for the lock
        await asyncio.sleep(3 * ACK_SPACING_SECONDS)
        assert _pending(redis_client) == set() and not c.held()

    _run(redis_server, body)


def test_while_a_fault_waits_for_its_decision_batches_wait_for_the_plans_snapshot(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A costly snapshot is not made between a fault and its plan: the batches handled meanwhile
    are acknowledged by the commit that publishes the plan, with the snapshot it carries."""
    (entry,) = _read(redis_client, 1)

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        await _publish_initial(c)
        job = c.job
        c._snapshot_cost = 0.1  # spaced by 0.4 s when no decision is on its way
        job.machine.fault("w1", "peer process gone", time.time())
        await asyncio.sleep(4 * c._snapshot_cost)
        c.note(SNAPSHOT)
        await c.batch([entry], [])
        assert c.held() == {entry}  # waits for the plan
        plan = decide(job.spec, job.plan, ["w1"], mtbf_seconds=3600.0, generation=2).plan
        assert plan is not None
        async with c.lock:
            job.machine.next_request(time.time())
            await c.publish(plan, DecisionRecord(2, "reroute", "w1 lost", time.time()), [])
        assert not c.held()
        rows = redis_client.xpending_range(KEYS.events, CONSUMER_GROUP, "-", "+", 10)
        assert rows == []
        job.machine.pending_faults.clear()
        job.machine.in_flight = None
        await asyncio.sleep(4 * c._snapshot_cost)
        c.note(SNAPSHOT)
        assert c._snapshot_spaced(behind=False)  # nothing on its way: spaced as before

    _run(redis_server, body)


def test_a_plan_is_published_with_its_delta_from_the_plan_before(
    redis_server: RedisServer,
) -> None:
    """The second plan's commit writes its delta from the first (what a worker holding the first
    reads); a plan with no plan before it, one too unlike it, or one with other pipelines (a
    re-partition) deletes the delta."""

    raw = redis.Redis.from_url(redis_server.url)  # the packed keys are bytes

    async def body(client: aioredis.Redis) -> None:
        c = _committer(client)
        await _publish_initial(c)
        assert raw.get(KEYS.plan_delta) is None  # nothing before the first
        first = json.loads(raw.get(KEYS.plan) or b"")
        job = c.job
        assert job.plan is not None
        lost = job.plan.workers[-1]
        async with c.lock:
            second = replace(job.plan, generation=2, excluded=(lost,), cause=f"{lost} lost")
            await c.publish(second, DecisionRecord(2, "reroute", "x", time.time()), [])
        packed = raw.get(KEYS.plan_delta)
        assert packed is not None
        delta = json.loads(zlib.decompress(packed))
        made = apply_delta(first, delta)
        assert made == json.loads(raw.get(KEYS.plan) or b"")
        assert made["excluded"] == [lost] and len(packed) * 2 < len(
            raw.get(KEYS.plan_packed) or b""
        )
        # A plan whose changes are most of it (here a long cause) goes whole.
        async with c.lock:
            unlike = replace(second, generation=3, excluded=(), cause=secrets.token_hex(4000))
            await c.publish(unlike, DecisionRecord(3, "dynamic", "x", time.time()), [])
        assert raw.get(KEYS.plan_delta) is None
        # A fourth like the second, then a plan with other pipelines (its pipelines' micro-batches
        # swapped: a small change, and still a re-partition) goes whole too.
        async with c.lock:
            fourth = replace(second, generation=4)
            await c.publish(fourth, DecisionRecord(4, "reroute", "x", time.time()), [])
            assert raw.get(KEYS.plan_delta) is not None
            a, b, *rest = fourth.pipelines
            swapped = (
                replace(a, first_micro_batch=b.first_micro_batch),
                replace(b, first_micro_batch=a.first_micro_batch),
                *rest,
            )
            other = replace(fourth, generation=5, pipelines=swapped)
            await c.publish(other, DecisionRecord(5, "dynamic", "x", time.time()), [])
        assert raw.get(KEYS.plan_delta) is None
        assert unpacked_plan(raw.get(KEYS.plan_packed) or b"")["pipelines"][0][
            "first_micro_batch"
        ] == (b.first_micro_batch)

    try:
        _run(redis_server, body)
    finally:
        raw.close()
