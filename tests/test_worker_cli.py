"""chameleon-worker as a process: exit codes and messages at its boundaries, fencing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest
import redis
from worker_harness import signed_doc, tiny_spec, wait_until

from chameleond.core.decide import initial_plan
from chameleond.core.plan import plan_to_dict
from chameleond.core.spec import parse_spec
from chameleond.protocol import REDIS_URL_ENV, Keys
from chameleond.redis_server import RedisServer, free_port
from chameleond.worker._main import EXIT_BACKEND, EXIT_REDIS, EXIT_SPEC, EXIT_USAGE


def worker(url: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chameleond.worker._main", "--redis-url", url, *args],
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


def test_unreachable_redis_is_reported_without_its_password() -> None:
    r = worker(f"redis://job:s3cret@127.0.0.1:{free_port()}/0", "--worker-id", "w0")
    assert r.returncode == EXIT_REDIS
    assert "redis at redis://***@127.0.0.1:" in r.stderr and "s3cret" not in r.stderr
    assert "Traceback" not in r.stderr


def test_a_bad_fault_hook_is_a_usage_error() -> None:
    env = {**os.environ, "CHAMELEON_WORKER_KILL_AT": "vote-lost:soon"}
    argv = [sys.executable, "-m", "chameleond.worker._main", "--redis-url", "redis://127.0.0.1:1/0"]
    r = subprocess.run([*argv, "--worker-id", "w0"], capture_output=True, text=True, timeout=60,
                       env=env)  # fmt: skip
    assert r.returncode == EXIT_USAGE
    assert "CHAMELEON_WORKER_KILL_AT='vote-lost:soon': expected KIND:N" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_redis_url_is_required_from_a_flag_or_the_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV}
    argv = [sys.executable, "-m", "chameleond.worker._main", "--worker-id", "w0"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == EXIT_USAGE
    assert f"no Redis: pass --redis-url or set {REDIS_URL_ENV}" in r.stderr
    port = free_port()
    env[REDIS_URL_ENV] = f"redis://127.0.0.1:{port}/0"
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == EXIT_REDIS and f"127.0.0.1:{port}" in r.stderr  # the URL it was given


def test_malformed_spec(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    redis_client.set(Keys("bad").spec, signed_doc("spec", "bad", {"workers": []}))
    r = worker(redis_server.url, "--job", "bad", "--worker-id", "w0")
    assert r.returncode == EXIT_SPEC
    assert "workers: expected a non-empty list" in r.stderr


def _events(client: redis.Redis, keys: Keys) -> list[dict[str, str]]:
    entries = cast(list[tuple[str, dict[str, str]]], client.xrange(keys.events))
    return [f for _, f in entries]


def test_fenced_worker_acks_stopped_and_exits_9(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A one-worker job trains; a plan excluding the worker fences it: ack stopped, exit 9 (a
    supervisor starts it again to rejoin; 0 would tell it the worker is done)."""
    spec = tiny_spec("fence", workers=1, stages=1, global_batch=4, micro_batch=2)
    keys = Keys("fence")
    redis_client.set(keys.spec, signed_doc("spec", keys.job, spec))
    plan = initial_plan(parse_spec(spec), generation=1, mtbf_seconds=3600.0)
    redis_client.set(keys.plan, signed_doc("plan", keys.job, plan_to_dict(plan)))
    proc = subprocess.Popen(
        [sys.executable, "-m", "chameleond.worker._main", "--redis-url", redis_server.url,
         "--job", "fence", "--worker-id", "w0"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stepped = lambda: any(e["type"] == "step" for e in _events(redis_client, keys))  # noqa: E731
        wait_until(stepped, 90, "a step")
        fenced = plan_to_dict(plan)
        fenced["generation"], fenced["excluded"] = 2, ["w0"]
        redis_client.set(keys.plan, signed_doc("plan", keys.job, fenced))
        redis_client.publish(keys.plans_channel, "2")
        assert proc.wait(timeout=30) == 9
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    events = _events(redis_client, keys)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["profile", "register"]  # a worker of the spec: its profile first
    last = {k: v for k, v in events[-1].items() if k != "sig"}
    assert last == {"type": "ack", "worker": "w0", "generation": "2", "phase": "stopped"}
    assert "fenced by generation 2" in err
    profile = json.loads(next(e["data"] for e in events if e["type"] == "profile"))
    assert len(profile["layers"]) == spec["model"]["arch"]["blocks"] + 2
    assert all(layer["forward_seconds"] > 0 for layer in profile["layers"])


def test_a_new_process_excluded_by_the_plan_waits_to_rejoin(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A restarted worker finds itself excluded (it was declared failed): it registers and waits
    to be taken back instead of stopping; SIGTERM ends it with 0."""
    spec = tiny_spec("back")
    keys = Keys("back")
    redis_client.set(keys.spec, signed_doc("spec", keys.job, spec))
    plan = plan_to_dict(initial_plan(parse_spec(spec), generation=1, mtbf_seconds=3600.0))
    plan["excluded"] = ["w5"]
    redis_client.set(keys.plan, signed_doc("plan", keys.job, plan))
    proc = subprocess.Popen(
        [sys.executable, "-m", "chameleond.worker._main", "--redis-url", redis_server.url,
         "--job", "back", "--worker-id", "w5"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(
            lambda: any(e["type"] == "profile" for e in _events(redis_client, keys)), 90, "profile"
        )
        time.sleep(1.5)  # several plan polls
        assert proc.poll() is None, "an excluded new process must wait, not stop"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert not [e for e in _events(redis_client, keys) if e["type"] == "ack"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--group-timeout", "nan"),
            "--group-timeout nan: expected a finite number of seconds > 0",
        ),
        (
            ("--group-timeout", "inf"),
            "--group-timeout inf: expected a finite number of seconds > 0",
        ),
        (("--group-timeout", "0"), "expected a finite number of seconds > 0"),
        (("--log-level", "bogus"), "argument --log-level: invalid choice: 'BOGUS'"),
        (("--bind-address", "10.9.9.9"), "--bind-address '10.9.9.9': not an address of this host"),
    ],
)
def test_unusable_settings_are_usage_errors(args: tuple[str, ...], message: str) -> None:
    r = worker("redis://127.0.0.1:1/0", "--worker-id", "w0", *args)
    assert r.returncode == EXIT_USAGE, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_the_checkpoint_directory_must_be_a_writable_directory(tmp_path: Path) -> None:
    regular = tmp_path / "file"
    regular.write_text("not a directory")
    for bad in (regular, regular / "below"):
        r = worker("redis://127.0.0.1:1/0", "--worker-id", "w0", "--checkpoint-dir", str(bad))
        assert r.returncode == EXIT_USAGE, r.stderr
        assert f"--checkpoint-dir {bad}: not a usable directory" in r.stderr
        assert "Traceback" not in r.stderr
    missing = tmp_path / "new" / "ckpt"  # created; then the worker goes on to Redis
    r = worker(f"redis://127.0.0.1:{free_port()}/0", "--worker-id", "w0", "--checkpoint-dir",
               str(missing), "--checkpoint-every", "5")  # fmt: skip
    assert r.returncode == EXIT_REDIS and missing.is_dir()
