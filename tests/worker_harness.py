"""A small controller and process driver for the worker tests: real workers, real Redis, real plans.

`Controller` does what the daemon does for the workers, and no more: it stores the spec, publishes
the initial plan once every spec worker registered, and answers each new failed worker (from `fault`
events, or a heartbeat lapse) with `decide(..., force=policy)` from the real decision core: SET the
plan key, PUBLISH the generation. It records every event for the assertions. `Workers` starts
`chameleon-worker` processes and kills them with SIGKILL.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from chameleond.auth import Keyring, signed_json
from chameleond.core.plan import Plan, plan_to_dict
from chameleond.core.spec import JobSpec, LayerProfile, parse_spec
from chameleond.protocol import Keys


def signed_doc(kind: str, job: str, doc: dict[str, Any]) -> str:
    """A plan or spec document as the daemon stores it: signed with the job's secret (tests/
    conftest.py sets it in the environment, so the workers the tests start hold it too)."""
    return signed_json(Keyring.configured(os.environ), kind, job, doc)


def builtin_model(
    arch: Mapping[str, Any] | Any, global_batch: int = 8, micro_batch: int = 2
) -> Any:
    """The built-in training (chameleond.worker._builtin) of `arch` (an Arch or a [model.arch]
    mapping), as
    the runtime holds it (a chameleond.worker._trainable.Trainable)."""
    from chameleond.worker import _builtin as builtin
    from chameleond.worker._model import Arch
    from chameleond.worker._trainable import Trainable

    arch = arch if isinstance(arch, Arch) else Arch.from_mapping(arch)
    return Trainable(builtin.training(arch, global_batch, micro_batch))


TINY_ARCH = {
    "d_model": 32,
    "heads": 2,
    "blocks": 4,
    "seq_len": 32,
    "vocab": 256,
    "seed": 7,
    "lr": 3e-3,
}


def tiny_spec(
    job: str,
    *,
    memory_bytes: int = 8 << 30,
    workers: int = 6,
    stages: int = 2,
    arch: dict[str, Any] | None = None,
    global_batch: int = 12,
    micro_batch: int = 2,
) -> dict[str, Any]:
    arch = dict(arch or TINY_ARCH)
    layer = {
        "forward_seconds": 0.001,
        "backward_seconds": 0.002,
        "param_bytes": 50_000,
        "optimizer_bytes": 100_000,
        "activation_bytes": 20_000,
        "output_bytes": 8192,
    }
    return {
        "job": {"name": job, "mtbf_prior_seconds": 3600.0, "rebuild_seconds": 0.05},
        "workers": [
            {"id": f"w{i}", "host": "localhost", "memory_bytes": memory_bytes}
            for i in range(workers)
        ],
        "links": {
            "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 1e-4},
            "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 1e-3},
        },
        "model": {"layers": [{"count": int(arch["blocks"]) + 2, **layer}], "arch": arch},
        "training": {"global_batch": global_batch, "micro_batch": micro_batch},
        # Every survivor trains: these jobs test migration into the shapes all of them make.
        "search": {"spares": False},
        "plan": {"stages": stages},
    }


def drop_pipelines(plan: Plan, dropped: Iterable[int], failed: Iterable[str] = ()) -> Plan:
    """The drop plan after `plan` (the next generation): its other pipelines unchanged, their
    routing rows, nothing migrated, sync groups over the kept owners, the global batch their
    micro-batches hold; `failed` workers excluded."""
    from chameleond.core.policy import Policy
    from chameleond.core.restorer import sync_groups

    gone = set(dropped)
    keep = [p for p in range(len(plan.pipelines)) if p not in gone]
    pipelines = tuple(plan.pipelines[p] for p in keep)
    excluded = tuple(sorted(set(failed)))
    return dataclasses.replace(
        plan,
        generation=plan.generation + 1,
        policy=Policy.DROP,
        global_batch=sum(p.micro_batches for p in pipelines) * plan.micro_batch,
        pipelines=pipelines,
        routing=tuple(plan.routing[p] for p in keep),
        migration=(),
        sync_groups=sync_groups(pipelines, excluded),
        excluded=excluded,
        cause=f"dropped pipeline(s) {sorted(gone)}",
    )


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass
class Record:
    """Events seen by the controller, in arrival order (raw fields plus a local receive time)."""

    events: list[dict[str, str]] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # When the reader last issued a read that returned the whole stream: every event written
    # before then is in `events`. A heartbeat lapse is measured up to then, so a reader that was
    # not scheduled for a while (a loaded machine) does not see live workers as lapsed.
    caught_up_at: float = 0.0

    def of(self, *kinds: str) -> list[dict[str, str]]:
        with self.lock:
            return [e for e in self.events if e.get("type") in kinds]

    def committed(self) -> dict[int, float]:
        """step -> loss, from every step event (all workers of a step report the same loss)."""
        out: dict[int, float] = {}
        for e in self.of("step"):
            out.setdefault(int(e["step"]), float(e["loss"]))
        return out


class EventReader(threading.Thread):
    """XREAD of the job's event stream into a Record (no consumer group: never steals entries)."""

    def __init__(self, url: str, job: str, record: Record) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.keys = Keys(job)
        self.record = record
        self.stopped = threading.Event()
        self.on_event: list[Any] = []

    def run(self) -> None:
        last = "0"
        while not self.stopped.is_set():
            issued = time.time()
            try:
                got = self.client.xread({self.keys.events: last}, count=500, block=100)
            except redis.RedisError:
                if self.stopped.is_set():
                    return
                raise
            streams = cast(list[tuple[str, list[tuple[str, dict[str, str]]]]], got or [])
            for _, entries in streams:
                for entry_id, fields in entries:
                    last = entry_id
                    fields["_received"] = f"{time.time():.4f}"
                    with self.record.lock:
                        self.record.events.append(fields)
                    for cb in self.on_event:
                        cb(fields)
            if sum(len(entries) for _, entries in streams) < 500:
                self.record.caught_up_at = issued

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)
        self.client.close()


