"""chameleond as a real subprocess on a real redis-server: faults typed with the real redis-cli
become plans with higher generations and decision records; detection, fencing, rejoin, SIGTERM."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any

import redis
from daemon_harness import WORKERS, Daemon, RunningJob, Workers, signed, wait_for

from chameleond.redis_server import RedisServer, redis_binary


def redis_cli(server: RedisServer, *args: str) -> str:
    cmd = [redis_binary("redis-cli"), "-h", server.host, "-p", str(server.port), *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10).stdout


def test_fault_from_redis_cli_publishes_a_higher_generation_with_a_decision_record(
    running_job: RunningJob, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    daemon = running_job.start()
    workers = running_job.workers
    assert daemon.get("/api/v1/plan")[0] == 404  # no plan before the workers registered
    spec = json.loads(redis_client.get("chameleon:default:spec") or "{}")
    assert spec["model"]["arch"]["d_model"] > 0  # workers build the model from the stored spec
    running_job.train(daemon)
    pubsub = redis_client.pubsub()
    pubsub.subscribe("chameleon:default:plans")

    # As `chameleonctl inject --print-only` prints it: the event with its signature.
    sig = signed({"type": "fault", "worker": "w3", "cause": "ECC error"})["sig"]
    redis_cli(redis_server, "XADD", "chameleon:default:events", "*",
              "type", "fault", "worker", "w3", "cause", "ECC error", "sig", sig)  # fmt: skip
    wait_for(lambda: workers.generation() == 2, 15, "generation 2")

    plan = workers.plan()
    assert plan is not None and "w3" in plan["excluded"] and "w3" not in json.dumps(plan["routing"])
    messages = [m for m in iter(lambda: pubsub.get_message(timeout=1.0), None) if m]
    # "2" once for the plan, maybe again as a nudge to the fenced (still heartbeating) w3.
    assert {m["data"] for m in messages if m["type"] == "message"} == {"2"}
    decision = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
    assert decision["generation"] == "2" and "ECC error" in decision["cause"]
    candidates = json.loads(decision["candidates"])
    assert [c["policy"] for c in candidates] == ["reroute", "dynamic", "drop"]
    weighed = candidates[:2]  # the job's batch is fixed: drop is never feasible
    assert not candidates[2]["feasible"] and "global batch is fixed" in candidates[2]["reason"]
    assert all(c["score"] > 0 for c in weighed) and float(decision["mtbf_seconds"]) > 0
    assert decision["selected"] == plan["policy"]
    transitions = [(d["from"], d["to"]) for d in workers.decisions() if d["kind"] == "transition"]
    assert transitions[-3:] == [
        ("training", "fault_detected"), ("fault_detected", "planning"),
        ("planning", "transitioning"),
    ]  # fmt: skip

    status = daemon.status()
    assert status["generation"] == 2 and status["state"] == "transitioning"
    assert len(status["last_decision"]["candidates"]) == 3
    assert daemon.get("/api/v1/plan")[1]["generation"] == 2
    assert redis_client.xpending("chameleon:default:events", "chameleond")["pending"] == 0

    # The same fault again (an operator repeating it, or a redelivery): no second plan.
    # As `chameleonctl inject --print-only` prints it: the event with its signature.
    sig = signed({"type": "fault", "worker": "w3", "cause": "ECC error"})["sig"]
    redis_cli(redis_server, "XADD", "chameleon:default:events", "*",
              "type", "fault", "worker", "w3", "cause", "ECC error", "sig", sig)  # fmt: skip
    wait_for(lambda: daemon.metric('chameleon_events_total{outcome="duplicate",type="fault"}'))
    assert workers.generation() == 2
    assert daemon.metric("chameleon_plan_generation") == 2
    assert daemon.metric('chameleon_policy_decisions_total{policy="initial"}') == 1
    assert daemon.metric("chameleon_decision_seconds_count") == 1

    # Every worker of generation 2 commits a step: the recovery is measured.
    workers.ready(2, [w for w in WORKERS if w != "w3"])
    for w in WORKERS:
        if w != "w3":
            workers.send(type="step", worker=w, generation=2, step=0, samples=12,
                         seconds=0.25, loss=5.0)  # fmt: skip
    policy = plan["policy"]
    wait_for(lambda: daemon.metric(f'chameleon_recovery_seconds_count{{policy="{policy}"}}'))
    assert daemon.metric("chameleon_training_throughput_samples_per_second") == 12 / 0.25
    assert daemon.status()["state"] == "training"
    # The heap was settled at start, and again once the newest plan was acknowledged by all and
    # trains (daemon/heap.py; a plan replaced within a housekeeping tick may have had none).
    wait_for(lambda: daemon.metric("chameleon_heap_settle_seconds_count") >= 2, 10,
             "the heap settled after the newest plan")  # fmt: skip
    # Generation 2 trains: the search tables were prepared for its next fault, once (generation
    # 1 never committed a step: nothing was prepared for it).
    wait_for(lambda: daemon.metric("chameleon_prepare_seconds_count") == 1, 10,
             "the search tables prepared")  # fmt: skip
    time.sleep(2.5)  # two housekeeping ticks: nothing changed, nothing prepared again
    assert daemon.metric("chameleon_prepare_seconds_count") == 1
    assert daemon.terminate() == 0
    assert "stopped job=default generation=2" in daemon.output()


def test_heartbeat_lapse_ack_timeout_and_fencing(
    running_job: RunningJob, redis_server: RedisServer
) -> None:
    daemon = running_job.start(
        "--heartbeat-timeout-seconds", "1.5", "--ready-timeout-seconds", "3", "--policy", "reroute"
    )
    workers = running_job.workers
    beating = set(WORKERS) - {"w4"}  # w4 never heartbeats: its lapse is a fault
    stop = threading.Event()

    def heartbeats() -> None:
        client = redis.Redis.from_url(redis_server.url)
        while not stop.wait(0.3):
            for w in sorted(beating):
                client.xadd("chameleon:default:events", signed({"type": "heartbeat", "worker": w}))
        client.close()

    thread = threading.Thread(target=heartbeats, daemon=True)
    thread.start()
    try:
        running_job.train(daemon)
        wait_for(lambda: workers.generation() == 2, 15, "generation 2 after w4's lapse")
        plan = workers.plan()
        assert plan is not None and plan["excluded"] == ["w4"] and plan["policy"] == "reroute"
        fault = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
        assert "heartbeat lapse" in fault["cause"]
        # w5 never acknowledges generation 2 but keeps heartbeating: declared failed, fenced.
        workers.ready(2, [w for w in WORKERS if w not in ("w4", "w5")])
        wait_for(lambda: workers.generation() == 3, 15, "generation 3 after w5's silence")
        plan = workers.plan()
        assert plan is not None and set(plan["excluded"]) == {"w4", "w5"}
        causes = [d["cause"] for d in workers.decisions() if d["kind"] == "decision"]
        assert "did not acknowledge generation 2" in causes[-1]
        wait_for(lambda: daemon.status()["workers"]["w5"]["state"] == "fenced", 5, "w5 fenced")
        assert daemon.status()["workers"]["w4"]["state"] == "failed"
        workers.send(type="ack", worker="w5", generation=3, phase="stopped")
        wait_for(lambda: daemon.status()["workers"]["w5"]["state"] == "stopped", 5, "w5 stopped")
    finally:
        stop.set()
        thread.join()


def w1_lost_then_back(job: RunningJob, *args: str) -> tuple[Daemon, Workers]:
    """A training job loses w1 (generation 2, acknowledged), then w1 rejoins."""
    daemon = job.start_training(*args)
    workers = job.workers
    workers.send(type="fault", worker="w1", cause="power")
    wait_for(lambda: workers.generation() == 2, 15, "generation 2")
    workers.ready(2, [w for w in WORKERS if w != "w1"])
    wait_for(lambda: daemon.status()["state"] == "training", 15, "training")
    workers.send(type="rejoin", worker="w1")
    return daemon, workers


def test_rejoin_takes_a_repaired_worker_back(
    running_job: RunningJob, redis_client: redis.Redis
) -> None:
    daemon, workers = w1_lost_then_back(running_job, "--policy", "dynamic")
    wait_for(lambda: workers.generation() == 3, 15, "generation 3")
    plan = workers.plan()
    assert plan is not None and "w1" not in plan["excluded"]
    assert any(st["worker"] == "w1" for p in plan["pipelines"] for st in p["stages"])
    decision = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
    assert json.loads(decision["joined"]) == ["w1"] and "w1 rejoined" in decision["cause"]
    # How long w1 was out is durable: it feeds the window to the next fault or return
    # (selector.window_seconds), and a restarted daemon reads it back.
    stored = json.loads(redis_client.hget("chameleon:default:state", "snapshot") or "{}")
    ((went_out, repair),) = stored["repairs"]
    assert 0 < repair < 60 and went_out > 0 and stored["workers"]["w1"]["down_since"] == 0.0
    status = daemon.status()
    assert 0 < status["window_seconds"] <= status["mtbf_seconds"]
    daemon.kill()
    again = running_job.start()
    wait_for(lambda: again.status()["generation"] == 3, 15, "the restarted daemon at generation 3")
    workers.send(type="fault", worker="w3", cause="power")  # its commit writes a new snapshot
    wait_for(lambda: workers.generation() == 4, 15, "generation 4")
    stored = json.loads(redis_client.hget("chameleon:default:state", "snapshot") or "{}")
    assert stored["machine"]["generation"] == 4
    assert stored["repairs"] == [[went_out, repair]] and stored["workers"]["w3"]["down_since"] > 0


def test_under_reroute_a_returning_worker_takes_its_own_slot_back(running_job: RunningJob) -> None:
    """ReCycle's rejoin: the rerouted layout is kept, and w1, back, runs its own slot again,
    receiving its layers from a peer (it is a new process: it holds nothing)."""
    _, workers = w1_lost_then_back(running_job, "--policy", "reroute")
    wait_for(lambda: workers.generation() == 3, 15, "generation 3")
    third = workers.plan()
    assert third is not None and third["policy"] == "reroute" and "w1" not in third["excluded"]
    slots = [st for p in third["pipelines"] for st in p["stages"] if st["worker"] == "w1"]
    executors = {w for pipe in third["routing"] for row in pipe for w in row}
    assert slots and "w1" in executors
    received = {layer for t in third["migration"] if t["dst"] == "w1" for layer in t["layers"]}
    assert received == {x for st in slots for x in range(st["first_layer"], st["end_layer"])}


def w1_planned_back(job: RunningJob) -> tuple[Daemon, Workers, set[str]]:
    """w1 is lost (generation 2 acknowledged and committed), then rejoins and generation 3 plans
    it back with layers it must receive (policy dynamic). Returns the daemon, the workers and
    those that held (after generation 2's commit) some layer w1 is to receive."""
    daemon = job.start_training("--policy", "dynamic")
    workers = job.workers
    workers.send(type="fault", worker="w1", cause="power")
    wait_for(lambda: workers.generation() == 2, 15, "generation 2")
    second = workers.plan()
    assert second is not None
    running = [w for w in WORKERS if w != "w1"]
    workers.ready(2, running)
    for w in running:  # a step of generation 2 commits: its owners hold exactly their layers
        workers.send(type="step", worker=w, generation=2, step=0, samples=8, seconds=0.1, loss=5)
    wait_for(lambda: daemon.status()["state"] == "training", 15, "training")
    workers.send(type="rejoin", worker="w1")
    wait_for(lambda: workers.generation() == 3, 15, "generation 3")
    third = workers.plan()
    assert third is not None
    received = {layer for t in third["migration"] if t["dst"] == "w1" for layer in t["layers"]}
    assert received, "generation 3 gives w1 layers to receive"
    holders = {
        st["worker"]
        for p in second["pipelines"]
        for st in p["stages"]
        if st["worker"] not in second["excluded"]
        and received & set(range(st["first_layer"], st["end_layer"]))
    }
    return daemon, workers, holders


def test_a_receiver_that_never_acknowledged_holds_nothing_when_its_sources_die(
    running_job: RunningJob,
) -> None:
    daemon, workers, holders = w1_planned_back(running_job)
    # Every copy of the layers w1 was to receive dies before w1's ack, at once.
    workers.send_together(
        [{"type": "fault", "worker": w, "cause": "preempted"} for w in sorted(holders)]
    )
    wait_for(lambda: daemon.status()["state"] == "unrecoverable", 15, "unrecoverable")
    assert workers.generation() == 3  # no plan on a w1 that holds nothing
    last = [d for d in workers.decisions() if d["kind"] == "decision"][-1]
    assert "lost every replica" in last["unrecoverable"]


def test_a_receiver_that_acknowledged_holds_its_layers_when_its_sources_die(
    running_job: RunningJob,
) -> None:
    daemon, workers, holders = w1_planned_back(running_job)
    workers.ready(3, ["w1"])  # w1 finished the migration: it holds the layers now
    wait_for(lambda: "w1" not in daemon.status().get("awaiting_ready", ["w1"]), 15, "w1's ack")
    workers.send_together(
        [{"type": "fault", "worker": w, "cause": "preempted"} for w in sorted(holders)]
    )

    def without_sources() -> dict[str, Any] | None:
        plan = workers.plan()
        return plan if plan and holders <= set(plan["excluded"]) else None

    plan = wait_for(without_sources, 15, "a plan without every source")
    assert "w1" in json.dumps(plan["routing"])  # w1 trains on what it received
    assert daemon.status()["state"] != "unrecoverable"
