"""chameleon-agent as a real process on a real Redis: it starts its host's workers with their
identity, restarts one that died (its siblings untouched) after reporting its fault, reports a
host's workers lost together as one transaction, leaves down a worker whose device failed, and
takes its workers with it when it is killed -9.

The job test runs chameleond and four built-in CPU workers under the agent; the others start the
agent with a small script as COMMAND (no torch), the way a user's training script is started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from daemon_harness import Daemon, wait_for

from chameleond.agent.run import status_of
from chameleond.cli.up import build_spec_document
from chameleond.jobs import load_default_spec
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer

JOB = "agent"
HOST = "localhost"  # the host of the packaged spec's workers
WORKERS = ["w0", "w1", "w2", "w3"]
# A user's script: records its identity, then does what $SCRIPT_EXITS says for its worker id
# (an exit code), or sleeps until it is stopped.
SCRIPT = """
import json, os, sys, time
me = os.environ["CHAMELEON_WORKER_ID"]
keys = ("CHAMELEON_JOB", "CHAMELEON_DEVICE", "CHAMELEON_BIND_ADDRESS", "CHAMELEON_REDIS_URL")
with open(os.path.join(sys.argv[1], me + ".json"), "w") as f:
    json.dump({"pid": os.getpid(), **{k: os.environ.get(k) for k in keys}}, f)
code = json.loads(os.environ.get("SCRIPT_EXITS", "{}")).get(me)
if code is None:
    time.sleep(3600)
sys.exit(code)
"""


def spec_file(tmp_path: Path) -> Path:
    doc = build_spec_document(
        load_default_spec(), job=JOB, workers=4, pp=2, bind_addresses=[], mtbf_prior_seconds=None
    )
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(doc))
    return path


class Agent:
    """`python -m chameleond.agent.cli` in a subprocess, its output in a log file."""

    def __init__(
        self, tmp_path: Path, redis_url: str, *args: str, env: dict[str, str] | None = None
    ) -> None:
        self.log_path = tmp_path / "agent.log"
        self.log = self.log_path.open("ab")
        cmd = [sys.executable, "-m", "chameleond.agent.cli", "--job", JOB, "--host", HOST,
               "--redis-url", redis_url, *args]  # fmt: skip
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def entry(client: redis.Redis, host: str = HOST) -> dict[str, Any]:
    return status_of(client, JOB).get(host, {})


def worker_pids(client: redis.Redis) -> dict[str, int]:
    """The pids of the running workers, from the agent's entry."""
    workers = entry(client).get("workers", {})
    return {w: s["pid"] for w, s in workers.items() if s["state"] == "running"}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not reaped yet by its new parent) is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}").exists() else ""
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def faults(client: redis.Redis) -> list[tuple[str, dict[str, str]]]:
    """The faults the agent reported (its workers' peers report theirs too)."""
    events = client.xrange(Keys(JOB).events)
    return [
        (i, f)
        for i, f in events  # type: ignore[union-attr]
        if f.get("type") == "fault" and f.get("reporter") == f"agent:{HOST}"
    ]


def registered(client: redis.Redis, worker: str) -> list[str]:
    """The stream ids of `worker`'s registrations, one per process."""
    events = client.xrange(Keys(JOB).events)
    return [i for i, f in events if f.get("type") == "register" and f["worker"] == worker]  # type: ignore[union-attr]