class ConnectionWatch(threading.Thread):
    """Announces the workers' processes gone, as the daemon's connection watch does
    (chameleond/daemon/connwatch.py): one CLIENT LIST per period, the notices published."""

    def __init__(self, url: str, job: str, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        from chameleond.daemon.connwatch import Connections

        self.client = redis.Redis.from_url(url)
        self.keys = Keys(job)
        self.period = period
        self.connections = Connections()
        self._halt = threading.Event()

    def run(self) -> None:
        from chameleond.daemon.connwatch import announce

        ring = Keyring.configured(os.environ)
        while not self._halt.wait(self.period):
            try:
                raw = self.client.execute_command("CLIENT", "LIST", "TYPE", "normal")
                _, docs = announce(self.connections, raw, self.keys.job, ring, time.time())
                if docs is not None:
                    self.client.set(self.keys.gone, docs[0])
                    self.client.publish(self.keys.liveness_channel, docs[1])
            except redis.RedisError:
                continue  # Redis restarting or stopped: nobody is announced meanwhile

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.client.close()


class Controller:
    """Plans like the daemon does: the initial plan, then decide(force=policy) per failure; and
    announces the workers' processes gone (`ConnectionWatch`)."""

    def __init__(
        self,
        url: str,
        spec: dict[str, Any],
        *,
        policy: str | list[str],
        heartbeat_lapse: float = 3.0,
        measured: bool = True,
        plan_for: Callable[[Plan, set[str]], Plan] | None = None,
    ) -> None:
        # plan_for(current plan, failed workers) -> the next plan: a hand-built plan in place of
        # decide()'s answer to a failure.
        self.plan_for = plan_for
        # measured=False keeps the spec's layer numbers: the plans' layouts are known in advance.
        self.measured = measured
        self.url = url
        self.spec_dict = spec
        self.spec: JobSpec = parse_spec(spec)
        # One forced policy for every decision, or one per decision in order.
        self.policies = [policy] if isinstance(policy, str) else list(policy)
        self.keys = Keys(self.spec.name)
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.record = Record()
        self.reader = EventReader(url, self.spec.name, self.record)
        self.failed: set[str] = set()
        self.current: Plan | None = None
        self.heartbeat_lapse = heartbeat_lapse
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.connections = ConnectionWatch(url, self.spec.name)
        self.errors: list[str] = []

    def start(self) -> Controller:
        self.client.set(self.keys.spec, signed_doc("spec", self.keys.job, self.spec_dict))
        self.reader.start()
        self._thread.start()
        self.connections.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.connections.stop()
        self.reader.stop()
        self.client.close()

    def publish(self, plan: Plan) -> None:
        self.client.set(self.keys.plan, signed_doc("plan", self.keys.job, plan_to_dict(plan)))
        self.client.publish(self.keys.plans_channel, str(plan.generation))
        self.current = plan
        self.record.plans.append(plan)

    def _loop(self) -> None:
        try:
            self._run()
        except Exception as e:  # surfaced by the tests through `errors`
            self.errors.append(f"{type(e).__name__}: {e}")
            raise

    def _run(self) -> None:
        from chameleond.core.decide import decide, initial_plan

        ids = {w.id for w in self.spec.workers}
        while not self._stop.is_set():
            registered = {e["worker"] for e in self.record.of("register")}
            profiled = {e["worker"] for e in self.record.of("profile")}
            if ids <= registered and ids <= profiled:
                break
            time.sleep(0.05)
        else:
            return
        if self.measured:
            profile = json.loads(self.record.of("profile")[0]["data"])["layers"]
            self.spec = self.spec.with_layers([LayerProfile(**d) for d in profile])
        self.publish(initial_plan(self.spec, generation=1, mtbf_seconds=3600.0))
        seen_faults = 0
        seen_registers = len(self.record.of("register", "rejoin"))
        while not self._stop.is_set():
            time.sleep(0.02)
            faults = self.record.of("fault")
            new = {f["worker"] for f in faults[seen_faults:]} - self.failed
            seen_faults = len(faults)
            new |= self._lapsed() - self.failed
            # A failed worker is back when a new process registers, or an operator sends `rejoin`.
            registers = [e for e in self.record.of("register", "rejoin")]
            back = {r["worker"] for r in registers[seen_registers:]} & self.failed
            seen_registers = len(registers)
            if back:
                self._rejoin(back)
            if not new:
                continue
            self.failed |= new
            assert self.current is not None
            if self.plan_for is not None:
                self.publish(self.plan_for(self.current, set(self.failed)))
                continue
            policy = self.policies[min(len(self.record.plans) - 1, len(self.policies) - 1)]
            d = decide(
                self.spec,
                self.current,
                sorted(self.failed),
                mtbf_seconds=3600.0,
                generation=self.current.generation + 1,
                force=policy,
                cause=f"failed: {', '.join(sorted(new))}",
            )
            if d.plan is None:
                self.errors.append(f"no plan: {d.unrecoverable}")
                return
            self.publish(d.plan)

    def _rejoin(self, back: set[str]) -> None:
        """A failed worker registered again (a restarted process): plan with it taken back."""
        from chameleond.core.decide import decide

        assert self.current is not None
        self.failed -= back
        policy = self.policies[min(len(self.record.plans) - 1, len(self.policies) - 1)]
        d = decide(
            self.spec, self.current, sorted(self.failed), mtbf_seconds=3600.0,
            generation=self.current.generation + 1, joined=sorted(back), force=policy,
            cause=f"rejoined: {', '.join(sorted(back))}",
        )  # fmt: skip
        if d.plan is None:
            self.errors.append(f"no plan on rejoin: {d.unrecoverable}")
            return
        self.publish(d.plan)

    def _lapsed(self) -> set[str]:
        if self.current is None:
            return set()
        last: dict[str, float] = {}
        # As the daemon does: a worker is heard in its heartbeats, steps and acks (a worker that
        # sent a step within its heartbeat period skips the heartbeat).
        for e in self.record.of("heartbeat", "step", "ack"):
            last[e["worker"]] = max(last.get(e["worker"], 0.0), float(e["_received"]))
        # A worker that acked `stopped` left on purpose (fenced or finished): not a failure.
        for e in self.record.of("ack"):
            if e["phase"] == "stopped":
                last.pop(e["worker"], None)
        now = self.record.caught_up_at
        return {
            w for w in self.current.workers if w in last and now - last[w] > self.heartbeat_lapse
        }

    # waiting helpers --------------------------------------------------------------------------

    def wait_for(self, what: str, predicate: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.errors:
                raise AssertionError(f"controller failed: {self.errors}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def wait_steps(self, n: int, timeout: float = 120.0) -> None:
        self.wait_for(f"{n} committed steps", lambda: len(self.record.committed()) >= n, timeout)


class Workers:
    """chameleon-worker subprocesses (or a user's script on the worker library: `command`); logs
    under `log_dir`."""

    def __init__(
        self,
        url: str,
        job: str,
        log_dir: Path,
        *,
        extra_args: list[str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.command = command or [sys.executable, "-m", "chameleond.worker._main"]
        self.extra_args = list(extra_args or [])
        self.url = url
        self.job = job
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.kill_times: dict[str, float] = {}

    def start(
        self,
        ids: Iterable[str],
        env: dict[str, dict[str, str]] | None = None,
        *,
        max_steps: int = 0,
        group_timeout: float = 10.0,
    ) -> None:
        for w in ids:
            penv = dict(os.environ)
            penv.update((env or {}).get(w, {}))
            log = open(self.log_dir / f"{w}.log", "ab")  # noqa: SIM115 - closed with the process
            self.procs[w] = subprocess.Popen(
                [
                    *self.command,
                    "--redis-url",
                    self.url,
                    "--job",
                    self.job,
                    "--worker-id",
                    w,
                    "--group-timeout",
                    str(group_timeout),
                    "--max-steps",
                    str(max_steps),
                    *self.extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=penv,
            )
            log.close()

    def kill(self, w: str) -> float:
        t = time.time()
        os.kill(self.procs[w].pid, signal.SIGKILL)
        self.procs[w].wait()
        self.kill_times[w] = t
        return t

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def log(self, w: str) -> str:
        return (self.log_dir / f"{w}.log").read_text(errors="replace")
