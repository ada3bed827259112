"""Control-plane load: one chameleond and one Redis serving 1,024 and 8,192 simulated workers.

Per worker count N: a job of N devices (examples/cluster-1024.toml, examples/cluster-8192.toml, or
the first pipelines of them: hosts of 8 devices, pipelines of 8 and 16 stages), one
redis-server, the real daemon (its own process, as `chameleonctl up` starts it), and N simulated
workers (chameleond/bench/simworkers.py: asyncio tasks in processes of at most
WORKERS_PER_PROCESS, speaking the real protocol with two named Redis connections each). One host's
workers run in a process of their own, which is killed (-9) under load, so the kernel closes its
sockets as it does a dead host's. The phases:

* register: every worker registered -> the first plan acked ready by all;
* start-up backlog: the daemon reads what the start-up left in the stream (registrations,
  start-up profiles, acks, the first steps) until it trails the newest entry by under
  SETTLED_BEHIND_SECONDS: how far behind it was (`startup_backlog_seconds`) and how long that
  took (`startup_backlog_read_seconds`), at most --timeout, after which the phases go on;
* steady state (--steady-seconds): Redis commands per worker per second (INFO
  `total_commands_processed`, per command from `commandstats`), Redis output bytes per second,
  daemon and Redis CPU seconds per second (/proc), how far the daemon's reading trails the
  stream at its end (`daemon_behind_seconds`);
* host lost: the kill -> each member's ready ack of the first plan without the host's workers
  (`fault_to_all_acked_p99_seconds`; the plan may keep a survivor out, as a spare); when the
  daemon publishes liveness (Keys(job).prefix + "liveness"), the kill -> its notice
  (`peer_death_announced_seconds`) and -> each peer of a lost worker learning of it
  (`peer_death_detect_seconds`, else null);
* host back: a new process for the host (new incarnations) -> the plan that takes its workers
  back acked by all (`host_back_outcome` "taken back"), or the decision that keeps the plan with
  them on standby (`host_back_outcome` "standby", `host_back_to_decision_seconds`): the daemon
  takes a host back only where that scores higher.

After the sizes, `redis_failover` (unless --no-failover): chameleond/bench/failover.py's figures of
a Sentinel failover under a four-worker job, as `chameleonctl bench failover` reports them.

A simulated worker acks a plan as soon as it has read it (no process groups to build): the times
are the control plane's part of a recovery.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from pathlib import Path
from typing import IO, Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from chameleond.bench.failover import failover_figures
from chameleond.bench.simworkers import layout_of
from chameleond.core.spec import JobSpec, load_spec
from chameleond.jobstate.jobspec import spec_document
from chameleond.local.cluster import Child, ClusterError, LocalCluster, tail, wait_for
from chameleond.protocol import PLAN_POLL_SECONDS, Keys, heartbeat_seconds

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WORKERS_PER_PROCESS = 2048
# Each simulated worker holds two connections (commands, pub/sub), as a real one: 2 N + the
# daemon's few. Redis serves at most its open-file limit less 32.
MAXCLIENTS = 19_900
MICRO_BATCHES_PER_PIPELINE = 16
SETTLED_BEHIND_SECONDS = 1.0  # the daemon's reading this close to the stream's newest: steady


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="1024,8192", help="worker counts, comma-separated")
    parser.add_argument("--step-seconds", type=float, default=2.0, help="simulated step time")
    parser.add_argument("--steady-seconds", type=float, default=30.0, help="steady-state window")
    parser.add_argument("--timeout", type=float, default=600.0, help="limit of each phase (s)")
    parser.add_argument(
        "--control-plane-cpus", type=int, default=0,
        help="run Redis and the daemon on the first N CPUs and the simulated workers on the "
        "others, as on a cluster where the workers have hosts of their own (0: all share all)",
    )  # fmt: skip
    parser.add_argument(
        "--no-failover", dest="failover", action="store_false",
        help="skip `redis_failover` (chameleonctl bench failover: a Sentinel failover under a "
        "four-worker job, which needs torch)",
    )  # fmt: skip


def spec_for(n: int, tmp: Path) -> Path:
    """The example of `n` devices, else the first pipelines of the smallest example that has
    them (8 stages a pipeline, one host's, at 1,024; 16, two hosts', at 8,192), written to `tmp`
    as job `control-{n}`."""
    if n % 8 or n <= 0:
        raise ValueError(f"{n} workers: a multiple of 8 (hosts of 8 devices)")
    example = EXAMPLES / f"cluster-{n}.toml"
    if example.exists():
        return example
    base = load_spec(EXAMPLES / ("cluster-1024.toml" if n <= 1024 else "cluster-8192.toml"))
    if n > len(base.workers):
        raise ValueError(f"{n} workers: more than the largest example has")
    stages = len(base.layout[0])
    if n % stages:
        raise ValueError(f"{n} workers: a multiple of the example's {stages} stages")
    layout = base.layout[: n // stages]
    kept = {w for pipe in layout for w in pipe}
    batch = len(layout) * MICRO_BATCHES_PER_PIPELINE * base.training.micro_batch
    spec = dataclasses.replace(
        base, name=f"control-{n}", workers=tuple(w for w in base.workers if w.id in kept),
        layout=layout, training=dataclasses.replace(base.training, global_batch=batch,
                                                    min_global_batch=batch),
    )  # fmt: skip
    path = tmp / f"control-{n}.json"
    path.write_text(json.dumps(spec_document(spec)))
    return path


class Observations:
    """What the simulated workers' processes print, gathered by one reader thread per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acks: dict[str, list[tuple[int, float]]] = {}  # worker -> (generation, at)
        self.learned: list[tuple[str, str, float]] = []  # (worker, gone peer, at)
        self.up = 0
        self.errors: list[str] = []

    def read(self, stream: IO[bytes]) -> None:
        with stream:
            for line in stream:
                with contextlib.suppress(ValueError):  # a line cut short by the kill
                    self._add(json.loads(line))

    def _add(self, rec: list[Any]) -> None:
        with self.lock:
            if rec[0] == "ack":
                self.acks.setdefault(rec[1], []).append((rec[2], rec[3]))
            elif rec[0] == "learned":
                self.learned.append((rec[1], rec[2], rec[4]))
            elif rec[0] == "up":
                self.up += rec[1]
            else:
                self.errors.append(str(rec[1])[:300])

    def acked_at(self, workers: frozenset[str], generation: int) -> dict[str, float]:
        """Each of `workers` that acked `generation` or a later one: when it first did."""
        with self.lock:
            out = {}
            for w in workers:
                times = [at for gen, at in self.acks.get(w, ()) if gen >= generation]
                if times:
                    out[w] = min(times)
            return out


