"""`chameleonctl bench control-plane` at 64 simulated workers: a real redis-server, the real
chameleond process, the simulated workers in processes of their own speaking the real protocol,
one host's process killed with -9 under load, then started again."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from chameleond.bench.control_plane import pin, run_size, split_cpus
from chameleond.daemon.config import Config
from chameleond.protocol import FAULT_REPORTERS, HEARTBEAT_SECONDS, PLAN_POLL_SECONDS

pytestmark = pytest.mark.timeout(180)

STEP_SECONDS = 1.0


def test_a_lost_host_is_planned_out_and_back_in_with_a_constant_load_per_worker() -> None:
    f = run_size(64, STEP_SECONDS, steady_seconds=5.0, timeout=60.0)

    # The plan after the loss runs exactly the 56 survivors, every one of them acked it, and the
    # host's loss was acted on before the daemon's 3 s heartbeat timeout could have decided it:
    # the peers learned of it from the daemon's liveness notice and named it.
    without, back = f["plan_without_host"], f["plan_with_host"]
    assert without["workers"] == 56 and back["workers"] == 64
    assert back["generation"] > without["generation"] > 1
    assert f["peer_death_detect_seconds"] is not None and f["peer_death_detect_seconds"] <= 2.0
    announced = f["peer_death_announced_seconds"]
    assert announced is not None and 0 < announced <= f["peer_death_detect_seconds"] + 0.05
    assert f["fault_to_all_acked_max_seconds"] < 3.0
    assert 0 < f["fault_to_plan_published_seconds"] <= f["fault_to_all_acked_max_seconds"]
    assert 0 < f["planning_to_published_seconds"] < f["fault_to_plan_published_seconds"]
    # While the first plan trained, the daemon prepared the search tables for its next fault.
    assert f["prepared_before_loss"]["count"] >= 1 and f["prepared_before_loss"]["cpu_seconds"] > 0
    assert all("peer process gone" in d["cause"] for d in f["decisions_after_loss"])
    # Every lost worker named by a survivor's fault (the first fault names one).
    first, named = f["first_fault_added_seconds"], f["all_lost_named_seconds"]
    assert 0 < first <= named < f["fault_to_all_acked_max_seconds"]
    # Each lost worker is named by its first reporters only (the plan came well within the
    # fallback time): not by every survivor, 56 x 8 faults.
    assert 8 <= f["faults_after_loss"] <= FAULT_REPORTERS * 8
    # What the machine gave the window: each part's CPU, within what the cores could.
    cpu = f["loss_to_acked_cpu"]
    assert cpu["seconds"] >= f["fault_to_all_acked_max_seconds"] and cpu["cores"] >= 1
    assert cpu["daemon"] > 0 and cpu["simulated_workers"] > 0
    used = cpu["daemon"] + cpu["redis"] + cpu["simulated_workers"]
    assert used <= cpu["cores"] * cpu["seconds"] + 0.1
    assert f["host_back_outcome"] == "taken back"
    assert f["host_back_to_all_acked_max_seconds"] < 10.0

    # Steady state: each worker's own writes are its heartbeat, its step, its profile every
    # fifth step and the plan poll; nothing polls the client list per worker (the daemon's one
    # CLIENT LIST per period is the only one), and the daemon keeps up with the stream.
    steady = f["steady"]
    per_worker = steady["top_commands_per_worker_per_second"]
    writes = 1 / HEARTBEAT_SECONDS + (1 + 1 / 5) / STEP_SECONDS
    assert per_worker["xadd"] <= writes * 1.2
    # The daemon's listings come at most one per peer_watch_seconds (10 a second), beside a new
    # connection's CLIENT SETNAME or SETINFO now and then; a poll per worker would be 640.
    listings = 1 / Config.peer_watch_seconds
    assert per_worker.get("client", 0.0) * 64 < listings + 5
    # GET: each worker's plan poll, and the daemon's commits (one GET of the lease each)
    assert per_worker["get"] * 64 < 64 / PLAN_POLL_SECONDS + 100
    assert steady["redis_commands_per_worker_per_second"] < 15
    assert steady["daemon_behind_seconds"] < 1.0


def test_the_control_plane_and_the_simulated_workers_can_have_cpus_of_their_own() -> None:
    """--control-plane-cpus N: Redis and the daemon on the first N CPUs, the simulated workers
    on the others, every thread of each process."""
    assert split_cpus(0) is None
    cpus = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="this process has"):
        split_cpus(len(cpus))
    if len(cpus) > 1:
        assert split_cpus(1) == ({cpus[0]}, set(cpus[1:]))
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start()"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while len(os.listdir(f"/proc/{child.pid}/task")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pin(child.pid, {cpus[-1]})
        tasks = os.listdir(f"/proc/{child.pid}/task")
        assert len(tasks) == 2
        assert all(os.sched_getaffinity(int(t)) == {cpus[-1]} for t in tasks)
    finally:
        child.kill()
        child.wait()
