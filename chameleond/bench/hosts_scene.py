"""The stage of `chameleonctl bench hosts` and tests/test_hosts.py: Redis and chameleond in the root
namespace on the bridge's address, a `chameleon-agent` in each namespaced host, and what a fault
across hosts is measured by (the job's streams, its plan, the agents' status hash).

A worker's process is found by its environment (CHAMELEON_WORKER_ID, which the agent sets) among the
processes of its host's namespace, so a fault hits the real process the agent started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import redis

from chameleond.auth import SECRET_FILE_ENV, new_secret_file
from chameleond.core.plan import PlanError, plan_from_dict
from chameleond.jobs import load_default_spec
from chameleond.jobstate.jobspec import spec_document as document_of
from chameleond.local.cluster import ClusterError, LocalCluster, console_script, wait_for
from chameleond.local.monitor import StreamMonitor
from chameleond.local.netns import Hosts
from chameleond.protocol import CONSUMER_GROUP, REDIS_URL_ENV, Keys
from chameleond.records import DecisionRecord, entry_seconds, read_record
from chameleond.redis_server import RedisServer
from chameleond.redisurl import connect

JOB = "hosts"
HOSTS = ("h0", "h1", "h2")
DEVICES = 2
# Two pipelines of three stages across the three hosts: whichever host is lost, every stage keeps
# a copy on another host (so no fault here needs a checkpoint).
PIPELINES = (("h0-0", "h1-0", "h2-0"), ("h1-1", "h2-1", "h0-1"))
GROUP_TIMEOUT = "3"  # seconds a collective waits on a peer across a partition
REJOINED = ("active", "waiting")  # a worker's states in the daemon's status once it is back


def spec_document() -> dict[str, Any]:
    """The packaged job on the three hosts, written in the hosts form."""
    doc = document_of(load_default_spec())
    memory = doc.pop("workers")[0]["memory_bytes"]
    doc["job"]["name"] = JOB
    # The hosts share this machine's cores: a third of two each, until the workers measure what
    # they get (docs/planner.md, shared hosts).
    doc["hosts"] = [
        {"name": "h[0-2]", "devices": DEVICES, "memory_bytes": memory, "cpu_cores": 0.67}
    ]
    doc["plan"] = {"pipelines": [list(p) for p in PIPELINES]}
    return doc


def workers_of(host: str) -> list[str]:
    return [f"{host}-{i}" for i in range(DEVICES)]


def host_of(worker: str) -> str:
    return worker.rsplit("-", 1)[0]


class Scene:
    """The job on namespaced hosts; a context manager that stops everything it started."""

    def __init__(self, run_dir: Path, hosts: Hosts, spec: Mapping[str, Any]) -> None:
        self.run_dir = run_dir
        self.hosts = hosts
        self.keys = Keys(JOB)
        self.spec_path = run_dir / "spec.json"
        self.spec_path.write_text(json.dumps(spec))
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.env[SECRET_FILE_ENV] = str(new_secret_file(run_dir / "secret").resolve())
        self.redis = RedisServer(run_dir / "redis", host=hosts.bridge_address)
        self.cluster: LocalCluster | None = None
        self.client: redis.Redis | None = None
        self.monitor: StreamMonitor | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.faults: list[tuple[str, float]] = []  # (worker, when) of every fault made here
        self._logs: list[Any] = []

    def __enter__(self) -> Scene:
        self.redis.start()
        self.client = connect(self.redis.url, decode_responses=True)
        self.monitor = StreamMonitor(self.client, JOB)
        self.cluster = LocalCluster(
            self.run_dir, job=JOB, workers=[], spec_path=self.spec_path,
            redis_url=self.redis.url, env=self.env,
        )  # fmt: skip
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.agents.values():
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self._logs:
            f.close()
        if self.cluster is not None:
            self.cluster.stop()
        if self.client is not None:
            self.client.close()
        self.redis.stop()

    # -- acting --------------------------------------------------------------------------------
    def start(self) -> None:
        assert self.cluster is not None
        self.cluster.start_daemon()
        for host in HOSTS:
            self.start_agent(host)

    def start_agent(self, host: str) -> None:
        """`chameleon-agent` in `host`, as its supervisor would start it on that machine."""
        argv = [
            sys.executable, "-m", "chameleond.agent.cli", "--job", JOB, "--host", host,
            "--bind-address", self.hosts.address(host), "--backoff-max", "2",
            "--", *console_script("chameleon-worker"), "--group-timeout", GROUP_TIMEOUT,
        ]  # fmt: skip
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        n = sum(1 for p in logs.glob(f"agent-{host}*.log")) + 1
        log = (logs / f"agent-{host}.{n}.log").open("ab")
        self._logs.append(log)
        self.agents[host] = self.hosts.popen(
            host, argv, env={**self.env, REDIS_URL_ENV: self.redis.url},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def worker_pid(self, worker: str) -> int:
        """The live process of `worker`, found by the identity its agent gave it."""
        needle = f"CHAMELEON_WORKER_ID={worker}".encode()
        for pid in self.hosts.pids(host_of(worker)):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in environ:
                return pid
        raise ClusterError(f"no process of worker {worker} in host {host_of(worker)}")

    def kill_worker(self, worker: str) -> tuple[float, int]:
        """kill -9 `worker`; when, and the plan generation then."""
        pid, gen = self.worker_pid(worker), self.generation()
        since = time.time()
        os.kill(pid, signal.SIGKILL)
        self.faults.append((worker, since))
        return since, gen

    def kill_host(self, host: str) -> tuple[float, int]:
        """Every process of `host` (its agent and its workers) killed at once."""
        gen = self.generation()
        since = time.time()
        self.hosts.kill_host(host)
        self.agents[host].wait()
        self.faults += [(w, since) for w in workers_of(host)]
        return since, gen

    def partition(self, host: str) -> tuple[float, int]:
        gen = self.generation()
        since = time.time()
        self.hosts.partition(host)
        self.faults += [(w, since) for w in workers_of(host)]
        return since, gen

    # -- waiting -------------------------------------------------------------------------------
    def _poll(self) -> StreamMonitor:
        assert self.monitor is not None and self.cluster is not None
        self.monitor.poll(block_ms=50)
        self.cluster.check_daemon()
        return self.monitor

    def wait_commits(self, n: int, timeout: float) -> None:
        wait_for(lambda: len(self._poll().commits) >= n, timeout, f"{n} committed steps", 0)

    def wait_resumed(self, since: float, generation: int, timeout: float) -> float:
        """Seconds from `since` to the first step committed on a plan newer than `generation`."""

        def resumed() -> float | None:
            newer = [c for c in self._poll().commits if c.generation > generation]
            return newer[0].at - since if newer else None

        wait_for(lambda: resumed() is not None, timeout, f"a step after generation {generation}", 0)
        return cast(float, resumed())

    def wait_rejoined(self, workers: Sequence[str], timeout: float) -> None:
        """Until each of `workers` is back in the job, by a new process its agent started: in the
        plan (`active`), or on standby (`waiting`: the daemon judged the current plan better
        without it, and offers it to every later decision), and a step has committed since."""

        def back() -> bool:
            mon = self._poll()
            states = self.status().get("workers", {})
            if any(states.get(w, {}).get("state") not in REJOINED for w in workers):
                return False
            return bool(mon.commits) and mon.commits[-1].generation == self.generation()

        wait_for(back, timeout, f"{', '.join(workers)} back in the job", 0.1)

    def wait_link_measured(
        self, below: float | None, timeout: float, host: str | None = None
    ) -> float:
        """The inter-host bandwidth the workers measured and the daemon plans with, once there is
        one (below `below`, when given, and measured on a link of `host`'s: a busy machine's
        probe between two other hosts reads below the last too, and so can a link's figure
        measured before it was slowed, reported with a later profile)."""

        seen: list[float] = []  # the figure that met the wait, not a later reading of it

        def measured() -> bool:
            self._poll()
            now = self.inter_host_bandwidth()
            if now is None or (below is not None and now >= below):
                return False
            if host is not None and host not in self.slowest_link_hosts():
                return False
            seen.append(now)
            return True

        what = "a measured inter-host link" + ("" if below is None else f" below {below:.0f} B/s")
        wait_for(measured, timeout, what, 0.2)
        return seen[-1]

    # -- reading -------------------------------------------------------------------------------
    def plan(self) -> Any:
        assert self.client is not None
        raw = self.client.get(self.keys.plan)
        if raw is None:
            return None
        try:
            return plan_from_dict(json.loads(cast(str, raw)))
        except (json.JSONDecodeError, PlanError):
            return None

    def generation(self) -> int:
        plan = self.plan()
        return 0 if plan is None else int(plan.generation)

    def status(self) -> dict[str, Any]:
        assert self.cluster is not None
        url = f"{self.cluster.http_url}/api/v1/status"
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - our own http:// URL
            return cast(dict[str, Any], json.load(r))

    def inter_host_bandwidth(self) -> float | None:
        """The inter-host bandwidth the daemon plans with, as the workers' link probes measured
        it (docs/planner.md, "Measured links"); None before any measurement."""
        link = (self.status().get("links") or {}).get("inter_host") or {}
        if not link.get("measured"):
            return None
        return float(link["bandwidth_bytes_per_second"])

    def slowest_link_hosts(self) -> set[str]:
        """The hosts at either end of the slowest measured inter-host link (empty: none)."""
        pairs = [p for p in (self.status().get("links") or {}).get("pairs", []) if p["inter_host"]]
        if not pairs:
            return set()
        slowest = min(pairs, key=lambda p: p["bandwidth_bytes_per_second"])
        return {host_of(slowest["worker"]), host_of(slowest["peer"])}

    def agents_status(self) -> dict[str, dict[str, Any]]:
        assert self.client is not None
        raw = cast(dict[str, str], self.client.hgetall(self.keys.agents))
        return {host: json.loads(doc) for host, doc in raw.items()}

    def decisions(self) -> list[tuple[float, DecisionRecord]]:
        assert self.monitor is not None
        out = []
        for entry_id, fields in self.monitor.decisions:
            record = read_record(entry_id, fields)
            if isinstance(record, DecisionRecord):
                out.append((entry_seconds(entry_id), record))
        return out

    def figures(self) -> dict[str, Any]:
        """What the run lost, repeated or let a fenced worker commit (module docstring)."""
        assert self.monitor is not None and self.client is not None
        self.monitor.read_all()
        decisions = self.decisions()
        unanswered = [
            (w, at) for w, at in self.faults
            if not any(w in d.faults and t >= at - 0.001 for t, d in decisions)
        ]  # fmt: skip
        pending = self.client.xpending_range(self.keys.events, CONSUMER_GROUP, "-", "+", 10_000)
        fault_ids = {i for i, f in self.monitor.events if f.get("type") == "fault"}
        held = [p for p in pending if str(p["message_id"]) in fault_ids]
        per_generation: dict[int, int] = {}
        for _, d in decisions:
            if d.selected:
                per_generation[d.generation] = per_generation.get(d.generation, 0) + 1
        states = self.status().get("workers", {})
        restarted = {
            wid: int(w.get("restarts", 0))
            for host in self.agents_status().values()
            for wid, w in host.get("workers", {}).items()
            if states.get(wid, {}).get("state") in REJOINED
        }  # fmt: skip
        return {
            "hosts": len(HOSTS),
            "lost_events": len(unanswered) + len(held),
            "unanswered_faults": [w for w, _ in unanswered],
            "duplicate_applications": sum(n - 1 for n in per_generation.values()),
            "stale_commits": self.stale_commits(decisions),
            "agent_restarts": sum(restarted.values()),
            "restarted_in_plan": sorted(
                w for w, n in restarted.items() if n and states[w]["state"] == "active"
            ),
            "restarted_on_standby": sorted(
                w for w, n in restarted.items() if n and states[w]["state"] == "waiting"
            ),
            "generations": self.generation(),
            "steps_committed": len(self.monitor.commits),
        }

    def stale_commits(self, decisions: list[tuple[float, DecisionRecord]]) -> int:
        """Step reports of a generation older than a decided plan that excluded their worker,
        made (the worker's clock: one machine here) after that decision."""
        assert self.monitor is not None
        stale = 0
        for entry_id, f in self.monitor.events:
            if f.get("type") != "step":
                continue
            try:
                gen, made = int(f["generation"]), float(f.get("at") or entry_seconds(entry_id))
            except (KeyError, ValueError):
                continue
            worker = f.get("worker", "")
            stale += any(
                d.selected and d.generation > gen and worker in d.failed and made > t
                for t, d in decisions
            )
        return stale


__all__ = ["HOSTS", "JOB", "PIPELINES", "Scene", "host_of", "spec_document", "workers_of"]
