"""The group rebuild figure of `chameleonctl bench recovery` and `chameleonctl up`'s report: per
backend, the slowest worker's build of the new generation's process groups, read from the job's
event stream on a real redis-server as the workers write it (register, then ack ready with build
and migration seconds)."""

from __future__ import annotations

import pytest
import redis

from chameleond.local.monitor import StreamMonitor
from chameleond.local.timeline import group_rebuild_seconds
from chameleond.protocol import Keys


def test_the_rebuild_is_the_slowest_members_build_less_its_migration_per_backend(
    redis_client: redis.Redis,
) -> None:
    events = Keys("bench").events
    devices = {"w0": "cpu", "w1": "cpu", "w2": "cuda:0", "w3": "cuda:1"}
    for w, device in devices.items():
        redis_client.xadd(
            events,
            {"type": "register", "worker": w, "host": "h", "memory_bytes": 2**30, "device": device},
        )
    acks = [  # worker, generation, build, migration
        ("w0", 1, 0.9, 0.0),  # the initial plan's: not the generation asked about
        ("w0", 2, 0.05, 0.0),
        ("w1", 2, 0.31, 0.25),  # mostly migration: 0.06 of groups
        ("w2", 2, 0.7, 0.1),
        ("w3", 2, 0.55, 0.0),
    ]
    for w, gen, build, migration in acks:
        redis_client.xadd(
            events,
            {"type": "ack", "worker": w, "generation": gen, "phase": "ready", "attempt": 1,
             "build_seconds": f"{build:.4f}", "world_seconds": f"{build - migration:.4f}",
             "migration_seconds": f"{migration:.4f}", "moves": 0},
        )  # fmt: skip
    redis_client.xadd(events, {"type": "ack", "worker": "w1", "generation": 2, "phase": "ready"})
    mon = StreamMonitor(redis_client, "bench")
    mon.read_all()
    got = group_rebuild_seconds(mon.events, 2)
    assert got == {"gloo": pytest.approx(0.06), "nccl": pytest.approx(0.6)}
    assert group_rebuild_seconds(mon.events, 3) == {}