class Announcements:
    """When each generation was first announced on the job's plans channel, and when each
    liveness notice came, as a subscriber of its own (a thread, a connection) saw them."""

    def __init__(self, client: redis.Redis, job: str) -> None:
        self.at: dict[int, float] = {}
        self.notices: list[float] = []
        self._sub = client.pubsub(ignore_subscribe_messages=True)
        keys = Keys(job)
        self._sub.subscribe(
            **{keys.plans_channel: self._heard, keys.liveness_channel: self._notice}
        )
        self._thread = self._sub.run_in_thread(sleep_time=0.01, daemon=True)

    def _heard(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(ValueError, TypeError):
            self.at.setdefault(int(message["data"]), time.time())

    def _notice(self, message: dict[str, Any]) -> None:
        self.notices.append(time.time())

    def notice_after(self, since: float) -> float | None:
        """When the first liveness notice after unix time `since` came."""
        return next((at for at in self.notices if at >= since), None)

    def stop(self) -> None:
        self._thread.stop()
        self._thread.join(timeout=5)
        self._sub.close()


class SimProcesses:
    """The simulated workers' processes: one per host to lose, the others by WORKERS_PER_PROCESS."""

    def __init__(
        self,
        cluster: LocalCluster,
        spec_path: Path,
        step_seconds: float,
        cpus: set[int] | None = None,
    ) -> None:
        self.cluster = cluster
        self.step_seconds = step_seconds
        self.cpus = cpus  # where the processes run (None: anywhere)
        self.obs = Observations()
        self.base = {"url": cluster.redis_url, "job": cluster.job, "spec": str(spec_path),
                     "step_seconds": step_seconds, "epoch": time.time()}  # fmt: skip
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []

    def start(self, workers: list[tuple[str, str]]) -> subprocess.Popen[bytes]:
        path = self.cluster.run_dir / f"sim-{len(self.procs)}.json"
        path.write_text(json.dumps({**self.base, "workers": workers}))
        log = (self.cluster.run_dir / f"sim-{len(self.procs)}.log").open("ab")
        proc = subprocess.Popen(  # noqa: S603 - this interpreter and a module of this package
            [sys.executable, "-m", "chameleond.bench.simworkers", str(path)],
            stdout=subprocess.PIPE, stderr=log, env=self.cluster.env, start_new_session=True,
        )  # fmt: skip
        log.close()
        if self.cpus is not None:
            pin(proc.pid, self.cpus)
        assert proc.stdout is not None
        reader = threading.Thread(target=self.obs.read, args=(proc.stdout,), daemon=True)
        reader.start()
        self.readers.append(reader)
        self.procs.append(proc)
        return proc

    def check(self) -> None:
        self.cluster.check_daemon()
        for p in self.procs:
            if p.poll() not in (None, -signal.SIGKILL):
                raise ClusterError(f"a simulated workers' process exited {p.returncode}")
        if self.obs.errors:
            raise ClusterError("simulated workers: " + "; ".join(self.obs.errors[:3]))

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for reader in self.readers:
            reader.join(timeout=10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Sample:
    at: float
    commands: int
    per_command: dict[str, int]
    output_bytes: int
    daemon_cpu: float
    redis_cpu: float
    sims_cpu: float


def sample(client: redis.Redis, cluster: LocalCluster, sims: SimProcesses) -> Sample:
    stats: Any = client.info("stats")
    per: Any = client.info("commandstats")
    assert cluster.daemon is not None and cluster.daemon.pid and cluster.redis is not None
    assert cluster.redis.proc is not None
    return Sample(
        time.monotonic(), int(stats["total_commands_processed"]),
        {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in per.items()},
        int(stats["total_net_output_bytes"]), cpu_seconds(cluster.daemon.pid),
        cpu_seconds(cluster.redis.proc.pid),
        sum(cpu_seconds(p.pid) for p in sims.procs if p.poll() is None),
    )  # fmt: skip


def steady_figures(a: Sample, b: Sample, n: int) -> dict[str, Any]:
    dt = b.at - a.at
    per = {k: (v - a.per_command.get(k, 0)) / dt / n for k, v in b.per_command.items()}
    top = sorted(((k, v) for k, v in per.items() if v > 0), key=lambda kv: -kv[1])[:8]
    return {
        "seconds": round(dt, 1),
        "redis_commands_per_worker_per_second": round((b.commands - a.commands) / dt / n, 3),
        "top_commands_per_worker_per_second": {k: round(v, 3) for k, v in top},
        "redis_output_bytes_per_second": round((b.output_bytes - a.output_bytes) / dt),
        "daemon_cpu_seconds_per_second": round((b.daemon_cpu - a.daemon_cpu) / dt, 3),
        "redis_cpu_seconds_per_second": round((b.redis_cpu - a.redis_cpu) / dt, 3),
        "simulated_workers_cpu_seconds_per_second": round((b.sims_cpu - a.sims_cpu) / dt, 3),
    }


def window_cpu(a: Sample, b: Sample, gone_cpu: float) -> dict[str, float]:
    """The CPU seconds each part used from `a` to `b`, and the cores there were: how much of the
    machine the window had (`gone_cpu`: what the processes that ended in it had used at `a`)."""
    return {
        "seconds": round(b.at - a.at, 2),
        "cores": len(os.sched_getaffinity(0)),
        "daemon": round(b.daemon_cpu - a.daemon_cpu, 2),
        "redis": round(b.redis_cpu - a.redis_cpu, 2),
        "simulated_workers": round(b.sims_cpu - (a.sims_cpu - gone_cpu), 2),
    }


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def current_plan(client: redis.Redis, job: str) -> tuple[int, frozenset[str]]:
    """The generation and the members of the job's current plan ((0, {}) before the first)."""
    raw: Any = client.get(Keys(job).plan)
    if raw is None:
        return 0, frozenset()
    layout = layout_of(json.loads(raw))
    return layout.generation, layout.members


class StandbyKept(Exception):
    """The daemon decided to keep its plan with the returning workers on standby (at `at`)."""

    def __init__(self, at: float) -> None:
        super().__init__(f"plan kept at {at}")
        self.at = at


def standby_after(
    client: redis.Redis, job: str, since: float, workers: frozenset[str]
) -> Callable[[], float | None]:
    """A check for a decision after `since` that published no plan and offered all of `workers`
    back (they stay on standby): when it was made, or None."""

    def check() -> float | None:
        entries: Any = client.xrange(Keys(job).decisions, min=f"{int(since * 1000)}-0")
        for _, f in entries:
            f = {k.decode(): v.decode() for k, v in f.items()}
            kept = f.get("kind") == "decision" and not f.get("selected")
            if kept and not f.get("unrecoverable") and workers <= set(json.loads(f["joined"])):
                return float(f.get("at", since))
        return None

    return check


def until_acked(
    client: redis.Redis,
    sims: SimProcesses,
    after: int,
    wanted: Callable[[frozenset[str]], bool],
    timeout: float,
    kept: Callable[[], float | None] | None = None,
) -> tuple[int, frozenset[str], dict[str, float]]:
    """Wait for the first plan above generation `after` whose members are `wanted`, acked ready
    by all of them: its generation, its members and when each acked it. (A plan may leave a
    survivor out, as a spare: the members are the plan's, not the survivors.) `kept`: raises
    StandbyKept once it finds the daemon kept its plan instead."""
    found: dict[str, Any] = {}
    keys = Keys(sims.cluster.job)

    def done() -> bool:
        sims.check()
        if "gen" not in found and kept is not None and (at := kept()) is not None:
            raise StandbyKept(at)
        if "gen" not in found:
            # The plan (a megabyte at 8,192 workers) is read and parsed once per generation
            # committed, not at every poll: the bench takes the cores the daemon is measured on.
            committed = int(client.hget(keys.state, "generation") or 0)
            if committed <= max(after, found.get("seen", 0)):
                return False
            gen, members = current_plan(client, sims.cluster.job)
            found["seen"] = gen
            if gen <= after or not wanted(members):
                return False
            found["gen"], found["members"] = gen, members
        found["acks"] = sims.obs.acked_at(found["members"], found["gen"])
        return len(found["acks"]) == len(found["members"])

    wait_for(done, timeout, "a plan acked by all its members", 0.2)
    return found["gen"], found["members"], found["acks"]


def decisions_since(client: redis.Redis, job: str, since: float) -> list[dict[str, Any]]:
    """The daemon's decision records stored after unix time `since` (the fields people read)."""
    entries: Any = client.xrange(Keys(job).decisions, min=f"{int(since * 1000)}-0")
    out = []
    for _, f in entries:
        f = {k.decode(): v.decode() for k, v in f.items()}
        if f.get("kind") == "decision":
            keep = ("generation", "selected", "cause", "decision_seconds", "search_seconds")
            out.append({k: f[k] for k in keep if k in f})
    return out


def transitions_since(client: redis.Redis, job: str, since: float) -> list[list[Any]]:
    """The state machine's moves stored after unix time `since`: [seconds after it, the phase
    moved to, the cause's first 60 characters]."""
    entries: Any = client.xrange(Keys(job).decisions, min=f"{int(since * 1000)}-0")
    out = []
    for _, f in entries:
        f = {k.decode(): v.decode() for k, v in f.items()}
        if f.get("kind") == "transition":
            at = round(float(f.get("at", since)) - since, 3)
            out.append([at, f.get("to", ""), f.get("cause", "")[:60]])
    return out


def split_cpus(control_plane: int) -> tuple[set[int], set[int]] | None:
    """The CPUs of Redis and the daemon, and those of the simulated workers (None: no split)."""
    if control_plane <= 0:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if control_plane >= len(cpus):
        raise ValueError(f"--control-plane-cpus {control_plane}: this process has {len(cpus)}")
    return set(cpus[:control_plane]), set(cpus[control_plane:])


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def run_size(
    n: int,
    step_seconds: float,
    steady_seconds: float,
    timeout: float,
    split: tuple[set[int], set[int]] | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="chameleon-control-") as tmp:
        spec_path = spec_for(n, Path(tmp))
        spec = load_spec(spec_path)
        with LocalCluster(Path(tmp), job=spec.name, workers=[], spec_path=spec_path,
                          daemon_args=["--log-level", "warning"]) as cluster:  # fmt: skip
            # The bench's own reads wait for a Redis busy with thousands of clients.
            client = redis.Redis.from_url(cluster.redis_url, socket_timeout=120)
            client.config_set("maxclients", MAXCLIENTS)
            sims = SimProcesses(cluster, spec_path, step_seconds, split[1] if split else None)
            heard = Announcements(client, cluster.job)
            out: dict[str, Any] = {"workers": len(spec.workers)}
            if split is not None:
                assert cluster.redis is not None and cluster.redis.proc is not None
                pin(cluster.redis.proc.pid, split[0])
                out["cpus"] = {"control_plane": sorted(split[0]), "simulated": sorted(split[1])}
            try:
                control = split[0] if split else None
                scenario(out, client, cluster, sims, heard, spec, steady_seconds, timeout, control)
            except ClusterError as e:  # a phase that did not complete: the figures so far
                out["error"] = str(e)[:500]
                out["daemon_log_tail"] = (
                    tail(cluster.daemon.log_path, 800) if cluster.daemon else ""
                )
            finally:
                sims.stop()
                heard.stop()
                client.close()
            return out


def scenario(
    out: dict[str, Any],
    client: redis.Redis,
    cluster: LocalCluster,
    sims: SimProcesses,
    heard: Announcements,
    spec: JobSpec,
    steady_seconds: float,
    timeout: float,
    control_cpus: set[int] | None = None,
) -> None:
    """The phases, each adding its figures to `out` as it completes (the daemon on
    `control_cpus`, None: anywhere)."""
    n = len(spec.workers)
    hosts: dict[str, list[tuple[str, str]]] = {}
    for w in spec.workers:
        hosts.setdefault(w.host, []).append((w.id, w.host))
    lost_host = list(hosts)[len(hosts) // 2]
    lost = hosts.pop(lost_host)
    others = [w for ws in hosts.values() for w in ws]
    everyone = frozenset(w.id for w in spec.workers)
    out["lost_host"] = lost_host

    daemon = cluster.start_daemon()
    if control_cpus is not None and daemon.pid is not None:  # the daemon beside Redis
        pin(daemon.pid, control_cpus)
    # Serving before the simulated workers connect: their 2 N connections take ports of the
    # ephemeral range, where the HTTP port was found free.
    wait_for(lambda: _serves(cluster.http_url, daemon), timeout, "the daemon serving HTTP", 0.1)
    t0 = time.time()
    victim = sims.start(lost)
    for i in range(0, len(others), WORKERS_PER_PROCESS):
        sims.start(others[i : i + WORKERS_PER_PROCESS])
    wait_for(lambda: _checked(sims, lambda: sims.obs.up >= n), timeout, "all registered", 0.2)
    out["register_seconds"] = round(time.time() - t0, 2)
    gen1, _, acks = until_acked(client, sims, 0, lambda m: m == everyone, timeout)
    out["first_plan_acked_seconds"] = round(max(acks.values()) - t0, 2)
    raw: Any = client.get(Keys(cluster.job).plan)
    out["plan_bytes"] = len(raw)
    out["plan_bytes_packed"] = _packed_bytes(client, cluster.job)  # what each worker reads
    out["redis_connected_clients"] = int(client.info("clients")["connected_clients"])

    time.sleep(2 * sims.step_seconds)  # past the first steps and their profiles
    # The start-up (every worker's registration and start-up profile, the first plan's acks)
    # leaves the daemon a backlog to read; the steady state begins once it has (--timeout).
    settled = time.time()
    out["startup_backlog_seconds"] = behind = behind_seconds(client, cluster.job)
    while (behind or 0.0) >= SETTLED_BEHIND_SECONDS and time.time() - settled < timeout:
        time.sleep(0.5)  # a daemon that never gets there is measured as it is: behind
        behind = behind_seconds(client, cluster.job)
    out["startup_backlog_read_seconds"] = round(time.time() - settled, 2)
    before = sample(client, cluster, sims)
    time.sleep(steady_seconds)
    sims.check()
    out["steady"] = steady_figures(before, sample(client, cluster, sims), n)
    out["steady"]["daemon_behind_seconds"] = behind_seconds(client, cluster.job)

    # What the daemon prepared for the plan's next fault, while it trained.
    out["prepared_before_loss"] = _prepared(cluster.http_url)
    sent = _output_bytes(client)
    at_loss, victim_cpu = sample(client, cluster, sims), cpu_seconds(victim.pid)
    killed_at = out["killed_at"] = time.time()
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    gone = frozenset(w for w, _ in lost)
    survivors = everyone - gone
    try:
        gen2, without, acks = until_acked(client, sims, gen1, gone.isdisjoint, timeout)
    finally:  # how soon the peers learned of the loss, whether or not the plan after it came
        with sims.obs.lock:
            learned = [at - killed_at for _, peer, at in sims.obs.learned if peer in gone]
        out["peer_death_learned_p99_seconds"] = quantile(learned, 0.99)
        out["peer_death_detect_seconds"] = round(max(learned), 3) if learned else None
        # The daemon's part: its notice published (the rest is each peer's loop reading it)
        out["peer_death_announced_seconds"] = _since(heard.notice_after(killed_at), killed_at)
    delays = [at - killed_at for at in acks.values()]
    out["fault_to_all_acked_p50_seconds"] = quantile(delays, 0.5)
    out["fault_to_all_acked_p99_seconds"] = quantile(delays, 0.99)
    out["fault_to_all_acked_max_seconds"] = round(max(delays), 3)
    out["redis_output_bytes_loss_to_acked"] = _output_bytes(client) - sent
    out["loss_to_acked_cpu"] = window_cpu(at_loss, sample(client, cluster, sims), victim_cpu)
    out["plan_without_host"] = {
        "generation": gen2,
        "workers": len(without),
        "survivors": len(survivors),
        "packed_bytes": _packed_bytes(client, cluster.job),
        "delta_bytes": _delta_bytes(client, cluster.job),
    }
    out["decisions_after_loss"] = decisions_since(client, cluster.job, killed_at)
    moves = out["transitions_after_loss"] = transitions_since(client, cluster.job, killed_at)
    # The control plane's part: the kill -> the plan without the host committed and published
    # (the daemon's own record); the rest is each worker reading it and acking.
    out["fault_to_plan_published_seconds"] = next(
        (at for at, phase, _ in moves if phase == "transitioning"), None
    )
    planned = [at for at, phase, _ in moves if phase == "planning"]
    published = out["fault_to_plan_published_seconds"]
    # The decision itself (the planner's thread) and its commit.
    out["planning_to_published_seconds"] = (
        round(published - planned[-1], 3) if planned and published is not None else None
    )
    out["fault_to_plan_announced_seconds"] = _since(heard.at.get(gen2), killed_at)
    first, named, faults = _faults_after(client, cluster.job, killed_at, gone)
    out["first_fault_added_seconds"] = _since(first, killed_at)
    # Every lost worker named by some survivor's fault: when the daemon's gathering may end.
    out["all_lost_named_seconds"] = _since(named, killed_at)
    out["faults_after_loss"] = faults

    back_at = time.time()
    sims.start(lost)
    kept = standby_after(client, cluster.job, back_at, gone)
    try:
        gen3, back, acks = until_acked(client, sims, gen2, gone.issubset, timeout, kept)
    except StandbyKept as standby:
        # The daemon kept its plan, the host's workers on standby: no plan to ack.
        out["host_back_outcome"] = "standby"
        out["host_back_to_decision_seconds"] = round(standby.at - back_at, 3)
    else:
        delays = [at - back_at for at in acks.values()]
        out["host_back_outcome"] = "taken back"
        out["host_back_to_all_acked_p99_seconds"] = quantile(delays, 0.99)
        out["host_back_to_all_acked_max_seconds"] = round(max(delays), 3)
        out["host_back_to_plan_announced_seconds"] = _since(heard.at.get(gen3), back_at)
        out["plan_with_host"] = {"generation": gen3, "workers": len(back)}
    out["decisions_after_return"] = decisions_since(client, cluster.job, back_at)


def behind_seconds(client: redis.Redis, job: str) -> float | None:
    """How far the daemon's reading trails the job's stream: the newest entry's time less the
    newest delivered to the daemon's group (entry ids are Redis's clock in ms; XINFO GROUPS's
    `lag` needs Redis 7). None before the group exists."""
    events = Keys(job).events
    groups: Any = client.xinfo_groups(events)
    if not groups:
        return None
    stream: Any = client.xinfo_stream(events)

    def ms(entry_id: Any) -> int:
        text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        return int(text.split("-")[0])

    return max(0, ms(stream["last-generated-id"]) - ms(groups[0]["last-delivered-id"])) / 1000


def _faults_after(
    client: redis.Redis, job: str, since: float, lost: Collection[str]
) -> tuple[float | None, float | None, int]:
    """The survivors' `fault` events after unix time `since`, as Redis took them (entry ids'
    times, while the stream holds them): the first's time, when every worker of `lost` had been
    named by one (None: not all were), and how many there were."""
    first, named, count, waiting = None, None, 0, set(lost)
    start = f"{int(since * 1000)}-0"
    for _ in range(20):
        page: Any = client.xrange(Keys(job).events, min=start, count=5000)
        for entry_id, fields in page:
            if fields.get(b"type") != b"fault":
                continue
            at = int(entry_id.split(b"-")[0]) / 1000
            first, count = first if first is not None else at, count + 1
            waiting.discard(fields.get(b"worker", b"").decode())
            if not waiting and named is None:
                named = at
        if len(page) < 5000:
            break
        start = "(" + page[-1][0].decode()
    return first, named, count


def _since(at: float | None, start: float) -> float | None:
    return round(at - start, 3) if at is not None else None


def _output_bytes(client: redis.Redis) -> int:
    stats: Any = client.info("stats")
    return int(stats["total_net_output_bytes"])


def _packed_bytes(client: redis.Redis, job: str) -> int:
    """The current plan as the workers read it (Keys.plan_packed), in bytes."""
    return int(client.strlen(Keys(job).plan_packed))


def _delta_bytes(client: redis.Redis, job: str) -> int | None:
    """The current plan's delta as published (None: it went whole)."""
    raw: Any = client.get(Keys(job).plan_delta)
    return len(raw) if raw is not None else None


def _prepared(url: str) -> dict[str, float]:
    """The daemon's preparations between faults so far: how many, and their CPU seconds
    (`chameleon_prepare_seconds`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:  # noqa: S310 - our http:// URL
        text = r.read().decode()
    figures = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "chameleon_prepare_seconds"
        for sample in family.samples
    }
    return {
        "count": int(figures.get("chameleon_prepare_seconds_count", 0)),
        "cpu_seconds": round(figures.get("chameleon_prepare_seconds_sum", 0.0), 3),
    }


def _serves(url: str, daemon: Child) -> bool:
    if not daemon.alive:
        raise ClusterError(f"chameleond exited with {daemon.proc and daemon.proc.poll()}")
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=1):  # noqa: S310 - our http:// URL
            return True
    except urllib.error.HTTPError:  # answered: it serves
        return True
    except OSError:
        return False


def _checked(sims: SimProcesses, predicate: Callable[[], bool]) -> bool:
    sims.check()
    return predicate()


def run(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in str(args.workers).split(",") if x.strip()]
    split = split_cpus(args.control_plane_cpus)
    figures = {
        str(n): run_size(n, args.step_seconds, args.steady_seconds, args.timeout, split)
        for n in sizes
    }
    detect = [
        f["peer_death_detect_seconds"] for f in figures.values() if "peer_death_detect_seconds" in f
    ]
    known = [d for d in detect if d is not None]
    result = {
        "control_plane": figures,
        "peer_death_detect_seconds": max(known) if known and len(known) == len(figures) else None,
        "heartbeat_seconds": {str(n): heartbeat_seconds(n) for n in sizes},
        "plan_poll_seconds": PLAN_POLL_SECONDS,
        "step_seconds": args.step_seconds,
        "redis_failover": failover_figures() if args.failover else None,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for n, f in figures.items():
        s = f.get("steady", {})
        print(
            f"{n:>5} workers: {s.get('redis_commands_per_worker_per_second')} Redis commands/"
            f"worker/s, daemon {s.get('daemon_cpu_seconds_per_second')} CPU s/s, Redis "
            f"{s.get('redis_cpu_seconds_per_second')} CPU s/s; host lost -> all acked p99 "
            f"{f.get('fault_to_all_acked_p99_seconds')} s; host back -> {_back(f)}; plan "
            f"{f.get('plan_bytes')} bytes" + (f"; FAILED: {f['error']}" if "error" in f else "")
        )
    print(f"peer death detected within {result['peer_death_detect_seconds']} s")
    if result["redis_failover"] is not None:
        print(f"redis failover: {json.dumps(result['redis_failover'])}")
    return 0


def _back(f: dict[str, Any]) -> str:
    if f.get("host_back_outcome") == "standby":
        return f"standby (plan kept) in {f.get('host_back_to_decision_seconds')} s"
    return f"all acked p99 {f.get('host_back_to_all_acked_p99_seconds')} s"
