"""`chameleonctl bench ingest`: the daemon's consumer and handlers beside raw Redis, end to end on a
real redis-server with a real producer process, in a few thousand events."""

from __future__ import annotations

import json
import subprocess
import sys

from chameleond.bench.ingest import added


def test_the_bench_reports_throughput_beside_raw_redis_and_the_paced_latency() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", "bench", "ingest", "--json",
         "--events", "2000", "--rate", "2000", "--seconds", "0.3", "--rounds", "2"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert len(result["rounds"]) == 2
    best = max(r["events_per_second"] for r in result["rounds"])
    raw = max(r["raw_redis_events_per_second"] for r in result["rounds"])
    assert result["events_per_second"] == best > 0 and result["raw_redis_events_per_second"] == raw
    assert result["ratio_to_raw"] == best / raw
    # Every paced event was handled and acknowledged; the latency is a positive, bounded figure.
    assert 0 < result["p50_seconds"] <= result["p99_seconds"] < 10
    # The bare consumer's latency on the same paced producer: the floor the daemon's sits over.
    assert 0 < result["raw_p50_seconds"] <= result["raw_p99_seconds"] < 10
    assert result["raw_p99_seconds"] == min(r["raw_p99_seconds"] for r in result["rounds"])
    # Handling costs the consuming process CPU beyond reading and acknowledging.
    assert 0 < result["raw_cpu_seconds_per_event"] < result["cpu_seconds_per_event"] < 1e-3


def test_an_entrys_id_gives_when_redis_appended_it() -> None:
    assert added("1796040602066-0") == 1796040602.066
    assert added(b"1796040602066-17") == 1796040602.066
