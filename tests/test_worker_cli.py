"""chameleon-worker as a process: exit codes and messages at its boundaries, fencing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import cast

import pytest
import redis
from worker_harness import tiny_spec

from chameleond.core.decide import initial_plan
from chameleond.core.plan import plan_to_dict
from chameleond.core.spec import parse_spec
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer, free_port
from workers.main import EXIT_BACKEND, EXIT_REDIS, EXIT_SPEC, EXIT_USAGE


def worker(url: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.main", "--redis-url", url, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_device_is_a_usage_error() -> None:
    r = worker("redis://127.0.0.1:1/0", "--worker-id", "w0", "--device", "tpu:0")
    assert r.returncode == EXIT_USAGE
    assert "expected cpu, cuda:N or npu:N" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_torch_npu_is_explained() -> None:
    try:
        import torch_npu  # noqa: F401

        pytest.skip("torch_npu is installed here")
    except ImportError:
        pass
    r = worker("redis://127.0.0.1:1/0", "--worker-id", "w0", "--device", "npu:0")
    assert r.returncode == EXIT_BACKEND
    assert "torch_npu is not installed" in r.stderr and "chameleond[npu]" in r.stderr


def test_unreachable_redis() -> None:
    r = worker(f"redis://127.0.0.1:{free_port()}/0", "--worker-id", "w0")
    assert r.returncode == EXIT_REDIS
    assert "Traceback" not in r.stderr


def test_malformed_spec(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    redis_client.set(Keys("bad").spec, json.dumps({"workers": []}))
    r = worker(redis_server.url, "--job", "bad", "--worker-id", "w0")
    assert r.returncode == EXIT_SPEC
    assert "workers: expected a non-empty list" in r.stderr


def test_fenced_worker_acks_stopped_and_exits_0(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    spec = tiny_spec("fence")
    keys = Keys("fence")
    redis_client.set(keys.spec, json.dumps(spec))
    plan = initial_plan(parse_spec(spec), generation=1, mtbf_seconds=3600.0)
    fenced = plan_to_dict(plan)
    fenced["excluded"] = ["w5"]
    redis_client.set(keys.plan, json.dumps(fenced))
    t0 = time.monotonic()
    r = worker(redis_server.url, "--job", "fence", "--worker-id", "w5")
    assert r.returncode == 0, r.stderr
    entries = cast(list[tuple[str, dict[str, str]]], redis_client.xrange(keys.events))
    events = [f for _, f in entries]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "register" and "profile" in kinds
    assert events[-1] == {"type": "ack", "worker": "w5", "generation": "1", "phase": "stopped"}
    profile = json.loads(next(e["data"] for e in events if e["type"] == "profile"))
    assert len(profile["layers"]) == spec["model"]["arch"]["blocks"] + 2
    assert all(layer["forward_seconds"] > 0 for layer in profile["layers"])
    assert time.monotonic() - t0 < 90
