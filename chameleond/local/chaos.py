"""The parts of a chaos trial (`chameleonctl bench chaos`): chameleond processes on one job (a
leader and a standby), and the workers' side of the protocol without training.

`Daemon` is a real `chameleond run` process, killed with a real SIGKILL. `PlanFollowers` does
what the workers of a job do towards the daemon and nothing more: register, heartbeat every
0.5 s, and acknowledge each plan that includes them, reading the plans with the workers' own
`PlanWatcher`; a worker `kill`ed here goes silent as a killed process would. Both hold the job's
secret (chameleond/auth.py): the daemon through $CHAMELEON_SECRET, the followers sign what they
send and their watcher refuses plans that do not verify, as workers do. Faults, storms, fuzzed
and forged messages are written by the trial itself (chameleond/bench/chaos.py).
"""

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
from pathlib import Path
from typing import Any

import redis

from chameleond.auth import SECRET_ENV, Keyring
from chameleond.events import Ack, AckPhase, Heartbeat, Register
from chameleond.exits import WorkerExit
from chameleond.protocol import REDIS_URL_ENV, Keys
from chameleond.redis_server import free_port
from chameleond.redisurl import connect

HEARTBEAT_SECONDS = 0.5
TICK_SECONDS = 0.05


class Daemon:
    """`chameleond run` on one job under a consumer name of its own; output in a log file."""

    def __init__(
        self, redis_url: str, job: str, consumer: str, run_dir: Path, secret: str, *args: str
    ) -> None:
        self.redis_url = redis_url
        self.secret = secret
        self.job = job
        self.consumer = consumer
        self.args = list(args)
        self.port = free_port()
        self.log_path = run_dir / f"{job}-{consumer}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False  # by the trial: its exit is no crash

    def start(self) -> Daemon:
        argv = [
            sys.executable, "-m", "chameleond.daemon.cli", "run", "--job", self.job,
            "--http", f"127.0.0.1:{self.port}", "--consumer", self.consumer, *self.args,
        ]  # fmt: skip
        env = {**os.environ, REDIS_URL_ENV: self.redis_url, SECRET_ENV: self.secret}
        env["OMP_NUM_THREADS"] = "1"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - this interpreter and its daemon, no shell
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        return self

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read()
        except OSError:
            return 0, None
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode(errors="replace")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        return self.alive and self.get("/readyz")[0] == 200

    def standing_by(self) -> bool:
        code, body = self.get("/readyz")
        return self.alive and code == 503 and "standing by" in str(body)

    def crashed(self) -> bool:
        """Exited by itself with a failure (a kill by the trial, exit 0 or a fence's exit 9 is
        none)."""
        return (
            self.proc is not None
            and not self.killed
            and self.proc.poll() is not None
            and self.proc.returncode not in (WorkerExit.OK, WorkerExit.FENCED)
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.killed = True
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 40.0) -> int | None:
        """SIGTERM (the daemon drains and exits 0), SIGKILL after `timeout`. Returns the exit
        status, or None if the daemon had to be killed."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None or self.killed else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def tail(self, chars: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


class PlanFollowers(threading.Thread):
    """The workers of a job, as the daemon sees them: registered, heartbeating, acknowledging
    every plan that includes them. Redis errors are waited out (a restart of Redis)."""

    def __init__(
        self, redis_url: str, job: str, workers: list[str], memory_bytes: int, keyring: Keyring
    ) -> None:
        super().__init__(name=f"followers-{job}", daemon=True)
        self.job = job
        self.keys = Keys(job)
        self.keyring = keyring
        self.client = connect(redis_url, socket_timeout=2, socket_connect_timeout=2)
        from chameleond.worker._link import (
            PlanWatcher,  # the workers' own (needs chameleond[worker])
        )

        self.watcher = PlanWatcher(self.client, job, keyring)
        self.workers = list(workers)
        self.memory_bytes = memory_bytes
        self.alive = set(workers)
        self.acked = 0  # the newest generation acknowledged
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def kill(self, worker: str) -> None:
        with self._lock:
            self.alive.discard(worker)

    def stop(self) -> None:
        self._halt.set()
        if self.ident is not None:
            self.join(timeout=5)
        self.client.close()

    def _send(self, fields: dict[str, str]) -> None:
        signed = self.keyring.sign_event(self.job, fields)
        self.client.xadd(self.keys.events, signed)  # type: ignore[arg-type]

    def run(self) -> None:
        registered = False
        last_beat = 0.0
        while not self._halt.wait(TICK_SECONDS):
            try:
                if not registered:
                    for w in self.workers:
                        self._send(Register(w, "localhost", self.memory_bytes).to_fields())
                    registered = True
                with self._lock:
                    alive = sorted(self.alive)
                now = time.monotonic()
                if now - last_beat >= HEARTBEAT_SECONDS:
                    last_beat = now
                    for w in alive:
                        self._send(Heartbeat(w).to_fields())
                self.watcher.refresh()
                plan = self.watcher.newest
                if plan is not None and plan.generation > self.acked:
                    members = set(plan.workers) - set(plan.excluded)
                    for w in sorted(members & set(alive)):
                        self._send(Ack(w, plan.generation, AckPhase.READY).to_fields())
                    self.acked = plan.generation
            except (redis.RedisError, OSError):
                continue
