"""Redis that fails over: a job trained through Sentinel while its master is killed.

`Sentinels` runs a real master, a real replica and three real sentinels on loopback (the
redis-server binary, `--sentinel` mode for the sentinels), short timeouts so that a failover takes
about two seconds. `run_failover` trains a local job through a `redis+sentinel://` URL, kills the
master with SIGKILL mid-training (and optionally a worker with kill -9 right after it), and returns
what the job's streams showed: `failover_figures` turns that into the figures of docs/redis.md
(`chameleonctl bench control-plane` reports them as `redis_failover`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from chameleond.local.cluster import LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor
from chameleond.redis_server import RedisServer, free_port, redis_binary
from chameleond.redisurl import connect

SERVICE = "chameleon"
DOWN_AFTER_MS = 1000  # a master silent this long is down for a sentinel
FAILOVER_TIMEOUT_MS = 5000
JOB = "failover"


class Sentinels:
    """A master, its replica and three sentinels watching them as `SERVICE`; a context manager."""

    def __init__(self, run_dir: Path, service: str = SERVICE) -> None:
        self.run_dir = Path(run_dir)
        self.service = service
        self.master = RedisServer(self.run_dir / "master")
        self.replica = RedisServer(self.run_dir / "replica")
        self.ports = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def __enter__(self) -> Sentinels:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 30.0) -> None:
        self.master.start()
        self.replica.start()
        with redis.Redis(port=self.replica.port) as r:
            r.replicaof("127.0.0.1", self.master.port)
        with redis.Redis(port=self.master.port, decode_responses=True) as m:
            wait_for(
                lambda: _replica_state(m.info("replication")) == "online",
                timeout, "the replica in sync",
            )  # fmt: skip
        for i, port in enumerate(self.ports):
            d = self.run_dir / f"sentinel{i}"
            d.mkdir(parents=True, exist_ok=True)
            conf = d / "sentinel.conf"  # a sentinel rewrites its configuration file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {d}\nlogfile {d / 'sentinel.log'}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.service} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {self.service} {FAILOVER_TIMEOUT_MS}\n"
            )
            sentinel = subprocess.Popen(  # noqa: S603 - the redis-server binary, no shell
                [redis_binary(), str(conf), "--sentinel"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            self.procs.append(sentinel)
        wait_for(self._watching, timeout, "three sentinels that know each other and the replica")

    def _watching(self) -> bool:
        for port in self.ports:
            try:
                with redis.Redis(port=port, socket_timeout=1, decode_responses=True) as s:
                    m = s.sentinel_master(self.service)
            except redis.RedisError:
                return False
            if int(m.get("num-other-sentinels", 0)) < 2 or int(m.get("num-slaves", 0)) < 1:
                return False
        return True

    def master_port(self) -> int | None:
        """The master's port as the sentinels name it now (None: none answers)."""
        for port in self.ports:
            with (
                contextlib.suppress(redis.RedisError),
                redis.Redis(port=port, socket_timeout=1) as s,
            ):
                found = s.sentinel_get_master_addr_by_name(self.service)
                if found:
                    return int(found[1])
        return None

    def kill_master(self) -> float:
        """SIGKILL the master (it comes back only by `revive_old_master`); the unix time."""
        assert self.master.proc is not None
        at = time.time()
        self.master.proc.kill()
        self.master.proc.wait()
        return at

    def revive_old_master(self) -> None:
        """Start the killed master again on its port: the sentinels make it a replica of the new
        one, so the job's writes have a replica to wait for again."""
        self.master.proc = None
        self.master.start()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.procs.clear()
        self.replica.stop()
        self.master.stop()


