"""chameleon-agent's I/O edge: the job's spec, the worker processes, signals and Redis.

The loop polls the workers' processes, tells the roster (chameleond.agent.supervise) what it
saw, and does what the roster says: writes the faults it reports (signed; a host fault in one
MULTI/EXEC), starts the workers that are due, and keeps the agent's entry in the job's agents
hash current. It runs on the main thread, which also starts every worker: PR_SET_PDEATHSIG fires
when the thread that forked the child ends, so the workers die with the agent's process and with
nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

import redis

from chameleond.agent.slow import SlowControl
from chameleond.agent.supervise import Report, Roster, State, outcome
from chameleond.auth import SECRET_FILE_ENV, AuthError, Keyring
from chameleond.core.hosts import host_slots
from chameleond.core.spec import JobSpec, SpecError, load_spec, parse_spec
from chameleond.events import Fault
from chameleond.protocol import JOB_ENV, REDIS_URL_ENV, Keys, redact_url
from chameleond.redisurl import xadd_replicated
from chameleond.sdnotify import Notifier

log = logging.getLogger("chameleon.agent")
PR_SET_PDEATHSIG = 1
TICK_SECONDS = 0.05  # how often the loop looks at the workers
STATUS_SECONDS = 2.0  # the agents hash entry is rewritten at least this often
SPEC_NOTE_SECONDS = 10.0  # how often the agent waiting for its job's spec says so
STOP_SECONDS = 30.0  # SIGTERM to the workers, then SIGKILL to those still there after this
WORKER_ID_ENV, DEVICE_ENV = "CHAMELEON_WORKER_ID", "CHAMELEON_DEVICE"
BIND_ADDRESS_ENV, CHECKPOINT_DIR_ENV = "CHAMELEON_BIND_ADDRESS", "CHAMELEON_CHECKPOINT_DIR"


class AgentError(Exception):
    """The agent cannot supervise this host (exit 2): the message says why."""


@dataclass(frozen=True)
class AgentConfig:
    job: str
    host: str
    redis_url: str
    keyring: Keyring | None
    command: tuple[str, ...]  # the worker's command line; its identity goes in its environment
    bind_address: str = ""
    checkpoint_dir: str = ""
    secret_file: str = ""
    spec_file: str = ""
    backoff_max: float = 60.0
    together_seconds: float = 0.5

    @property
    def reporter(self) -> str:
        return f"agent:{self.host}"


def worker_env(
    cfg: AgentConfig, worker: str, device: str, base: Mapping[str, str]
) -> dict[str, str]:
    """A worker's environment: the agent's own (Redis URL, secret), plus who the worker is."""
    env = {**base, JOB_ENV: cfg.job, WORKER_ID_ENV: worker, DEVICE_ENV: device}
    env[REDIS_URL_ENV] = cfg.redis_url
    if cfg.bind_address:
        env[BIND_ADDRESS_ENV] = cfg.bind_address
    if cfg.checkpoint_dir:
        env[CHECKPOINT_DIR_ENV] = cfg.checkpoint_dir
    if cfg.secret_file:
        env[SECRET_FILE_ENV] = cfg.secret_file
    return env


def _die_with_agent() -> Callable[[], None]:
    """The child's preexec: PR_SET_PDEATHSIG = SIGKILL, so a worker never trains on, orphaned,
    after its supervisor is gone (kill -9 of the agent, an OOM kill): the job would otherwise
    hold a process nobody restarts or stops, and a new agent would start a second copy of it.
    libc is loaded here, in the agent; the child only calls it. A parent gone before the call
    leaves the child adopted already: it ends itself."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    # Each worker leads its own session: its process group (torch's helpers with it) has its pid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def slots_of(spec: JobSpec, host: str) -> tuple[tuple[str, str], ...]:
    """(worker, device) of each of the host's workers; AgentError when the spec has none there."""
    slots = tuple((s.worker, s.device) for s in host_slots(spec.workers, host))
    if not slots:
        hosts = sorted({w.host for w in spec.workers})
        raise AgentError(
            f"host {host} has no workers in the spec of job {spec.name}; "
            f"its hosts: {', '.join(hosts)} (--host / $CHAMELEON_HOST names this one)"
        )
    return slots


