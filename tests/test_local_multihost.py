"""Several hosts rehearsed on one machine: workers bound to 127.0.0.2 and 127.0.0.3 (two hosts in
the spec), one chameleond; `chameleonctl status` and `chameleonctl inject` against the live job.

Redis is run as in production: TLS only (a rediss:// URL that names the CA), the default user off,
the job's own ACL user (its keys and channels only, no @dangerous command), credentials in the URL.
The URL reaches every process through CHAMELEON_REDIS_URL, so the password must appear on no
command line and in no log."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import make_tls, tls_redis_server

from chameleond.cli.up import build_spec_document
from chameleond.jobs import load_default_spec
from chameleond.local.cluster import LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor
from chameleond.protocol import REDIS_URL_ENV, Keys
from chameleond.redis_server import RedisServer, redis_binary

pytestmark = pytest.mark.slow
ADDRESSES = ["127.0.0.2", "127.0.0.3"]


SECRET = "s3cret/with:odd@chars"


def chameleonctl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chameleond.cli.ctl", *args],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, REDIS_URL_ENV: url},
    )  # fmt: skip


def status(url: str) -> dict[str, Any]:
    proc = chameleonctl(url, "status", "--job", "mh", "--json")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def command_lines(pids: list[int]) -> str:
    return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode() for pid in pids)


def test_workers_on_two_loopback_hosts_train_and_recover(tmp_path: Path) -> None:
    doc = build_spec_document(
        load_default_spec(), job="mh", workers=4, pp=2, bind_addresses=ADDRESSES,
        mtbf_prior_seconds=None,
    )  # fmt: skip
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    workers = [f"w{i}" for i in range(4)]
    bind = {w: ADDRESSES[i % 2] for i, w in enumerate(workers)}
    server = RedisServer(
        tmp_path / "redis",
        acl_user=("job-mh", SECRET, Keys("mh").acl_rules()),
        tls=make_tls(tmp_path / "tls"),
        executable=tls_redis_server(),
    )
    assert server.url.startswith("rediss://")
    with server, LocalCluster(
        tmp_path / "run", job="mh", workers=workers, spec_path=spec, bind_addresses=bind,
        redis_url=server.url,
    ) as cluster:  # fmt: skip
        cluster.start_daemon()
        cluster.start_workers()
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        try:
            mon = StreamMonitor(client, "mh")

            def commits(n: int, after_generation: int = 0) -> bool:
                mon.poll(block_ms=50)
                cluster.check_daemon()
                return sum(c.generation > after_generation for c in mon.commits) >= n

            wait_for(lambda: commits(3), 150, "3 committed steps", 0)
            pids = [c.pid for c in [cluster.daemon, *cluster.workers.values()] if c is not None]
            assert SECRET not in command_lines(pids) and "s3cret" not in command_lines(pids)
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.set("chameleon:other-job:x", 1)  # the job's user reaches its keys only
            hosts = {
                f["worker"]: f.get("address") for _, f in mon.events if f.get("type") == "register"
            }
            s = status(cluster.redis_url)
            plan = s["plan"]
            assert plan["generation"] == 1 and len(plan["pipelines"]) == 2
            assert {st["worker"] for p in plan["pipelines"] for st in p["stages"]} == set(workers)

            proc = chameleonctl(
                cluster.redis_url, "inject", "--worker", "w3", "--cause", "ECC error", "--job", "mh"
            )
            assert proc.returncode == 0, proc.stderr
            assert (
                "XADD chameleon:mh:events '*' type fault worker w3 cause 'ECC error'" in proc.stdout
            )
            wait_for(lambda: commits(2, after_generation=1), 120, "steps on the new plan", 0)
            s = status(cluster.redis_url)
            assert "s3cret" not in proc.stdout + proc.stderr
            # The line `inject --print-only` gives works as it is: TLS flags, not URL settings.
            line = chameleonctl(cluster.redis_url, "inject", "--worker", "w3", "--job", "mh",
                                "--print-only").stdout  # fmt: skip
            argv = shlex.split(line)
            assert argv[:3] == ["redis-cli", "--tls", "--cacert"] and "?" not in line
            cli = subprocess.run(
                [redis_binary("redis-cli", tls=True), *argv[1:]],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
            entry = cli.stdout.strip()
            assert cli.returncode == 0 and re.fullmatch(r"\d+-\d+", entry), cli.stderr
            assert client.xrange("chameleon:mh:events", entry, entry)[0][1]["worker"] == "w3"
        finally:
            client.close()
    logs = list((tmp_path / "run" / "logs").glob("*.log"))
    assert len(logs) == 5 and not any("s3cret" in p.read_text() for p in logs)
    assert hosts == bind, "each worker registers with the address it is bound to"
    # The fault's decision; a follow-up switch to the prepared plan may have come after it.
    d = next(d for d in s["decisions"] if d["failed"])
    assert d["failed"] == ["w3"] and d["selected"] in ("reroute", "dynamic")
    assert [c["policy"] for c in d["candidates"]] == ["reroute", "dynamic", "drop"]
    assert s["plan"]["generation"] >= 2 and "w3" in s["plan"]["excluded"]
    assert s["phase"] in ("training", "transitioning") and s["workers"]["w3"] == "excluded"