@dataclass
class FailoverRun:
    """What one run showed: every entry the monitor read (from the old master, then the new one),
    the stream as the new master holds it at the end, and the times that matter."""

    seen: list[tuple[str, dict[str, str]]]
    final: list[tuple[str, dict[str, str]]]
    commits: list[tuple[int, int]]  # (generation, step) of every committed step, in order
    plans: dict[int, dict[str, Any]]
    killed_at: float
    resumed_at: float  # when the monitor first saw a step committed after the master's kill
    victim: str = ""
    promoted: bool = False  # the sentinels named another master after the kill
    ready: list[tuple[str, int, int]] = field(default_factory=list)  # worker, generation, attempt


def run_failover(
    run_dir: Path,
    *,
    workers: int = 4,
    pp: int = 2,
    warmup_steps: int = 10,
    after_steps: int = 10,
    kill_worker: bool = False,
    timeout: float = 150.0,
) -> FailoverRun:
    """Train a job through Sentinel, kill its master mid-training (and, with `kill_worker`, the
    last worker just after), and watch until `after_steps` more steps committed, on a plan without
    the dead worker when one was killed."""
    from chameleond.cli.up import build_spec_document
    from chameleond.jobs import load_default_spec

    run_dir = Path(run_dir)
    doc = build_spec_document(
        load_default_spec(), job=JOB, workers=workers, pp=pp, bind_addresses=[],
        mtbf_prior_seconds=None,
    )  # fmt: skip
    spec = run_dir / "spec.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(doc))
    ids = [w["id"] for w in doc["workers"]]
    with Sentinels(run_dir / "redis") as sentinels:
        cluster = LocalCluster(
            run_dir / "run", job=JOB, workers=ids, spec_path=spec, policy="reroute",
            redis_url=sentinels.url,
        )  # fmt: skip
        with cluster:
            cluster.start_daemon()
            cluster.start_workers()
            client = connect(sentinels.url, decode_responses=True, socket_timeout=2)
            mon = StreamMonitor(client, JOB)
            try:
                return _watch(sentinels, cluster, mon, ids, warmup_steps, after_steps,
                              kill_worker, timeout)  # fmt: skip
            finally:
                client.close()


def _watch(
    sentinels: Sentinels,
    cluster: LocalCluster,
    mon: StreamMonitor,
    ids: list[str],
    warmup_steps: int,
    after_steps: int,
    kill_worker: bool,
    timeout: float,
) -> FailoverRun:
    resumed: list[float] = []

    def poll() -> None:
        cluster.check_daemon()
        with contextlib.suppress(redis.RedisError, OSError):  # a failover under way
            if mon.poll(block_ms=50) and not resumed and killed:
                resumed.append(time.time())

    def committed(n: int) -> bool:
        poll()
        return len(mon.commits) >= n

    killed: list[float] = []
    wait_for(lambda: committed(warmup_steps), timeout, f"{warmup_steps} committed steps", 0)
    old_master = sentinels.master.port
    before = len(mon.commits)
    killed.append(sentinels.kill_master())
    victim = ""
    if kill_worker:
        time.sleep(0.5)  # the sentinels have not even found the master down yet
        victim = ids[-1]
        cluster.kill_worker(victim)
    named: list[int | None] = []

    def new_master() -> bool:
        named.append(sentinels.master_port())
        return named[-1] not in (None, old_master)

    wait_for(new_master, 30, "a new master")
    sentinels.revive_old_master()  # a replica of the new one (a busy machine may fail back to it)

    def resumed_on_new_plan() -> bool:
        poll()
        fresh = mon.commits[before:]
        if victim:
            fresh = [c for c in fresh if victim not in mon.members.get(c.generation, {victim})]
        return len(fresh) >= after_steps

    wait_for(resumed_on_new_plan, timeout, f"{after_steps} steps committed after the failover", 0)
    poll()
    held: Any = mon.client.xrange(mon.keys.events)  # decode_responses: text
    final = [(str(i), dict(f)) for i, f in held]
    ready = [
        (f["worker"], int(f["generation"]), int(f.get("attempt", "1")))
        for _, f in mon.events
        if f.get("type") == "ack" and f.get("phase") == "ready"
    ]
    return FailoverRun(
        seen=[(i, dict(f)) for i, f in mon.events],
        final=final,
        commits=[(c.generation, c.step) for c in mon.commits],
        plans=dict(mon.plans),
        killed_at=killed[0],
        resumed_at=resumed[0] if resumed else float("nan"),
        victim=victim,
        promoted=named[-1] not in (None, old_master),
        ready=ready,
    )


