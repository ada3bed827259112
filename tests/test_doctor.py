"""`chameleonctl doctor` as a user runs it on a new machine: a subprocess, against a real
redis-server with real ACL users."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import redis
import torch
from cli_harness import chameleonctl

from chameleond.auth import SECRET_ENV, SECRET_FILE_ENV, Keyring, signed_json
from chameleond.cli.doctor.versions import satisfies
from chameleond.protocol import REDIS_URL_ENV, Keys
from chameleond.redis_server import RedisServer

PASSWORD = "doctor-test-password"  # a throwaway user of a throwaway server


def doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    base = {k: v for k, v in os.environ.items() if k not in (REDIS_URL_ENV, SECRET_FILE_ENV)}
    proc = chameleonctl("doctor", "--json", *args, env={**base, **(env or {})})
    return proc.returncode, json.loads(proc.stdout)


def check(report: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in report["checks"] if c["name"] == name]
    return dict(found)


def test_this_machine_is_ready_for_cpu_workers() -> None:
    rc, report = doctor()
    assert rc == 0 and report["ok"], report
    gloo = check(report, "gloo on cpu")
    assert gloo["verdict"] == "ok", gloo
    assert gloo["figures"]["rebuild_seconds"] > 0 and gloo["figures"]["allreduce_seconds"] > 0
    if not torch.cuda.is_available():
        cuda = check(report, "nccl on cuda")
        assert cuda["verdict"] == "skip" and "no CUDA device" in cuda["detail"], cuda
    assert check(report, "redis")["verdict"] == "skip"  # no URL given
    worker = check(report, "extra worker")
    assert worker["verdict"] == "ok" and worker["figures"]["torch"] == torch.__version__
    for c in report["checks"]:
        assert c["verdict"] in ("ok", "warn", "skip"), c
        assert c["detail"] and c["seconds"] >= 0, c


def test_the_text_is_one_line_per_check_with_a_verdict() -> None:
    env = {k: v for k, v in os.environ.items() if k != REDIS_URL_ENV}
    proc = chameleonctl("doctor", env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("chameleond ") and lines[-1].startswith("ready: ")
    for line in lines[1:-1]:
        assert line.split()[0] in ("ok", "warn", "fail", "skip"), line
        assert line.endswith(" s)"), line


def acl_user(client: redis.Redis, name: str, *rules: str) -> str:
    client.execute_command("ACL", "SETUSER", name, "on", f">{PASSWORD}", *rules)
    return name


def test_redis_its_acl_and_the_secret(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys("first")
    full = acl_user(client, "job-first", *keys.acl_rules(daemon=True))
    # The workers' user, without CLIENT LIST: enough for workers, a daemon under it would find
    # dead workers only by the heartbeat timeout.
    limited = acl_user(client, "job-limited", *keys.acl_rules())
    # Without CLIENT SETNAME: a worker could not name its connections.
    unnamed = acl_user(client, "job-unnamed", *keys.acl_rules()[:-1])
    ours = Keyring.configured(os.environ)
    spec = signed_json(ours, "spec", "first", {"job": {"name": "first"}})
    client.set(keys.spec, spec)
    client.close()
    port = redis_server.url.rsplit(":", 1)[1]

    def url(user: str) -> str:
        return f"redis://{user}:{PASSWORD}@127.0.0.1:{port}"

    rc, report = doctor("--redis-url", url(full), "--job", "first")
    assert rc == 0, report
    reached = check(report, "redis")
    assert reached["verdict"] == "ok" and PASSWORD not in reached["detail"], reached
    assert "Redis 6." in reached["detail"]  # from HELLO: the job's user may not run INFO
    assert check(report, "redis ACL")["verdict"] == "ok"
    secret = check(report, "secret")
    assert secret["verdict"] == "ok" and "carries its signature" in secret["detail"], secret

    rc, report = doctor("--redis-url", url(limited), "--job", "first")
    acl = check(report, "redis ACL")
    assert acl["verdict"] == "warn" and "CLIENT LIST is denied" in acl["detail"], acl
    assert "+client|list" in acl["detail"]  # the rule the daemon's user needs

    rc, report = doctor("--redis-url", url(unnamed), "--job", "first")
    acl = check(report, "redis ACL")
    assert rc == 1 and acl["verdict"] == "fail" and "CLIENT SETNAME" in acl["detail"], acl

    rc, report = doctor("--redis-url", url(full), "--job", "other")  # another job's keys
    assert rc == 1 and check(report, "redis ACL")["verdict"] == "fail"

    other = {SECRET_ENV: "another-secret-of-enough-length"}
    rc, report = doctor("--redis-url", url(full), "--job", "first", env=other)
    secret = check(report, "secret")
    assert rc == 1 and secret["verdict"] == "fail" and "does not verify" in secret["detail"]

    rc, report = doctor("--redis-url", url("nobody"), "--job", "first")
    reached = check(report, "redis")
    assert rc == 1 and reached["verdict"] == "fail" and PASSWORD not in reached["detail"]


@pytest.mark.parametrize(
    ("version", "constraint", "ok"),
    [
        ("2.13.0+cpu", "==2.13.0", True),
        ("2.12.1", "==2.13.0", False),
        ("5.24.0", ">=5.0", True),
        ("4.57.1", ">=5.0", False),
        ("0.22.1", ">=0.22", True),
        ("1.2", ">=1.0,<2", True),
        ("2.0", ">=1.0,<2", False),
    ],
)
def test_an_installed_version_against_an_extras_requirement(
    version: str, constraint: str, ok: bool
) -> None:
    assert satisfies(version, constraint) is ok
