"""Helpers for the daemon's end-to-end tests: chameleond as a real subprocess on a real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from chameleond.auth import Keyring
from chameleond.jobs import load_default_spec
from chameleond.redis_server import free_port

WORKERS = tuple(w.id for w in load_default_spec().workers)


def keyring() -> Keyring:
    """The tests' job secret (tests/conftest.py sets it in the environment every process gets)."""
    ring = Keyring.configured(os.environ)
    assert ring is not None, "tests/conftest.py sets CHAMELEON_SECRET"
    return ring


def signed(fields: dict[Any, Any], job: str = "default") -> dict[str, str]:
    """An event as a worker of `job` sends it: its fields with their signature."""
    return keyring().sign_event(job, fields)


def wait_for(predicate: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Daemon:
    """`chameleond run` in a subprocess; stdout+stderr go to a log file shown on failure."""

    def __init__(self, redis_url: str, workdir: Path, *args: str, job: str = "default") -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.job = job
        self.args = list(args)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"chameleond-{self.port}.log"

    def start(self, env: dict[str, str] | None = None) -> Daemon:
        cmd = [
            sys.executable, "-m", "chameleond.daemon.cli", "run",
            "--redis-url", self.redis_url, "--job", self.job,
            "--http", f"127.0.0.1:{self.port}", "--consumer", "test-daemon",
            "--heartbeat-timeout-seconds", "30", *self.args,
        ]  # fmt: skip
        full_env = {**os.environ, **(env or {})}
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, cwd=self.workdir
        )
        return self

    def wait_ready(self, timeout: float = 20.0) -> Daemon:
        def ready() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"chameleond exited {self.proc.returncode}:\n{self.output()}")
            return self.get("/readyz")[0] == 200

        wait_for(ready, timeout, "chameleond /readyz")
        return self

    def metric(self, line_prefix: str) -> float:
        """The value of the first /metrics line starting with `line_prefix`."""
        _, body = self.get("/metrics")
        for line in str(body).splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{line_prefix} not in /metrics")

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                body = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            body, status = e.read(), e.code
        except OSError:
            return 0, None
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode()

    def status(self) -> dict[str, Any]:
        code, body = self.get("/api/v1/status")
        assert code == 200, (code, body)
        return dict(body)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()

    def terminate(self, timeout: float = 20.0) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout)
        self.log.close()
        return rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if hasattr(self, "log") and not self.log.closed:
            self.log.close()


class Workers:
    """Sends what the workers would send, with redis-py."""

    def __init__(self, client: redis.Redis, job: str = "default") -> None:
        self.client = client
        self.stream = f"chameleon:{job}:events"
        self.job = job

    def send(self, **fields: Any) -> str:
        event = signed({k: str(v) for k, v in fields.items()}, self.job)
        return str(self.client.xadd(self.stream, event))  # type: ignore[arg-type]

    def send_together(self, events: list[dict[str, Any]]) -> None:
        """Several events in one transaction: the daemon reads them in one batch (one host's
        workers failing at once), not one decision apiece."""
        pipe = self.client.pipeline(transaction=True)
        for fields in events:
            pipe.xadd(self.stream, signed({k: str(v) for k, v in fields.items()}, self.job))  # type: ignore[arg-type]
        pipe.execute()

    def register(self, workers: tuple[str, ...] = WORKERS) -> None:
        for w in workers:
            self.send(type="register", worker=w, host="localhost", memory_bytes=2**31)

    def heartbeat(self, workers: tuple[str, ...] = WORKERS) -> None:
        for w in workers:
            self.send(type="heartbeat", worker=w)

    def ready(self, generation: int, workers: tuple[str, ...] | list[str]) -> None:
        for w in workers:
            self.send(type="ack", worker=w, generation=generation, phase="ready")

    def run_first_plan(self) -> None:
        """Register every worker, wait for generation 1 and acknowledge it ready."""
        self.register()
        wait_for(lambda: self.generation() == 1, 15, "generation 1")
        self.ready(1, WORKERS)

    def plan(self) -> dict[str, Any] | None:
        raw = self.client.get(f"chameleon:{self.job}:plan")
        return json.loads(raw) if raw else None

    def generation(self) -> int:
        plan = self.plan()
        return int(plan["generation"]) if plan else 0

    def decisions(self) -> list[dict[str, str]]:
        entries = self.client.xrange(f"chameleon:{self.job}:decisions")
        return [{_s(k): _s(v) for k, v in f.items()} for _, f in entries]


class RunningJob:
    """One job on a real Redis as a daemon test drives it: its daemons (`chameleond run`, one or
    several: restarts, a standby), what its workers would send (`workers`) and a client. Every
    daemon made here is stopped when the test ends (the `running_job` fixture, tests/conftest.py).
    """

    def __init__(
        self, redis_url: str, workdir: Path, client: redis.Redis, job: str = "default"
    ) -> None:
        self.redis_url = redis_url
        self.workdir = workdir
        self.client = client
        self.job = job
        self.workers = Workers(client, job)
        self.daemons: list[Daemon] = []

    def daemon(self, *args: str) -> Daemon:
        """A daemon of this job with these flags, not started yet."""
        d = Daemon(self.redis_url, self.workdir, *args, job=self.job)
        self.daemons.append(d)
        return d

    def start(self, *args: str, env: dict[str, str] | None = None, timeout: float = 20.0) -> Daemon:
        """A daemon of this job started, and ready (/readyz)."""
        return self.daemon(*args).start(env).wait_ready(timeout)

    def start_training(self, *args: str) -> Daemon:
        """A daemon started, every worker registered and generation 1 acknowledged: it trains."""
        daemon = self.start(*args)
        self.train(daemon)
        return daemon

    def train(self, daemon: Daemon) -> None:
        """Every worker registers and acknowledges generation 1; `daemon` says it trains."""
        self.workers.run_first_plan()
        wait_for(lambda: daemon.status()["state"] == "training", 15, "training")

    def next_fault(self, daemon: Daemon, generation: int, out: list[str], worker: str) -> None:
        """The workers of `generation` (all but `out`) acknowledge it and `daemon` trains; then
        `worker` fails, and the next generation leaves out `out` and `worker`."""
        workers = self.workers
        workers.ready(generation, [w for w in WORKERS if w not in out])
        wait_for(lambda: daemon.status()["state"] == "training", 15, f"training {generation}")
        workers.send(type="fault", worker=worker, cause="NIC down")
        wait_for(lambda: workers.generation() == generation + 1, 15, f"the plan after {worker}")
        plan = workers.plan()
        assert plan is not None and sorted(plan["excluded"]) == sorted([*out, worker])

    def stop(self) -> None:
        for d in self.daemons:
            d.stop()


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class Generations:
    """Every generation published on the plans channel, across daemon restarts."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.pubsub = self.client.pubsub()
        self.pubsub.subscribe("chameleon:default:plans")
        self.seen: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            m = self.pubsub.get_message(timeout=0.1)
            if m and m["type"] == "message":
                self.seen.append(int(m["data"]))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pubsub.close()
        self.client.close()
