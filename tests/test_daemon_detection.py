"""Detection on evidence, with chameleond as a real process on a real Redis: registrations from
outside the spec that no profile follows expire and are never planned, however many come; a
worker that finished is reported finished and is never suspected, however long it stays silent;
a worker that stopped heartbeating before a peer reported it is named dead, not fenced; a daemon
behind its stream declares nobody failed for the heartbeats it has not read yet."""

from __future__ import annotations

import json
import threading
import time

import redis
from daemon_harness import WORKERS, RunningJob, signed, wait_for

from chameleond.jobs import load_default_spec
from chameleond.jobstate.jobspec import profile_to_json
from chameleond.jobstate.records import UNCONFIRMED_MAX
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

KEYS = Keys("default")
PHANTOMS = 300
FLOOD = 300_000  # events: several seconds of handling
PROFILE = json.dumps({"layers": profile_to_json(dict(enumerate(load_default_spec().layers)))})


def test_phantom_registrations_expire_and_are_never_planned(
    redis_client: redis.Redis, running_job: RunningJob
) -> None:
    daemon = running_job.start_training("--registration-ttl-seconds", "2")
    workers = running_job.workers
    with redis_client.pipeline(transaction=False) as p:
        for i in range(PHANTOMS):
            fields = {"type": "register", "worker": f"ghost{i}", "host": "h",
                      "memory_bytes": str(2**34)}  # fmt: skip
            p.xadd(KEYS.events, signed(fields))  # type: ignore[arg-type]
        p.execute()
    # Beyond the bound they are refused at once, with the reason, and nothing is lost.
    wait_for(lambda: redis_client.xlen(KEYS.dead) == PHANTOMS - UNCONFIRMED_MAX, 15, "refused")
    reason = redis_client.xrange(KEYS.dead, count=1)[0][1]["error"]
    assert "registrations already wait for their profile" in reason
    assert len(daemon.status()["registrations_waiting"]) == UNCONFIRMED_MAX
    # A rejoin from one of them is refused too: it never became a worker of the job.
    workers.send(type="rejoin", worker="ghost0")
    wait_for(lambda: redis_client.xlen(KEYS.dead) == PHANTOMS - UNCONFIRMED_MAX + 1, 15, "rej")
    wait_for(lambda: daemon.status()["registrations_waiting"] == [], 15, "expired")
    # A decision after all that plans with the spec's workers only.
    workers.send(type="fault", worker="w1", cause="ECC error")
    wait_for(lambda: workers.generation() == 2, 15, "generation 2")
    plan = workers.plan()
    assert plan is not None
    planned = {st["worker"] for pipe in plan["pipelines"] for st in pipe["stages"]}
    planned |= {w for pipe in plan["routing"] for stage in pipe for w in stage}
    assert planned <= set(WORKERS), planned
    assert not any(w.startswith("ghost") for w in daemon.status()["workers"])
    decision = [d for d in workers.decisions() if d.get("kind") == "decision"][-1]
    assert "ghost" not in decision["joined"]
    # A real newcomer (register, then profile) is taken in by a later decision.
    workers.send(type="register", worker="x1", host="localhost", memory_bytes=2**31)
    workers.send(type="profile", worker="x1", data=PROFILE)
    wait_for(lambda: "x1" in daemon.status()["workers"], 15, "x1 confirmed")


