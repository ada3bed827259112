"""Faults across hosts that are really separate: three network namespaces with their own addresses,
Redis and chameleond on the bridge, a `chameleon-agent` in each host starting its two workers,
gloo between the hosts (chameleond/bench/hosts.py runs the same faults and prints the figures).

In one job, one after another: kill -9 of a worker (its agent restarts it and it rejoins); a whole
host's processes killed at once (the agent started again, as its supervisor would: both workers
rejoin); a host partitioned (its link down) and healed (its workers are fenced, commit nothing
stale, and rejoin); a slowed link (tc netem) that the planner sees in the workers' link probes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from chameleond.bench.hosts import KINDS, measure
from chameleond.local.netns import unavailable

pytestmark = pytest.mark.slow


def test_faults_across_namespaced_hosts(tmp_path: Path) -> None:
    why = unavailable()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    args = argparse.Namespace(warmup=4, partition_seconds=6.0, slow_mbit=40.0, timeout=120.0)
    f = measure(tmp_path, list(KINDS), args)
    assert f["hosts"] == 3
    assert f["faults"] == dict.fromkeys(KINDS, 1)
    assert f["lost_events"] == 0, f["unanswered_faults"]
    assert f["duplicate_applications"] == 0
    assert f["stale_commits"] == 0
    # The killed worker, the partitioned host's two fenced workers and the slow-link fault's
    # victim: restarted by their agents and back in the job (in the plan, or on standby).
    assert f["agent_restarts"] >= 4
    assert all(f["max_resume_seconds"][k] is not None for k in KINDS)
    slow = f["slow_link"]
    assert slow["inter_host_bandwidth_after"] < 2 * slow["rate_bytes_per_second"]
    assert slow["inter_host_bandwidth_before"] > 4 * slow["rate_bytes_per_second"]