# The entries written with WAIT under Sentinel (redisurl.xadd_replicated): a failover must not
# lose one. Any other entry the old master took in its last moments may be lost with it
# (replication is asynchronous; docs/redis.md).
REPLICATED_TYPES = frozenset({"fault"})
LAST_MOMENT_SECONDS = 1.0  # how far before the master's kill an entry may still be unreplicated


def missing_events(run: FailoverRun) -> list[tuple[str, dict[str, str]]]:
    """Entries the monitor read that the new master does not hold, among those it still would
    (the daemon trims acknowledged entries from the head of the stream)."""
    if not run.final:
        return list(run.seen)
    first = _stamp(run.final[0][0])
    held = {i for i, _ in run.final}
    return [(i, f) for i, f in run.seen if _stamp(i) >= first and i not in held]


def lost_events(run: FailoverRun) -> list[tuple[str, dict[str, str]]]:
    """Missing entries a failover must not lose: those written with WAIT, and any written before
    the master's last moment (a replica in sync has those whatever they are)."""
    last_moment = run.killed_at - LAST_MOMENT_SECONDS
    return [
        (i, f)
        for i, f in missing_events(run)
        if f.get("type") in REPLICATED_TYPES or _stamp(i)[0] / 1000 < last_moment
    ]


def duplicate_applications(run: FailoverRun) -> int:
    """Plan generations a worker got ready for more than once in the same attempt, or after a
    later one (a plan applied twice), plus generations published with two different plans."""
    dup = sum(n - 1 for n in Counter(run.ready).values() if n > 1)
    last: dict[str, tuple[int, int]] = {}
    for worker, generation, attempt in run.ready:
        if (generation, attempt) < last.get(worker, (0, 0)):
            dup += 1
        last[worker] = max(last.get(worker, (0, 0)), (generation, attempt))
    return dup


def _replica_state(info: dict[str, Any]) -> str:
    replica = info.get("slave0")
    return str(replica.get("state", "")) if isinstance(replica, dict) else ""


def _stamp(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def failover_figures(run_dir: Path | None = None, *, kill_worker: bool = False) -> dict[str, Any]:
    """One run's figures: `lost_events` (entries read before the failover that the new master
    lacks and had to hold: see `lost_events`), `unreplicated_events` (entries of the master's
    last moment that it took with it), `duplicate_applications` (see `duplicate_applications`),
    `resume_seconds` (master killed -> the first step committed after it seen on the job's
    stream)."""
    with contextlib.ExitStack() as stack:
        if run_dir is None:
            run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="failover-")))
        run = run_failover(run_dir, kill_worker=kill_worker)
    return {
        "lost_events": len(lost_events(run)),
        "unreplicated_events": len(missing_events(run)) - len(lost_events(run)),
        "duplicate_applications": duplicate_applications(run),
        "resume_seconds": round(run.resumed_at - run.killed_at, 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kill-worker", action="store_true",
        help="also kill -9 a worker half a second after the master (a fault during the failover)",
    )  # fmt: skip
    parser.add_argument("--run-dir", type=Path, help="keep the run's logs here (default: a temp)")


def run(args: argparse.Namespace) -> int:
    figures = failover_figures(args.run_dir, kill_worker=args.kill_worker)
    if args.json:
        print(json.dumps({"redis_failover": figures}, indent=2))
    else:
        print(
            f"redis failover: {figures['lost_events']} events lost "
            f"({figures['unreplicated_events']} of the master's last moment unreplicated), "
            f"{figures['duplicate_applications']} plans applied twice, "
            f"training resumed {figures['resume_seconds']:.2f} s after the master's kill"
        )
    return 0