def test_a_finished_worker_is_never_suspected_and_a_dead_one_is_named_dead(
    redis_server: RedisServer, redis_client: redis.Redis, running_job: RunningJob
) -> None:
    # Nothing trimmed: on a slow machine w5 is suspected before the flood, whose 300,000 entries
    # would push its fault past the stream's default maxlen.
    daemon = running_job.daemon(
        "--heartbeat-timeout-seconds", "1", "--policy", "reroute", "--stream-maxlen", "1000000"
    ).start()
    workers = running_job.workers
    beating = set(WORKERS)
    stop = threading.Event()

    def heartbeats() -> None:
        client = redis.Redis.from_url(redis_server.url)
        while not stop.wait(0.2):
            for w in sorted(beating):
                client.xadd(KEYS.events, signed({"type": "heartbeat", "worker": w}))  # type: ignore[arg-type]
        client.close()

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    try:
        daemon.wait_ready()
        running_job.train(daemon)
        # w2 finishes its steps and exits: it says so, then goes silent.
        workers.send(type="ack", worker="w2", generation=1, phase="stopped", reason="finished")
        beating.discard("w2")
        wait_for(lambda: daemon.status()["workers"]["w2"]["state"] == "finished", 10, "finished")
        # w4 is killed: silent at once, and a peer names it before any timeout runs out.
        beating.discard("w4")
        workers.send(type="fault", worker="w4", cause="peer gone", generation=1)
        wait_for(lambda: workers.generation() == 2, 15, "generation 2")
        w4 = daemon.status()["workers"]["w4"]
        assert w4["state"] == "failed" and w4["liveness"] == "dead", w4
        time.sleep(3.0)  # three heartbeat timeouts of silence from w2
        status = daemon.status()
        assert status["workers"]["w2"]["state"] == "finished", status["workers"]["w2"]
        assert status["workers"]["w2"]["liveness"] == "stopped"
        assert "w2" not in status["failed"] and "w2" not in status["pending_faults"]
        faults = [f for _, f in redis_client.xrange(KEYS.events) if f["type"] == "fault"]
        assert [f["worker"] for f in faults] == ["w4"]  # the detector suspected nobody
        log = daemon.output()
        assert "w4 is dead" in log and "fenced w4" not in log and "suspect w2" not in log
    finally:
        stop.set()
        thread.join()


def test_a_backlog_longer_than_the_heartbeat_timeout_declares_only_the_silent_worker_failed(
    redis_server: RedisServer, redis_client: redis.Redis, running_job: RunningJob
) -> None:
    """The daemon falls behind its stream by several heartbeat timeouts: the live workers'
    heartbeats wait in the backlog behind a flood of events, and none of them is declared
    failed for it; w5, silent since before the flood, is."""
    # Nothing trimmed: on a slow machine w5 is suspected before the flood, whose 300,000 entries
    # would push its fault past the stream's default maxlen.
    daemon = running_job.daemon(
        "--heartbeat-timeout-seconds", "1", "--policy", "reroute", "--stream-maxlen", "1000000"
    ).start()
    workers = running_job.workers
    beating = set(WORKERS)
    stop = threading.Event()

    def heartbeats() -> None:
        client = redis.Redis.from_url(redis_server.url)
        while not stop.wait(0.2):
            for w in sorted(beating):
                client.xadd(KEYS.events, signed({"type": "heartbeat", "worker": w}))  # type: ignore[arg-type]
        client.close()

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    try:
        daemon.wait_ready()
        running_job.train(daemon)
        beating.discard("w5")  # killed: silent from now on
        # A flood of events (one worker's repeated reports), written faster than the daemon
        # handles them: everything sent after it waits behind it.
        flood = signed({"type": "heartbeat", "worker": "w0"})
        flooded = time.monotonic()
        with redis_client.pipeline(transaction=False) as p:
            for _ in range(FLOOD):
                p.xadd(KEYS.events, flood)  # type: ignore[arg-type]
            last = _stamp(p.execute()[-1])

        def caught_up() -> bool:
            (group,) = redis_client.xinfo_groups(KEYS.events)
            return _stamp(group["last-delivered-id"]) >= last and not group["pending"]

        wait_for(caught_up, 120, "the daemon caught up with its stream")
        behind = time.monotonic() - flooded
        assert behind > 3.0, f"the backlog lasted {behind:.1f} s: not over the 1 s timeout"
        wait_for(lambda: workers.generation() == 2, 15, "the plan without w5")
        time.sleep(1.5)  # more than a timeout after catching up: a false suspicion shows now
        suspected = _faults(redis_client)
        assert set(suspected) == {"w5"}, suspected  # (again while its first waited unread)
        plan = workers.plan()
        assert plan is not None and plan["excluded"] == ["w5"]
        assert "heartbeat lapse" in daemon.status()["last_decision"]["cause"]
    finally:
        stop.set()
        thread.join()


def _faults(r: redis.Redis) -> list[str]:
    """The workers named in the stream's faults, read a page at a time: the reply of one XRANGE
    over the 300,000 entries is parsed in one call that holds the interpreter for seconds, and
    the beating thread's workers, silent meanwhile, were declared failed for it."""
    named, start = [], "-"
    while page := r.xrange(KEYS.events, start, "+", count=10_000):
        named += [f["worker"] for _, f in page if f.get("type") == "fault"]
        start = "(" + page[-1][0]
    return named


def _stamp(entry_id: str | bytes) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)
