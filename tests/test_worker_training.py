"""Real training under plans: 6 chameleon-worker processes (CPU, gloo), a real Redis, real plans
from the decision core, real SIGKILL. The oracle is oracles.reference: failure-free training of the
same model on the same samples in one process.

LOSS_RTOL bounds the measured agreement between distributed and single-process training: the runs
differ only in the order gradient sums are added (docs/worker.md has the figures).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import redis
from oracles.reference import reference_losses
from worker_harness import (
    TINY_ARCH,
    Controller,
    EventReader,
    Record,
    Workers,
    builtin_model,
    tiny_spec,
    wait_until,
)

from chameleond.core.plan import plan_from_dict
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

LOSS_RTOL = 1e-4
GLOBAL_BATCH = 12
MICRO_BATCH = 2
IDS = [f"w{i}" for i in range(6)]


@dataclass
class Job:
    controller: Controller
    workers: Workers

    @property
    def record(self) -> Record:
        return self.controller.record


@pytest.fixture
def start_job(redis_server: RedisServer, tmp_path: Path) -> Iterator[object]:
    jobs: list[Job] = []

    def start(
        policy: str | list[str],
        *,
        max_steps: int,
        env: dict[str, dict[str, str]] | None = None,
        memory_bytes: int = 8 << 30,
        measured: bool = True,
        group_timeout: float = 10.0,
        heartbeat_lapse: float = 3.0,
        layers: list[dict[str, float | int]] | None = None,
    ) -> Job:
        spec = tiny_spec(
            f"t{len(jobs)}",
            global_batch=GLOBAL_BATCH,
            micro_batch=MICRO_BATCH,
            memory_bytes=memory_bytes,
        )
        if layers is not None:  # a per-layer profile of the spec's own (measured=False keeps it)
            spec["model"]["layers"] = layers
        controller = Controller(
            redis_server.url, spec, policy=policy, measured=measured,
            heartbeat_lapse=heartbeat_lapse,
        ).start()  # fmt: skip
        workers = Workers(redis_server.url, spec["job"]["name"], tmp_path)
        job = Job(controller, workers)
        jobs.append(job)
        workers.start(IDS, env, max_steps=max_steps, group_timeout=group_timeout)
        return job

    yield start
    for job in jobs:
        job.workers.stop()
        job.controller.stop()


_reference_cache: dict[int, list[float]] = {}


def reference(steps: int) -> list[float]:
    if steps not in _reference_cache:
        model = builtin_model(TINY_ARCH, GLOBAL_BATCH, MICRO_BATCH)
        _reference_cache[steps] = reference_losses(model, steps)
    return _reference_cache[steps]


def assert_matches_reference(job: Job, steps: int) -> float:
    """Every step 0..steps-1 committed exactly once per plan worker, loss equal to the oracle's."""
    committed = job.record.committed()
    assert sorted(committed) == list(range(steps)), f"steps not contiguous: {sorted(committed)}"
    ref = reference(steps)
    worst = 0.0
    for s in range(steps):
        rel = abs(committed[s] - ref[s]) / abs(ref[s])
        worst = max(worst, rel)
        assert rel <= LOSS_RTOL, f"step {s}: loss {committed[s]!r} vs reference {ref[s]!r}"
    # All workers of a step report the same loss (it is all-reduced).
    for e in job.record.of("step"):
        assert float(e["loss"]) == committed[int(e["step"])]
    return worst


def finish(job: Job, steps: int, timeout: float = 150.0) -> None:
    job.controller.wait_steps(steps, timeout=timeout)
    last = job.controller.current
    assert last is not None
    job.controller.wait_for(
        "every worker of the last plan to stop",
        lambda: all(job.workers.procs[w].poll() is not None for w in last.workers),
        timeout=30,
    )
    for w in last.workers:
        assert job.workers.procs[w].returncode == 0, job.workers.log(w)[-3000:]
    # The workers sent their last step events before they exited; the reader may lag behind.
    job.controller.wait_for(
        "every worker's last step event",
        lambda: step_workers(job).get(steps - 1, set()) >= set(last.workers),
        timeout=10,
    )


def step_workers(job: Job) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for e in job.record.of("step"):
        out.setdefault(int(e["step"]), set()).add(e["worker"])
    return out


def kill_after(job: Job, victim: str, steps: int) -> float:
    job.controller.wait_steps(steps)
    return job.workers.kill(victim)


