"""`chameleonctl bench control-plane` at 64 simulated workers: a real redis-server, the real
chameleond process, the simulated workers in processes of their own speaking the real protocol,
one host's process killed with -9 under load, then started again."""

from __future__ import annotations

import pytest

from chameleond.bench.control_plane import run_size
from chameleond.protocol import HEARTBEAT_SECONDS, PLAN_POLL_SECONDS

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
    assert f["fault_to_all_acked_max_seconds"] < 3.0
    assert all("peer process gone" in d["cause"] for d in f["decisions_after_loss"])
    assert f["host_back_to_all_acked_max_seconds"] < 10.0

    # Steady state: each worker's own writes are its heartbeat, its step, its profile every
    # fifth step and the plan poll; nothing polls the client list per worker (the daemon's one
    # CLIENT LIST per period is the only one), and the daemon keeps up with the stream.
    steady = f["steady"]
    per_worker = steady["top_commands_per_worker_per_second"]
    writes = 1 / HEARTBEAT_SECONDS + (1 + 1 / 5) / STEP_SECONDS
    assert per_worker["xadd"] <= writes * 1.2
    assert per_worker.get("client", 0.0) * 64 < 10
    # GET: each worker's plan poll, and the daemon's commits (one GET of the lease each)
    assert per_worker["get"] * 64 < 64 / PLAN_POLL_SECONDS + 100
    assert steady["redis_commands_per_worker_per_second"] < 15
    assert steady["daemon_backlog_events"] < 200
