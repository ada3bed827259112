"""One local run: bring the cluster up, train, inject faults (or replay a trace), watch, stop.

The loop is the only place that acts on the cluster while it trains; it reads the streams (through
`StreamMonitor`), fires every fault when it is due, feeds the progress view, and ends once the
requested steps have committed, the job is unrecoverable, or the time limit passes. Whatever ends
it, the cluster is torn down before `execute` returns.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from chameleond.local.cluster import ClusterError, LocalCluster
from chameleond.local.faults import Fault, corrupt_newest_checkpoint, send_fault_event
from chameleond.local.monitor import StreamMonitor
from chameleond.local.progress import ProgressView
from chameleond.local.report import Injection
from chameleond.local.slowdown import Slowdown
from chameleond.protocol import redact_url
from chameleond.records import entry_seconds
from chameleond.redisurl import connect
from chameleond.traces.replay import ReplayStep


@dataclass
class RunOptions:
    job: str
    workers: Sequence[str]
    steps: int
    spec_path: Path
    run_dir: Path
    global_batch: int
    faults: Sequence[Fault] = ()
    replay: Sequence[ReplayStep] = ()
    policy: str | None = None
    redis_url: str | None = None
    bind_addresses: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float = 600.0
    daemon_args: Sequence[str] = ()
    checkpoint_every: int = 0  # workers checkpoint into run_dir/checkpoints every N steps
    worker_command: Sequence[str] = ()  # a training script's argv instead of chameleon-worker
    devices: dict[str, str] = field(default_factory=dict)  # worker -> device; absent: cpu


@dataclass
class RunResult:
    completed: bool
    reason: str  # why the run ended
    injections: list[Injection]
    monitor: StreamMonitor
    skipped: list[str]  # faults that could not be injected, with why


class LocalRun:
    def __init__(self, opts: RunOptions, progress: ProgressView) -> None:
        self.opts = opts
        self.progress = progress
        self.injections: list[Injection] = []
        self.skipped: list[str] = []
        self.slowdowns: list[Slowdown] = []

    def execute(self) -> RunResult:
        o = self.opts
        cluster = LocalCluster(
            o.run_dir,
            job=o.job,
            workers=o.workers,
            spec_path=o.spec_path,
            policy=o.policy,
            redis_url=o.redis_url,
            bind_addresses=o.bind_addresses,
            daemon_args=o.daemon_args,
            worker_args=_checkpoints(o),
            worker_command=o.worker_command,
            devices=o.devices,
        )
        with cluster:
            client = connect(cluster.redis_url, decode_responses=True)
            try:
                monitor = StreamMonitor(client, o.job)
                cluster.start_daemon()
                cluster.start_workers()
                self.progress.note(
                    f"cluster up: redis {redact_url(cluster.redis_url)}, status page "
                    f"{cluster.http_url}/, {len(o.workers)} workers; logs in {o.run_dir / 'logs'}"
                )
                completed, reason = self._loop(cluster, monitor)
                monitor.read_all()
            finally:
                for slowdown in self.slowdowns:  # a stopped worker would not take its SIGTERM
                    slowdown.stop()
                client.close()
        self.progress.close()
        return RunResult(completed, reason, self.injections, monitor, self.skipped)

    def _loop(self, cluster: LocalCluster, monitor: StreamMonitor) -> tuple[bool, str]:
        o = self.opts
        faults = list(o.faults)
        replay = list(o.replay)
        deadline = time.monotonic() + o.timeout_seconds
        first_at: float | None = None
        self.progress.update(steps_total=o.steps)
        while True:
            commits = monitor.poll(block_ms=100)
            cluster.check_daemon()
            last = monitor.last_commit
            if first_at is None and last is not None:
                first_at = monitor.commits[0].at
            if commits:
                self._show(monitor)
            elif monitor.state != self.progress.current.state:
                self.progress.update(
                    state=monitor.state, generation=monitor.generation, policy=monitor.policy
                )
            step = last.step if last else None
            since = time.time() - first_at if first_at is not None else None
            for f in [f for f in faults if f.due(step, since)]:
                faults.remove(f)
                self._inject(cluster, f)
            while replay and since is not None and since >= replay[0].seconds:
                self._replay(cluster, replay.pop(0))
            if last is not None and last.step + 1 >= o.steps:
                for f in faults:
                    self.skipped.append(f"{f.action}:{f.worker}@{f.when}: training ended first")
                self.skipped += [
                    f"trace {r.time_ms} ms {r.action} {r.worker}: ended first" for r in replay
                ]
                return True, f"{o.steps} steps committed"
            if monitor.state == "unrecoverable":
                return False, "the job is unrecoverable (see the last decision)"
            if not replay and (gone := cluster.workers_gone()) is not None:
                return False, gone  # nothing left to train, or to restart
            if time.monotonic() > deadline:
                return False, f"time limit of {o.timeout_seconds:.0f} s reached"

    def _show(self, monitor: StreamMonitor) -> None:
        c = monitor.commits
        tput = None
        if len(c) >= 2 and c[-1].at > c[-2].at:
            tput = self.opts.global_batch / (c[-1].at - c[-2].at)
        self.progress.update(
            step=c[-1].step,
            loss=c[-1].loss,
            samples_per_second=tput,
            state=monitor.state,
            generation=monitor.generation,
            policy=monitor.policy,
        )

    def _inject(self, cluster: LocalCluster, f: Fault) -> None:
        if f.action == "corrupt":
            self._corrupt(f)
            return
        if f.action == "slow":
            self._slow(cluster, f)
            return
        cause = f.default_cause()
        child = cluster.workers.get(f.worker)
        if f.action == "kill":
            if child is None or not child.alive:
                self.skipped.append(f"kill:{f.worker}@{f.when}: the worker is not running")
                return
            at = cluster.kill_worker(f.worker)
            self.progress.note(f"fault: kill -9 {f.worker} (pid {child.pid}) at {f.when}")
        else:
            entry = send_fault_event(
                cluster.redis_url, self.opts.job, f.worker, cause, cluster.keyring
            )
            at = entry_seconds(entry)
            self.progress.note(f"fault: redis-cli XADD fault event for {f.worker} at {f.when}")
        self.injections.append(Injection(at, f.worker, f.action, cause, f.when))

    def _corrupt(self, f: Fault) -> None:
        """No worker is out: the damage shows only if a restore reads the file."""
        path = corrupt_newest_checkpoint(self.opts.run_dir / "checkpoints", f.worker)
        if path is None:
            self.skipped.append(f"corrupt:{f.worker}@{f.when}: no checkpoint file yet")
            return
        self.progress.note(f"fault: {path.name} cut to half its length at {f.when}")

    def _slow(self, cluster: LocalCluster, f: Fault) -> None:
        """No worker is out: the job sees one that steps slower (a fail-slow fault)."""
        assert f.factor is not None
        child = cluster.workers.get(f.worker)
        if child is None or not child.alive or child.pid is None:
            self.skipped.append(f"slow:{f.worker}@{f.when}: the worker is not running")
            return
        slowdown = Slowdown(child.pid, f.factor, seconds=f.seconds).start()
        self.slowdowns.append(slowdown)
        lasting = "until the end" if f.seconds is None else f"for {f.seconds:g} s"
        self.progress.note(
            f"fault: {f.worker} (pid {child.pid}) slowed to {f.factor:g} of its speed "
            f"{lasting} at {f.when}"
        )

    def _replay(self, cluster: LocalCluster, r: ReplayStep) -> None:
        trigger = f"trace {r.node} {r.time_ms} ms"
        try:
            if r.action == "kill":
                at = cluster.kill_worker(r.worker)
                cause = f"trace: {r.node} removed"
                self.progress.note(f"trace: {r.node} removed at {r.time_ms} ms: kill -9 {r.worker}")
            else:
                at = time.time()
                cluster.start_worker(r.worker)
                cause = f"trace: {r.node} added"
                self.progress.note(f"trace: {r.node} added at {r.time_ms} ms: {r.worker} rejoins")
        except ClusterError as e:
            self.skipped.append(f"{trigger}: {e}")
            return
        self.injections.append(Injection(at, r.worker, r.action, cause, trigger))


def _checkpoints(o: RunOptions) -> list[str]:
    """The workers' checkpoint flags. A run starts from scratch: an earlier run's checkpoints in
    the same directory are removed (a worker would otherwise resume from them)."""
    directory = o.run_dir / "checkpoints"
    shutil.rmtree(directory, ignore_errors=True)
    if not o.checkpoint_every:
        return []
    return ["--checkpoint-dir", str(directory), "--checkpoint-every", str(o.checkpoint_every)]
