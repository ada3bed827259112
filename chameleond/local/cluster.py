"""A whole job on one machine: embedded Redis, one chameleond, N chameleon-worker processes.

Every child runs in its own session (so its own process group): a kill -9 of a worker takes its
whole group (torch may fork helpers), and teardown signals each group, waits a bounded time, then
kill -9s whatever is left. `LocalCluster` is a context manager and also installs signal handlers
while it is up: SIGTERM and SIGHUP raise `Interrupted`, SIGINT KeyboardInterrupt (also in a process
started with SIGINT ignored, what a shell script's background command inherits, where Python
would raise nothing), so Ctrl-C, SIGTERM and exceptions all run the same teardown and leave no
process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from chameleond.auth import SECRET_ENV, SECRET_FILE_ENV, Keyring, new_secret_file
from chameleond.protocol import REDIS_URL_ENV
from chameleond.redis_server import RedisServer, free_port

STOP_GRACE_SECONDS = 5.0


class Interrupted(Exception):
    """SIGTERM or SIGHUP arrived while the cluster was up."""


class ClusterError(RuntimeError):
    """A process of the local cluster could not start or died when it must not."""


def console_script(name: str) -> list[str]:
    """argv prefix for one of the project's console scripts, preferring this interpreter's venv."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return [str(beside)]
    found = shutil.which(name)
    if found:
        return [found]
    modules = {
        "chameleond": "chameleond.daemon.cli",
        "chameleon-worker": "chameleond.worker._main",
    }
    return [sys.executable, "-m", modules[name]]


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log: TextIO | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def _die_with_parent() -> None:
    """In the child, before exec: if `chameleonctl` itself is kill -9'd, the kernel kills us too."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux); elsewhere a harmless failure
    except (OSError, AttributeError):
        pass


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # The child leads its own session, so its process group id is its pid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


class LocalCluster:
    def __init__(
        self,
        run_dir: Path,
        *,
        job: str,
        workers: Sequence[str],
        spec_path: Path | None = None,
        policy: str | None = None,
        redis_url: str | None = None,
        bind_addresses: dict[str, str] | None = None,
        daemon_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        worker_args: Sequence[str] = (),
        worker_command: Sequence[str] = (),
        devices: dict[str, str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.job = job
        self.worker_ids = list(workers)
        self.spec_path = spec_path
        self.policy = policy
        self.bind_addresses = bind_addresses or {}
        self.daemon_args = list(daemon_args)
        self.worker_args = list(worker_args)  # appended to every chameleon-worker command line
        # A user's training script instead of chameleon-worker (same flags): [python, script.py]
        self.worker_command = list(worker_command) or console_script("chameleon-worker")
        self.devices = devices or {}  # worker -> cuda:N / npu:N; the others train on the CPU
        self.env = {**os.environ, **(env or {})}
        # Keep each process to one thread: six workers on a 2-core machine must not oversubscribe.
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # The job's secret (docs/security.md): the caller's, else a fresh one for this run, handed
        # to the daemon and every worker through the environment.
        if not (self.env.get(SECRET_ENV) or self.env.get(SECRET_FILE_ENV)):
            self.env[SECRET_FILE_ENV] = str(new_secret_file(self.run_dir / "secret").resolve())
        self.keyring = Keyring.configured(self.env)
        self.redis: RedisServer | None = None
        self._external_redis = redis_url
        self.http_port = free_port()
        self.daemon: Child | None = None
        self.workers: dict[str, Child] = {}
        self._old_handlers: dict[int, Any] = {}
        self._incarnation: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        if self._external_redis:
            return self._external_redis
        assert self.redis is not None, "cluster not started"
        return self.redis.url

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def __enter__(self) -> LocalCluster:
        self._install_signals()
        try:
            self.start_redis()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _install_signals(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Interrupted(signal.Signals(signum).name)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            # Off the main thread signal() raises ValueError: then the caller owns signals.
            with contextlib.suppress(ValueError):
                self._old_handlers[sig] = signal.signal(sig, on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def start_redis(self) -> None:
        if self._external_redis is None and self.redis is None:
            # Its own session, as the daemon and the workers: a Ctrl-C reaches `up` alone, which
            # stops the workers, then the daemon, then Redis.
            self.redis = RedisServer(self.run_dir / "redis", own_session=True).start()

    def _spawn(self, name: str, argv: list[str]) -> Child:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        child = Child(name, argv, logs / f"{name}.log")
        child.log = child.log_path.open("ab")  # type: ignore[assignment]
        child.proc = subprocess.Popen(  # noqa: S603 - argv built from this project's commands, no shell
            argv,
            stdin=subprocess.DEVNULL,
            stdout=child.log,
            stderr=subprocess.STDOUT,
            # The Redis URL goes in the environment: a password in it stays out of `ps`.
            env={**self.env, REDIS_URL_ENV: self.redis_url},
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        return child

    def start_daemon(self) -> Child:
        argv = [
            *console_script("chameleond"),
            "run",
            "--job",
            self.job,
            "--http",
            f"127.0.0.1:{self.http_port}",
            "--state-dir",
            str(self.run_dir / "state"),
        ]
        if self.spec_path is not None:
            argv += ["--spec", str(self.spec_for_job(self.spec_path))]
        if self.policy is not None:
            argv += ["--policy", self.policy]
        argv += self.daemon_args
        self.daemon = self._spawn("chameleond", argv)
        return self.daemon

    def spec_for_job(self, path: Path) -> Path:
        """The spec under this cluster's job name: chameleond refuses a --job that differs from
        the spec's [job] name, and a bench runs a packaged spec as its own job. A copy renamed
        in the run directory when they differ."""
        from chameleond.core.spec import load_spec
        from chameleond.jobstate.jobspec import spec_document

        spec = load_spec(path)
        if spec.name in ("default", self.job):
            return path
        doc = spec_document(spec)
        doc["job"]["name"] = self.job
        renamed = self.run_dir / f"spec-{self.job}.json"
        renamed.write_text(json.dumps(doc, indent=2))
        return renamed

    def start_worker(self, worker: str) -> Child:
        old = self.workers.get(worker)
        if old is not None and old.alive:
            raise ClusterError(f"worker {worker} is already running (pid {old.pid})")
        if old is not None:
            self._close(old)
        argv = [
            *self.worker_command,
            "--job",
            self.job,
            "--worker-id",
            worker,
            "--device",
            self.devices.get(worker, "cpu"),
        ]
        if worker in self.bind_addresses:
            argv += ["--bind-address", self.bind_addresses[worker]]
        argv += self.worker_args
        n = self._incarnation[worker] = self._incarnation.get(worker, 0) + 1
        child = self._spawn(worker if n == 1 else f"{worker}.{n}", argv)
        self.workers[worker] = child
        return child

    def start_workers(self, workers: Sequence[str] | None = None) -> None:
        for w in workers if workers is not None else self.worker_ids:
            self.start_worker(w)

    def kill_worker(self, worker: str) -> float:
        """kill -9 the worker's process group; returns the unix time of the kill."""
        child = self.workers.get(worker)
        if child is None or child.proc is None or not child.alive:
            raise ClusterError(f"worker {worker} is not running")
        at = time.time()
        _signal_group(child.proc, signal.SIGKILL)
        child.proc.wait()
        return at

    def stop_workers(self, *, grace: float = STOP_GRACE_SECONDS) -> None:
        self._stop_children(list(self.workers.values()), grace)

    def stop_daemon(self, *, grace: float = STOP_GRACE_SECONDS) -> None:
        if self.daemon is not None:
            self._stop_children([self.daemon], grace)

    def check_daemon(self) -> None:
        if self.daemon is not None and not self.daemon.alive:
            raise ClusterError(
                f"chameleond exited with {self.daemon.proc.returncode if self.daemon.proc else '?'}"
                f"; see {self.daemon.log_path}:\n{tail(self.daemon.log_path)}"
            )

    def workers_gone(self) -> str | None:
        """When every worker process has exited: what each last logged (its error, usually);
        else None."""
        if not self.workers or any(c.alive for c in self.workers.values()):
            return None
        lines = []
        for c in self.workers.values():
            code = c.proc.returncode if c.proc is not None else None
            last = next(reversed(tail(c.log_path).strip().splitlines()), "(nothing logged)")
            lines.append(f"{c.name} (exit {code}): {last}")
        return "every worker exited; " + "; ".join(lines)

    def stop(self, *, grace: float = STOP_GRACE_SECONDS) -> None:
        """Workers first (they must not outlive their plans), then the daemon, then Redis."""
        try:
            self.stop_workers(grace=grace)
            self.stop_daemon(grace=grace)
            if self.redis is not None:
                self.redis.stop()
                self.redis = None
        finally:
            self._restore_signals()

    def _stop_children(self, children: list[Child], grace: float) -> None:
        for c in children:
            if c.proc is not None and c.proc.poll() is None:
                _signal_group(c.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in children:
            if c.proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            # Whatever is left of the group (the leader or helpers it forked) goes now.
            _signal_group(c.proc, signal.SIGKILL)
            c.proc.wait()
            self._close(c)

    @staticmethod
    def _close(c: Child) -> None:
        if c.log is not None:
            c.log.close()
            c.log = None

    def pids(self) -> list[int]:
        """Every child pid ever started (for tests that check nothing is left behind)."""
        out = [c.pid for c in self.workers.values() if c.pid]
        if self.daemon and self.daemon.pid:
            out.append(self.daemon.pid)
        return out


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