class Agent:
    """One host's agent: its workers' processes and the job's Redis."""

    def __init__(self, cfg: AgentConfig, client: redis.Redis) -> None:
        self.cfg = cfg
        self.client = client
        self.keys = Keys(cfg.job)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = False
        self.notifier = Notifier()
        self.slow = SlowControl(cfg.job, cfg.keyring, client)
        self._preexec = _die_with_agent()

    # ---- signals -------------------------------------------------------------------------------

    def install_signals(self) -> None:
        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("%s: stopping the workers", signal.Signals(signum).name)
            self.stopping = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    # ---- the spec ------------------------------------------------------------------------------

    def spec(self) -> JobSpec | None:
        """The job's spec: --spec FILE, else the daemon's signed one in Redis, waited for (None:
        asked to stop while waiting). AgentError for one that cannot be read."""
        if self.cfg.spec_file:
            try:
                return load_spec(self.cfg.spec_file)
            except SpecError as e:
                raise AgentError(str(e)) from e
        note_at = time.monotonic()
        while not self.stopping:
            why = self._spec_absent_reason()
            if isinstance(why, JobSpec):
                return why
            if time.monotonic() >= note_at:
                log.info("waiting for the spec of job %s: %s", self.cfg.job, why)
                note_at = time.monotonic() + SPEC_NOTE_SECONDS
            time.sleep(0.2)
        return None

    def _spec_absent_reason(self) -> JobSpec | str:
        try:
            raw = self.client.get(self.keys.spec)
        except redis.RedisError as e:
            return f"Redis at {redact_url(self.cfg.redis_url)} unreachable ({e})"
        if raw is None:
            job = self.cfg.job
            return f"no spec at {self.keys.spec} yet; is chameleond running with --job {job}?"
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise SpecError("not a JSON object")
            if self.cfg.keyring is not None:
                self.cfg.keyring.verify_doc("spec", self.cfg.job, doc)
            return parse_spec(doc)
        except AuthError as e:
            return f"the spec at {self.keys.spec} is refused: {e}"
        except (json.JSONDecodeError, SpecError) as e:
            raise AgentError(f"{self.keys.spec}: {e}") from e

    # ---- workers -------------------------------------------------------------------------------

    def start(self, roster: Roster, worker: str, now: float) -> None:
        device = roster.slots[worker].device
        env = worker_env(self.cfg, worker, device, os.environ)
        try:
            proc = subprocess.Popen(  # noqa: S603 - the operator's command line, no shell
                self.cfg.command, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=self._preexec,
            )  # fmt: skip
        except OSError as e:
            log.error("worker %s: cannot start %s: %s", worker, self.cfg.command[0], e)
            roster.unstartable(worker, f"could not start: {e.strerror or e}")
            return
        roster.restarting(worker)
        roster.started(worker, proc.pid, now)
        self.procs[worker] = proc
        log.info("worker %s started on %s (pid %d)", worker, device, proc.pid)

    def poll(self, roster: Roster, now: float) -> bool:
        """Take in the workers that exited; whether any did."""
        changed = False
        for worker, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.procs[worker]
            generation = self.generation() if outcome(code).report and not self.stopping else None
            out = roster.exited(worker, code, now, generation)
            log_at = logging.INFO if out.state is State.DONE else logging.WARNING
            log.log(log_at, "worker %s %s: %s", worker, roster.slots[worker].last_exit, out.meaning)
            changed = True
        return changed

    # ---- Redis ---------------------------------------------------------------------------------

    def generation(self) -> int | None:
        """The current plan's generation (None: no plan, one without the job's signature, or
        Redis away)."""
        try:
            raw = self.client.get(self.keys.plan)
            if raw is None:
                return None
            doc = json.loads(raw)
            if self.cfg.keyring is not None:
                self.cfg.keyring.verify_doc("plan", self.cfg.job, doc)
            return int(doc["generation"])
        except (ValueError, TypeError, KeyError, AuthError, redis.RedisError):
            return None

    def report(self, report: Report) -> None:
        """The report's faults, signed, written at once (the daemon reads them in one batch) and,
        under Sentinel, on a replica before they count as sent (chameleond/redisurl.py)."""
        try:
            reporter = self.cfg.reporter
            entries = []
            for d in report.faults:
                fields = Fault(d.worker, d.cause, d.generation, reporter, time.time()).to_fields()
                if self.cfg.keyring is not None:
                    fields = self.cfg.keyring.sign_event(self.cfg.job, fields)
                entries.append(fields)
            xadd_replicated(self.client, self.keys.events, entries)
        except redis.RedisError as e:
            log.warning("faults of %s not reported: %s", ", ".join(report.workers), e)
            return
        log.warning("reported %s: %s", ", ".join(report.workers), report.faults[0].cause)

    def write_status(self, roster: Roster) -> None:
        doc = json.dumps(roster.status(os.getpid(), time.time()), separators=(",", ":"))
        try:
            self.client.hset(self.keys.agents, self.cfg.host, doc)
        except redis.RedisError as e:
            log.debug("status not written: %s", e)

    # ---- the loop ------------------------------------------------------------------------------

    def supervise(self, roster: Roster) -> int:
        """Start the workers and keep them going until every one ended or the agent is stopped;
        the agent's exit code."""
        for worker in roster.due_starts(time.monotonic()):
            self.start(roster, worker, time.monotonic())
        self.write_status(roster)
        self.notifier.ready(f"{roster.running()} workers of job {self.cfg.job} started")
        written = pinged = time.monotonic()
        while not self.stopping:
            now = time.monotonic()
            changed = self.poll(roster, now)
            for report in roster.reports(now):
                self.report(report)
            for worker in roster.due_starts(now):
                self.start(roster, worker, now)
                changed = True
            self.slow.tick(roster.pids(), now)
            code = roster.exit_code()
            if changed or code is not None or now - written >= STATUS_SECONDS:
                self.write_status(roster)
                written = now
            if code is not None:
                log.info("no worker left to supervise: exiting %d", code)
                return code
            ping = self.notifier.watchdog_seconds / 2
            if ping and now - pinged >= ping:
                self.notifier.notify("WATCHDOG=1")
                pinged = now
            time.sleep(TICK_SECONDS)
        self.stop(roster)
        return 0

    def stop(self, roster: Roster) -> None:
        """SIGTERM to every worker, SIGKILL to those left after STOP_SECONDS; no fault for them."""
        self.notifier.stopping()
        self.slow.close()
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        while self.procs and time.monotonic() < deadline:
            self.poll(roster, time.monotonic())
            time.sleep(TICK_SECONDS)
        for worker, proc in self.procs.items():
            log.warning("worker %s did not stop within %gs: SIGKILL", worker, STOP_SECONDS)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            roster.exited(worker, proc.returncode, time.monotonic())
        self.procs.clear()
        roster.held.clear()
        self.write_status(roster)


def run(cfg: AgentConfig, client: redis.Redis) -> int:
    """The agent's life: the spec, the host's workers, supervision. Raises AgentError (exit 2)."""
    agent = Agent(cfg, client)
    agent.install_signals()
    spec = agent.spec()
    if spec is None:
        return 0
    slots = slots_of(spec, cfg.host)
    log.info(
        "job %s: %d workers on host %s (%s); command: %s",
        cfg.job, len(slots), cfg.host, ", ".join(f"{w} on {d}" for w, d in slots),
        " ".join(cfg.command),
    )  # fmt: skip
    roster = Roster.of(cfg.host, slots, cfg.backoff_max, cfg.together_seconds)
    return agent.supervise(roster)


def status_of(client: redis.Redis, job: str) -> dict[str, Any]:
    """Every agent's entry of the job's agents hash, host -> its JSON, read back."""
    raw: Mapping[Any, Any] = client.hgetall(Keys(job).agents)
    return {str(k): json.loads(v) for k, v in raw.items()}
