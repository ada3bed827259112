"""Two chameleond processes on one job: one leads, the other stands by (alive, not ready, reading
nothing) and takes over when the leader dies; a daemon whose lease was taken stops without
writing; a clean stop hands the lease over at once."""

from __future__ import annotations

from pathlib import Path

import redis
from daemon_harness import WORKERS, Daemon, Workers, wait_for

from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

KEYS = Keys("default")
# A short lease, so the takeover after kill -9 comes quickly; it must outlast a renewal, so the
# socket timeout (and the read block, at most half of that) go down with it.
LEASE_SECONDS = 3.0
SHORT_LEASE = (
    "--lease-seconds", str(LEASE_SECONDS), "--socket-timeout-seconds", "1.5", "--block-ms", "500"
)  # fmt: skip


def _consumers(r: redis.Redis) -> set[str]:
    return {c["name"] for c in r.xinfo_consumers(KEYS.events, "chameleond")}


def _stamp(entry_id: str) -> tuple[int, ...]:
    return tuple(int(x) for x in entry_id.split("-"))


def test_a_standby_daemon_takes_over_when_the_leader_dies(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    leader = Daemon(redis_server.url, tmp_path, *SHORT_LEASE).start()
    standby = Daemon(redis_server.url, tmp_path, *SHORT_LEASE, "--consumer", "standby")
    workers = Workers(redis_client)
    try:
        leader.wait_ready()
        workers.run_first_plan()
        wait_for(lambda: leader.status()["state"] == "training", 15, "training")
        standby.start()
        wait_for(lambda: standby.get("/readyz")[0] == 503, 15, "the standby's HTTP")
        _, why = standby.get("/readyz")
        assert "standing by: job led by test-daemon" in str(why)
        assert standby.get("/healthz")[0] == 200  # alive: nothing for a supervisor to restart
        assert standby.status()["standby"] is True
        assert standby.metric("chameleon_leader") == 0 and leader.metric("chameleon_leader") == 1

        workers.send(type="fault", worker="w1", cause="ECC error")
        wait_for(lambda: workers.generation() == 2, 15, "generation 2 from the leader")
        assert _consumers(redis_client) == {"test-daemon"}  # the standby read nothing

        leader.kill()  # kill -9: the lease lapses
        standby.wait_ready(timeout=LEASE_SECONDS + 15)
        assert standby.status()["generation"] == 2  # resumed from the leader's commits
        workers.ready(2, [w for w in WORKERS if w != "w1"])
        wait_for(lambda: standby.status()["state"] == "training", 15, "training generation 2")
        workers.send(type="fault", worker="w3", cause="NIC down")
        wait_for(lambda: workers.generation() == 3, 15, "generation 3 from the new leader")
        plan = workers.plan()
        assert plan is not None and sorted(plan["excluded"]) == ["w1", "w3"]

        assert standby.terminate() == 0
        assert redis_client.get(KEYS.leader) is None  # handed over at once, not left to lapse
    finally:
        leader.stop()
        standby.stop()


def test_a_daemon_whose_lease_was_taken_stops_without_writing(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    daemon = Daemon(redis_server.url, tmp_path).start()
    workers = Workers(redis_client)
    try:
        daemon.wait_ready()
        workers.run_first_plan()
        wait_for(lambda: daemon.status()["state"] == "training", 15, "training")
        redis_client.set(KEYS.leader, "elsewhere 1234", px=60_000)  # another daemon leads now
        fault = workers.send(type="fault", worker="w1", cause="ECC error")
        assert daemon.proc is not None
        wait_for(lambda: daemon.proc is not None and daemon.proc.poll() is not None, 20, "exit")
        assert daemon.proc.returncode == 1
        assert "lease lost: elsewhere 1234 leads the job" in daemon.output()
        assert workers.generation() == 1  # it published nothing after losing the lease
        pending = redis_client.xpending_range(KEYS.events, "chameleond", fault, fault, 1)
        delivered = redis_client.xinfo_groups(KEYS.events)[0]["last-delivered-id"]
        assert pending or _stamp(delivered) < _stamp(fault)  # it waits for the daemon that leads
    finally:
        daemon.stop()