def recovery_figures(job: Job, victim: str, killed_at: float, generation: int) -> dict[str, float]:
    faults = [f for f in job.record.of("fault") if f["worker"] == victim]
    assert faults, "no survivor reported the killed worker"
    detect = min(float(f["at"]) for f in faults) - killed_at
    acks = [
        e
        for e in job.record.of("ack")
        if e["phase"] == "ready" and int(e["generation"]) == generation
    ]
    build = max(float(e["build_seconds"]) for e in acks)
    first = min(float(e["at"]) for e in job.record.of("step") if int(e["generation"]) == generation)
    figures = {"detect_s": detect, "rebuild_s": build, "recovery_s": first - killed_at}
    print(f"\nrecovery generation {generation}: {figures}")
    return figures


# Spec numbers with this memory per worker make the dynamic plan for 5 survivors two pipelines of
# 2 and 3 stages (asymmetric layer splits, a layer migrated), and 2 x 2 stages for 4 survivors.
TIGHT_MEMORY = 1_200_000


def test_failure_free_training_loss_falls(start_job) -> None:
    steps = 12
    job = start_job("reroute", max_steps=steps)
    finish(job, steps)
    worst = assert_matches_reference(job, steps)
    losses = [job.record.committed()[s] for s in range(steps)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert all(ws == set(IDS) for ws in step_workers(job).values())
    seconds = [float(e["seconds"]) for e in job.record.of("step") if e["worker"] == "w0"]
    for e in job.record.of("step"):  # the vote is part of the worker's step
        assert 0 < float(e["vote_seconds"]) < float(e["seconds"]), e
    print(f"\nfailure-free: max rel loss error {worst:.2e}; step seconds {sorted(seconds)}")


def test_uneven_layers_train_on_an_uneven_balanced_split(start_job) -> None:
    """A head 4x a block's time: the 2-stage pipelines split 4 + 2 or 5 + 1 layers (a bottleneck
    of 5 block times either way), not 3 + 3 (6), and the workers train that split to the
    oracle's losses."""
    steps = 8
    block = {
        "forward_seconds": 0.001,
        "backward_seconds": 0.002,
        "param_bytes": 50_000,
        "optimizer_bytes": 100_000,
        "activation_bytes": 20_000,
        "output_bytes": 8192,
    }
    head = {**block, "forward_seconds": 0.004, "backward_seconds": 0.008}
    job = start_job("reroute", max_steps=steps, measured=False, layers=[*[block] * 5, head])
    finish(job, steps)
    (initial,) = job.record.plans
    for pipe in initial.pipelines:
        assert [st.end_layer - st.first_layer for st in pipe.stages] in ([4, 2], [5, 1])
    worst = assert_matches_reference(job, steps)
    print(f"uneven split: max rel loss error {worst:.2e}")


def test_reroute_two_successive_failures(start_job) -> None:
    steps = 20
    job = start_job("reroute", max_steps=steps)
    killed = kill_after(job, "w3", 4)
    job.controller.wait_for("the rerouted plan to commit steps", lambda: has_committed(job, 2), 60)
    killed2 = kill_after(job, "w0", len(job.record.committed()) + 2)
    finish(job, steps)
    plans = job.record.plans
    assert [p.policy for p in plans] == ["initial", "reroute", "reroute"]
    for plan, out in ((plans[1], {"w3"}), (plans[2], {"w3", "w0"})):
        assert out.isdisjoint(plan.workers) and plan.migration == ()
        # The failed slots' micro-batches run on same-stage peers of other pipelines.
        routed = [
            (p, s, w)
            for p, (pipe, stages) in enumerate(zip(plan.pipelines, plan.routing, strict=True))
            for s, ws in enumerate(stages)
            for w in ws
            if w != pipe.stages[s].worker
        ]
        assert len(routed) == len(out) * 2, routed
    worst = assert_matches_reference(job, steps)
    by_step = step_workers(job)
    last_gen2 = max(s for s, ws in by_step.items() if "w0" in ws)
    after = sorted(s for s in by_step if s > last_gen2)
    # The step w0 died in may have committed on the survivors whose vote completed (they report
    # it) and late, in the next generation, on the others (a late commit sends no step event).
    assert by_step[after[0]] <= set(plans[2].workers), by_step
    assert all(by_step[s] == set(plans[2].workers) for s in after[1:]), by_step
    recovery_figures(job, "w3", killed, 2)
    recovery_figures(job, "w0", killed2, 3)
    print(f"reroute: max rel loss error {worst:.2e}")


def test_dynamic_migrates_into_asymmetric_pipelines(start_job) -> None:
    steps = 16
    job = start_job("dynamic", max_steps=steps, memory_bytes=TIGHT_MEMORY, measured=False)
    killed = kill_after(job, "w3", 4)
    finish(job, steps)
    plans = job.record.plans
    assert [p.policy for p in plans] == ["initial", "dynamic"]
    dynamic = plans[1]
    assert sorted(len(p.stages) for p in dynamic.pipelines) == [2, 3]
    assert dynamic.migration, "the dynamic plan moves no state"
    moved = [e for e in job.record.of("ack") if e["generation"] == "2" and e["phase"] == "ready"]
    assert {e["worker"] for e in moved} == set(dynamic.workers)
    assert all(int(e["moves"]) >= len(dynamic.migration) for e in moved)
    worst = assert_matches_reference(job, steps)
    recovery_figures(job, "w3", killed, 2)
    print(f"dynamic: max rel loss error {worst:.2e}")


def test_failure_during_migration(start_job) -> None:
    """w4 receives the migrated layer of generation 2 and dies (SIGKILL) in the middle of it."""
    steps = 16
    env = {"w4": {"CHAMELEON_WORKER_KILL_AT": "migration:2"}}
    job = start_job("dynamic", max_steps=steps, env=env, memory_bytes=TIGHT_MEMORY, measured=False)
    kill_after(job, "w3", 4)
    finish(job, steps)
    plans = job.record.plans
    assert [p.policy for p in plans] == ["initial", "dynamic", "dynamic"]
    assert any(t.dst == "w4" for t in plans[1].migration)
    assert job.workers.procs["w4"].poll() == -9
    assert {"w3", "w4"}.isdisjoint(plans[2].workers)
    # Generation 2 never trained: its migration was cut short.
    assert not [e for e in job.record.of("step") if e["generation"] == "2"]
    worst = assert_matches_reference(job, steps)
    print(f"\nfailure during migration: max rel loss error {worst:.2e}")


def test_a_worker_whose_device_fails_reports_itself_and_leaves(start_job) -> None:
    """A layer forward of w2 raises in step 5, as a failing device's kernel does (fault hook
    device:5), and its process stays alive. The peers see only broken groups; w2 names itself in a
    fault with the real cause and exits 7, and training resumes without it, nothing skipped."""
    steps = 14
    env = {"w2": {"CHAMELEON_WORKER_KILL_AT": "device:5"}}
    job = start_job("reroute", max_steps=steps, env=env)
    finish(job, steps)
    assert job.workers.procs["w2"].wait(timeout=30) == 7, job.workers.log("w2")[-2000:]
    own = [f for f in job.record.of("fault") if f.get("reporter") == "w2"]
    assert [f["worker"] for f in own] == ["w2"], own
    assert "injected device error" in own[0]["cause"] and own[0]["generation"] == "1"
    plans = job.record.plans
    assert [p.policy for p in plans] == ["initial", "reroute"] and "w2" not in plans[1].workers
    # Nobody else is blamed.
    assert {f["worker"] for f in job.record.of("fault")} == {"w2"}
    assert "device failed" in job.workers.log("w2")
    worst = assert_matches_reference(job, steps)
    print(f"\ndevice failure: max rel loss error {worst:.2e}")


def test_a_vote_lost_by_one_survivor_commits_late(start_job) -> None:
    """w3 dies (SIGKILL) right after its commit vote of step 5, and w1 takes that vote as failed,
    as a worker does whose ring broke when a peer died inside the all-reduce: the others commit
    step 5; w1 keeps its update pending and applies it at the next generation's reconcile.
    Nothing is skipped or repeated, and w1's state agrees with everyone's from then on."""
    steps, late = 14, 5
    env = {
        "w3": {"CHAMELEON_WORKER_KILL_AT": f"vote:{late}"},
        "w1": {"CHAMELEON_WORKER_KILL_AT": f"vote-lost:{late}"},
    }
    job = start_job("reroute", max_steps=steps, env=env)
    finish(job, steps)
    assert [p.policy for p in job.record.plans] == ["initial", "reroute"], job.record.of("fault")
    assert job.workers.procs["w3"].poll() == -9
    reported = step_workers(job)
    assert reported[late] == {"w0", "w2", "w4", "w5"}  # w1's vote was lost, w3 died
    assert "w1" in reported[late + 1]
    assert f"step {late} committed late (generation 2)" in job.workers.log("w1")
    worst = assert_matches_reference(job, steps)
    print(f"\nlate commit: max rel loss error {worst:.2e}")


def test_a_generation_failed_with_nobody_gone_is_built_again(start_job) -> None:
    """w1 takes its commit vote of step 5 as failed (fault hook vote-lost:5) and every process
    lives: the generation fails on all six with no peer gone, so nobody is named and no newer plan
    comes. The workers build generation 1 again (attempt 2) and train on: the others committed
    step 5, w1 applies it late; nothing is skipped or repeated."""
    steps, late = 14, 5
    env = {"w1": {"CHAMELEON_WORKER_KILL_AT": f"vote-lost:{late}"}}
    job = start_job("reroute", max_steps=steps, env=env)
    finish(job, steps)
    assert [p.policy for p in job.record.plans] == ["initial"]
    assert job.record.of("fault") == []
    ready = [e for e in job.record.of("ack") if e["phase"] == "ready"]
    assert {e["worker"] for e in ready if e["attempt"] == "2"} == set(IDS)
    assert f"step {late} committed late (generation 1)" in job.workers.log("w1")
    assert "no dead peer found: building generation 1 again" in job.workers.log("w0")
    worst = assert_matches_reference(job, steps)
    print(f"\ngeneration built again: max rel loss error {worst:.2e}")


def has_committed(job: Job, generation: int) -> bool:
    return any(int(e["generation"]) == generation for e in job.record.of("step"))


def test_hung_peer_is_bounded_then_fenced(start_job) -> None:
    """SIGSTOP w3: survivors give the step up after --group-timeout (nobody is named: w3's process
    still exists); the heartbeat lapse declares it failed; after SIGCONT it finds itself excluded,
    acks `stopped` and exits 0."""
    steps = 16
    job = start_job("reroute", max_steps=steps, group_timeout=1.5, heartbeat_lapse=3.0)
    job.controller.wait_steps(4)
    w3 = job.workers.procs["w3"]
    os.kill(w3.pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        job.controller.wait_for("a plan without w3", lambda: len(job.record.plans) >= 2, 30)
    finally:
        os.kill(w3.pid, signal.SIGCONT)
    finish(job, steps)
    assert w3.wait(timeout=30) == 9, job.workers.log("w3")[-2000:]  # fenced
    acks = [e for e in job.record.of("ack") if e["worker"] == "w3" and e["phase"] == "stopped"]
    assert acks and int(acks[-1]["generation"]) >= 2
    assert not [f for f in job.record.of("fault") if f["worker"] != "w3"]
    assert_matches_reference(job, steps)
    # The survivors gave generation 1 up on the timeout, before the plan without w3 existed.
    for w in ("w0", "w2", "w4"):
        assert "generation 1 failed" in job.workers.log(w)
    first_new = min(float(e["at"]) for e in job.record.of("step") if e["generation"] == "2")
    print(f"\nhung peer: first step of the new plan {first_new - stopped:.2f}s after SIGSTOP")


def test_restarted_worker_rejoins_and_receives_state(start_job) -> None:
    """A new w3 process starts (warm, waiting), the old one is killed -9 (reroute); an operator's
    `rejoin` brings w3 back by a dynamic plan: it receives its layers by migration and trains on."""
    # No step limit: the job must still be training when the new process is ready, however long
    # its start takes on a loaded machine.
    job = start_job(["reroute", "dynamic"], max_steps=0)
    job.controller.wait_steps(2)
    old = job.workers.procs["w3"]
    job.workers.start(["w3"])
    # A process registers once, after its start-up profile (profiles also come from training).
    job.controller.wait_for(
        "the new w3 process to profile and register",
        lambda: sum(e["worker"] == "w3" for e in job.record.of("register")) == 2,
        120,
    )
    os.kill(old.pid, signal.SIGKILL)
    old.wait()
    job.controller.wait_for("the rerouted plan to commit steps", lambda: has_committed(job, 2), 60)
    job.controller.client.xadd(
        Keys(job.controller.spec.name).events, {"type": "rejoin", "worker": "w3"}
    )
    job.controller.wait_for("a plan with w3 back", lambda: len(job.record.plans) >= 3, 60)
    # w3's own step report, not only a peer's: a worker reports after its commit, and stopping
    # the workers at a peer's report can cut w3's short.
    job.controller.wait_for(
        "w3 to report a step of the plan that brought it back",
        lambda: any(e["worker"] == "w3" for e in job.record.of("step") if e["generation"] == "3"),
        60,
    )
    plans = list(job.record.plans)  # stopping the workers below makes more plans: not of interest
    job.workers.stop()
    steps = len(job.record.committed())
    assert [p.policy for p in plans] == ["initial", "reroute", "dynamic"]
    assert "w3" in plans[2].workers and plans[2].owned_layers("w3")
    ready = [e for e in job.record.of("ack") if e["worker"] == "w3" and e["generation"] == "3"]
    assert ready and int(ready[0]["moves"]) > 0
    assert any(e["worker"] == "w3" for e in job.record.of("step") if e["generation"] == "3")
    worst = assert_matches_reference(job, steps)
    print(f"\nrejoin: max rel loss error {worst:.2e}")


def test_adaptive_daemon_chooses(redis_server: RedisServer, tmp_path: Path) -> None:
    """The real chameleond (adaptive policy) plans; the selector picks the policy for the fault."""
    from daemon_harness import Daemon

    steps = 16
    spec = tiny_spec("adaptive", global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    daemon = Daemon(
        redis_server.url,
        tmp_path,
        "--spec", str(spec_path), "--policy", "adaptive", "--heartbeat-timeout-seconds", "3",
        job="adaptive",
    )  # fmt: skip
    record = Record()
    reader = EventReader(redis_server.url, "adaptive", record)
    workers = Workers(redis_server.url, "adaptive", tmp_path)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        daemon.start().wait_ready()
        reader.start()
        workers.start(IDS, max_steps=steps)
        wait_until(lambda: len(record.committed()) >= 4, 150, "4 committed steps")
        killed = workers.kill("w3")
        wait_until(lambda: len(record.committed()) >= steps, 120, f"{steps} committed steps")
        decisions = cast(
            list[tuple[str, dict[str, str]]], client.xrange(Keys("adaptive").decisions)
        )
        selected = [f["selected"] for _, f in decisions if f.get("selected")]
        # The initial plan waits for every registration; each worker of the spec sent its
        # start-up profile before registering, so that plan was made from all of them.
        events = cast(list[tuple[str, dict[str, str]]], client.xrange(Keys("adaptive").events))
        first = {}
        for n, (_, f) in enumerate(events):
            first.setdefault((f["type"], f.get("worker")), n)
        assert all(first[("profile", w)] < first[("register", w)] for w in IDS), first
        plan = plan_from_dict(json.loads(client.get(Keys("adaptive").plan) or "{}"))
        assert plan.generation >= 2 and "w3" not in plan.workers
        assert plan.policy in ("reroute", "dynamic")
        committed = record.committed()
        assert sorted(committed) == list(range(steps))
        ref = reference(steps)
        worst = max(abs(committed[s] - ref[s]) / abs(ref[s]) for s in range(steps))
        assert worst <= LOSS_RTOL
        first_new = min(float(e["at"]) for e in record.of("step") if int(e["generation"]) >= 2)
        print(
            f"\nadaptive: decisions {selected}, final plan {plan.policy} gen {plan.generation}; "
            f"recovery {first_new - killed:.3f}s; max rel loss error {worst:.2e}"
        )
    finally:
        workers.stop()
        reader.stop()
        client.close()
        daemon.stop()


def test_a_hung_peer_whose_heartbeats_go_on_is_named_by_its_absence(start_job) -> None:
    """w3's training thread hangs in step 5 (fault hook hang:5); its process, connections and
    heartbeats live on, so no peer finds it gone and no heartbeat lapses. The survivors give the
    step up after --group-timeout and build the generation again; w3 never joins, and after
    ABSENT_ATTEMPTS attempts in a row they name it: the plan without it trains on."""
    steps = 14
    env = {"w3": {"CHAMELEON_WORKER_KILL_AT": "hang:5"}}
    job = start_job("reroute", max_steps=steps, env=env, group_timeout=1.5, heartbeat_lapse=60.0)
    job.controller.wait_for("a plan without w3", lambda: len(job.record.plans) >= 2, 60)
    assert job.record.plans[1].excluded == ("w3",)
    faults = job.record.of("fault")
    assert faults and {f["worker"] for f in faults} == {"w3"}
    assert all("absent from 3 rendezvous attempts of generation 1" in f["cause"] for f in faults)
    assert {f["reporter"] for f in faults} <= {"w0", "w1", "w2", "w4", "w5"}
    last_commit = max(float(e["at"]) for e in job.record.of("step") if e["generation"] == "1")
    named = min(float(f["at"]) for f in faults)
    finish(job, steps)
    assert job.workers.procs["w3"].poll() is None  # still hung: an operator's to kill
    worst = assert_matches_reference(job, steps)
    print(f"\nhung peer named {named - last_commit:.2f}s after the last commit; loss {worst:.1e}")