@pytest.mark.timeout(240)
def test_agent_restarts_dead_workers_which_rejoin_and_dies_with_its_workers(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    daemon = Daemon(redis_server.url, tmp_path, "--spec", str(spec_file(tmp_path)), job=JOB)
    daemon.start().wait_ready()
    agent = Agent(tmp_path, redis_server.url)
    started: list[int] = []
    try:

        def training(after_step: int = -1) -> dict[str, Any] | None:
            assert agent.proc.poll() is None, agent.output()
            s = daemon.status()
            step = s["progress"]["step"]
            moving = s["state"] == "training" and step is not None and step > after_step
            return s if moving else None

        s = wait_for(training, 150, "the job training")
        pids = worker_pids(redis_client)
        started += pids.values()
        assert sorted(pids) == WORKERS and len(set(pids.values())) == 4

        # (1) kill -9 one worker: its fault first, its siblings go on, it is restarted and is back.
        os.kill(pids["w1"], signal.SIGKILL)
        wait_for(lambda: any(f["worker"] == "w1" for _, f in faults(redis_client)), 5, "fault")
        [(reported, fault)] = faults(redis_client)
        assert fault["cause"] == "exited: killed by SIGKILL"
        # The plan w1 died in; its peers' report may have brought the next one already.
        assert s["generation"] <= int(fault["generation"]) <= daemon.status()["generation"]
        wait_for(lambda: daemon.status()["generation"] > s["generation"], 30, "the plan without w1")
        moved_on = daemon.status()
        # Its new process registers: the daemon has it back, alive, and offers it to every
        # decision from now on. On this 2-core host, where four workers train no faster than
        # three, the decision keeps the current plan and w1 waits on standby.
        wait_for(lambda: len(registered(redis_client, "w1")) == 2, 60, "w1 registered again")
        wait_for(
            lambda: daemon.status()["workers"]["w1"]["state"] in ("waiting", "active"), 30,
            "w1 offered back to the job",
        )  # fmt: skip
        wait_for(lambda: training(moved_on["progress"]["step"] or 0), 60, "the siblings training")
        now = worker_pids(redis_client)
        started += now.values()
        assert {w: now[w] for w in ("w0", "w2", "w3")} == {w: pids[w] for w in ("w0", "w2", "w3")}
        assert now["w1"] != pids["w1"]
        [_, again_registered] = registered(redis_client, "w1")
        assert reported < again_registered, "the fault was written before the restart"
        assert entry(redis_client)["restarts"] == 1
        assert entry(redis_client)["workers"]["w1"]["restarts"] == 1

        # (2) kill -9 all of them at once: one host fault, written in one transaction.
        kill_all(list(now.values()))
        wait_for(lambda: len(faults(redis_client)) >= 5, 5, "the host fault")
        every = [i for i, _ in redis_client.xrange(Keys(JOB).events)]  # type: ignore[misc]
        host = faults(redis_client)[1:]
        cause = f"host {HOST} lost its workers: 4 exited within 0.5 s"
        assert sorted(f["worker"] for _, f in host) == WORKERS
        assert all(f["cause"] == cause for _, f in host)
        first = every.index(host[0][0])
        assert every[first : first + 4] == [i for i, _ in host], "consecutive: one MULTI/EXEC"
        again = wait_for(
            lambda: len(p := worker_pids(redis_client)) == 4 and p, 30, "the workers restarted"
        )
        started += again.values()
        assert not set(again.values()) & set(now.values())
        assert entry(redis_client)["restarts"] == 5

        # (4) kill -9 of the agent: every worker it started is gone within a second.
        agent.proc.kill()
        agent.wait()
        deadline = time.monotonic() + 1.0
        while any(alive(p) for p in again.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not [p for p in again.values() if alive(p)], "workers outlived their agent"
    finally:
        agent.stop()
        kill_all(started)
        daemon.stop()


def script_agent(tmp_path: Path, url: str, exits: dict[str, int], *args: str) -> tuple[Agent, Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "workers"
    out.mkdir()
    agent = Agent(
        tmp_path, url, "--spec", str(spec_file(tmp_path)), "--bind-address", "127.0.0.1",
        *args, "--", sys.executable, str(script), str(out),
        env={"SCRIPT_EXITS": json.dumps(exits)},
    )  # fmt: skip
    return agent, out


def test_a_worker_whose_device_failed_stays_down(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    agent, out = script_agent(tmp_path, redis_server.url, {"w1": 7, "w0": 0, "w2": 0, "w3": 3})
    try:
        wait_for(lambda: entry(redis_client).get("restarts", 0) >= 2, 15, "w3 restarted twice")
    finally:
        agent.stop()
    workers = entry(redis_client)["workers"]
    assert workers["w1"] == {
        "pid": None, "state": "device_failed", "restarts": 0, "last_exit": "exited with code 7",
    }  # fmt: skip
    assert workers["w0"]["state"] == "done" and workers["w0"]["restarts"] == 0
    # Only the worker that died for a reason a restart may cure is reported (7 reported itself).
    assert {f["worker"] for _, f in faults(redis_client)} == {"w3"}
    ident = json.loads((out / "w1.json").read_text())
    assert ident["CHAMELEON_JOB"] == JOB and ident["CHAMELEON_DEVICE"] == "cpu"
    assert ident["CHAMELEON_BIND_ADDRESS"] == "127.0.0.1"
    assert ident["CHAMELEON_REDIS_URL"] == redis_server.url


def test_the_agent_exits_1_once_its_workers_ended_and_some_failed(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    agent, _ = script_agent(tmp_path, redis_server.url, {"w0": 0, "w1": 7, "w2": 4, "w3": 0})
    assert agent.wait() == 1, agent.output()
    states = {w: s["state"] for w, s in entry(redis_client)["workers"].items()}
    assert states == {"w0": "done", "w1": "device_failed", "w2": "failed", "w3": "done"}


def test_sigterm_stops_the_workers_and_reports_no_fault(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    agent, _ = script_agent(tmp_path, redis_server.url, {})
    try:
        wait_for(lambda: len(worker_pids(redis_client)) == 4, 15, "four workers")
        pids = list(worker_pids(redis_client).values())
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait() == 0, agent.output()
    finally:
        agent.stop()
    assert not [p for p in pids if alive(p)]
    assert faults(redis_client) == []


def test_kill_9_of_the_agent_takes_its_workers(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    agent, _ = script_agent(tmp_path, redis_server.url, {})
    try:
        wait_for(lambda: len(worker_pids(redis_client)) == 4, 15, "four workers")
        pids = list(worker_pids(redis_client).values())
        agent.proc.kill()
        agent.wait()
        deadline = time.monotonic() + 1.0
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = [p for p in pids if alive(p)]
        kill_all(left)
        assert not left, "workers outlived their agent"
    finally:
        agent.stop()


def test_a_host_the_spec_does_not_have_is_refused(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    spec = str(spec_file(tmp_path))
    agent = Agent(tmp_path, redis_server.url, "--spec", spec, "--host", "gpu9")
    assert agent.wait() == 2
    assert "host gpu9 has no workers in the spec of job agent; its hosts: localhost" in (
        agent.output()
    )


def test_without_a_secret_the_agent_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAMELEON_SECRET")}
    proc = subprocess.run(
        [sys.executable, "-m", "chameleond.agent.cli", "--job", JOB],
        capture_output=True, text=True, env=env, timeout=30, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "no secret" in proc.stderr


def test_the_agent_does_not_import_torch() -> None:
    code = "import sys, chameleond.agent.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
