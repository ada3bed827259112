"""Two chameleond processes on one job: one leads, the other stands by (alive, not ready, reading
nothing) and takes over when the leader dies; a daemon whose lease was taken stops without
writing; a clean stop hands the lease over at once."""

from __future__ import annotations

import signal
import time

import redis
from daemon_harness import Generations, RunningJob, Workers, wait_for

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
    redis_client: redis.Redis, running_job: RunningJob
) -> None:
    leader = running_job.start_training(*SHORT_LEASE)
    standby = running_job.daemon(*SHORT_LEASE, "--consumer", "standby")
    workers = running_job.workers
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
    running_job.next_fault(standby, 2, ["w1"], "w3")  # generation 3, from the new leader

    assert standby.terminate() == 0
    assert redis_client.get(KEYS.leader) is None  # handed over at once, not left to lapse


def test_a_daemon_whose_lease_was_taken_stops_without_writing(
    redis_client: redis.Redis, running_job: RunningJob
) -> None:
    daemon = running_job.start_training()
    workers = running_job.workers
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


def _decisions_for(workers: Workers, generation: int) -> list[dict[str, str]]:
    return [
        d
        for d in workers.decisions()
        if d.get("kind") == "decision" and d.get("generation") == str(generation)
    ]


def test_the_leader_killed_mid_decision_hands_over_within_the_lease(
    redis_server: RedisServer, redis_client: redis.Redis, running_job: RunningJob
) -> None:
    """kill -9 while a fault's decision is held: the standby sees the leader's connections gone,
    takes the lease before it lapses, claims the fault left in flight at once (not after
    claim_idle_seconds) and answers it with exactly one plan."""
    lease = "4"
    args = ("--lease-seconds", lease, "--socket-timeout-seconds", "2", "--block-ms", "500")
    leader = running_job.start_training(*args, "--decision-delay-seconds", "30")
    standby = running_job.daemon(*args, "--consumer", "standby")
    workers = running_job.workers
    seen = Generations(redis_server.url)
    try:
        standby.start()
        wait_for(lambda: standby.get("/readyz")[0] == 503, 15, "the standby's HTTP")
        fault = workers.send(type="fault", worker="w1", cause="ECC error")
        wait_for(lambda: leader.status()["state"] == "planning", 15, "the leader deciding")
        held = redis_client.xpending_range(KEYS.events, "chameleond", fault, fault, 1)
        assert held and held[0]["consumer"] == "test-daemon"  # in flight at the leader

        leader.kill()
        killed = time.monotonic()
        wait_for(lambda: standby.get("/readyz")[0] == 200, 30, "the standby taking over")
        takeover = time.monotonic() - killed
        wait_for(lambda: workers.generation() == 2, 30, "generation 2 from the standby")
        planned = time.monotonic() - killed
        assert takeover < float(lease), f"took over {takeover:.2f} s after the kill"
        assert planned < float(lease), f"first plan {planned:.2f} s after the kill"

        plan = workers.plan()
        assert plan is not None and plan["excluded"] == ["w1"]
        answered = _decisions_for(workers, 2)
        assert len(answered) == 1 and "w1" in answered[0]["faults"]
        assert not redis_client.xpending_range(KEYS.events, "chameleond", fault, fault, 1)
        time.sleep(1.0)
        assert workers.generation() == 2 and seen.seen.count(2) >= 1 and 3 not in seen.seen
        assert "claimed 1 in-flight entries" in standby.output()
    finally:
        seen.close()


def test_a_stalled_leader_that_wakes_up_after_the_takeover_decides_nothing(
    running_job: RunningJob,
) -> None:
    """SIGSTOP keeps the leader's connections open, so the standby waits for the lease to lapse;
    the old leader, resumed after the takeover with its decision in hand, cannot commit it: the
    fault is answered once, by the new leader."""
    args = ("--lease-seconds", "3", "--socket-timeout-seconds", "1.5", "--block-ms", "500")
    leader = running_job.start_training(*args, "--decision-delay-seconds", "2")
    standby = running_job.daemon(*args, "--consumer", "standby")
    workers = running_job.workers
    standby.start()
    wait_for(lambda: standby.get("/readyz")[0] == 503, 15, "the standby's HTTP")
    workers.send(type="fault", worker="w1", cause="ECC error")
    wait_for(lambda: leader.status()["state"] == "planning", 15, "the leader deciding")
    assert leader.proc is not None
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: workers.generation() == 2, 30, "generation 2 from the standby")
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: leader.proc is not None and leader.proc.poll() is not None, 30, "exit")
    assert leader.proc.returncode == 1
    assert len(_decisions_for(workers, 2)) == 1 and workers.generation() == 2
