"""The chaos bench's runner: one trial = a fresh job on the bench's redis-server, two daemons
(a leader and a standby), the workers' side (chameleond/local/chaos.py) and a trial kind
(chameleond/bench/chaos_kinds.py) applied once the job trains; then the figures of the trial
are read from Redis (`Trial`). See chameleond/bench/chaos.py for the kinds and the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from chameleond.auth import Keyring
from chameleond.events import Fault
from chameleond.jobs import load_default_spec
from chameleond.local.chaos import Daemon, PlanFollowers
from chameleond.protocol import CONSUMER_GROUP, Keys
from chameleond.records import DecisionRecord, Entry, read_decisions
from chameleond.redis_server import RedisServer
from chameleond.redisurl import connect

SETTLE_SECONDS = 60.0


@dataclass
class Trial:
    kind: str
    job: str
    lost: int = 0
    duplicates: int = 0
    crashes: int = 0
    forged_sent: int = 0
    forged_accepted: int = 0
    recovery_seconds: float | None = None
    takeover_seconds: float | None = None
    notes: list[str] = field(default_factory=list)


def wait_until(predicate: Callable[[], Any], timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except (redis.RedisError, OSError):
            pass
        time.sleep(step)
    return False


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)  # noqa: S311 - seeded choice of chaos, not a secret
        self.run_dir = args.logs or tmp / "logs"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(tmp / "redis").start()
        self.client = connect(self.redis.url, decode_responses=True, socket_timeout=5)
        # The job's secret: the daemons, the workers' side and the trial's real faults hold it;
        # forged messages are unsigned or signed with a stranger's key.
        self.secret = secrets.token_hex(32)
        self.keyring = Keyring((self.secret.encode(),))
        self.stranger = Keyring((secrets.token_hex(32).encode(),))
        spec = load_default_spec()
        self.workers = [w.id for w in spec.workers]
        self.memory = max(w.memory_bytes for w in spec.workers)

    def close(self) -> None:
        self.client.close()
        self.redis.stop()

    # ---- reading the job ---------------------------------------------------------------------

    def plan(self, keys: Keys) -> dict[str, Any] | None:
        raw = self.client.get(keys.plan)
        return json.loads(raw) if raw else None

    def excluded(self, keys: Keys, workers: set[str]) -> bool:
        plan = self.plan(keys)
        return plan is not None and workers <= set(plan.get("excluded", ()))

    def decisions(self, keys: Keys, *, planned: bool = False) -> list[DecisionRecord]:
        """The job's decision records (`planned`: only those that published a plan)."""
        # decode_responses=True: every field is a str (redis-py's stubs cannot say so).
        entries: list[Entry] = cast(Any, self.client.xrange(keys.decisions))
        return [d for d in read_decisions(entries) if d.selected or not planned]

    def fault(self, keys: Keys, worker: str, signer: Keyring | None = None, **extra: str) -> str:
        """A fault about `worker`, signed with the job's key (or `signer`; None: unsigned)."""
        fields = {**Fault(worker, "chaos").to_fields(), **extra}
        ring = signer if signer is not None else self.keyring
        if extra.get("cause") != "forged" or signer is not None:
            fields = ring.sign_event(keys.job, fields)
        return str(self.client.xadd(keys.events, fields))  # type: ignore[arg-type]

    def restart_redis(self, away: float) -> float:
        """Stop Redis (it writes its append-only file), start it again after `away` seconds;
        returns when it answers again (monotonic)."""
        self.redis.stop()
        time.sleep(away)
        self.redis.start(timeout=30)
        return time.monotonic()

    # ---- one trial ---------------------------------------------------------------------------

    def trial(self, index: int, kind: str, act: Kind) -> Trial:
        """A fresh job, its two daemons and the workers' side; `act` once the job trains."""
        t = Trial(kind, f"chaos{index}")
        keys = Keys(t.job)
        lease = f"{self.args.lease_seconds:g}"
        delay = f"{self.rng.uniform(0.0, 1.0):.2f}"
        common = (
            "--lease-seconds",
            lease,
            "--policy",
            "reroute",
            "--decision-delay-seconds",
            delay,
        )
        first = Daemon(self.redis.url, t.job, "a", self.run_dir, self.secret, *common)
        second = Daemon(self.redis.url, t.job, "b", self.run_dir, self.secret, *common)
        followers = PlanFollowers(self.redis.url, t.job, self.workers, self.memory, self.keyring)
        daemons = (first, second)
        try:
            # Both start at once (a start takes seconds on a loaded machine); whichever takes
            # the lease leads, the other stands by.
            first.start()
            second.start()

            def roles() -> bool:
                return (first.ready() and second.standing_by()) or (
                    second.ready() and first.standing_by()
                )

            if not wait_until(roles, 120, step=0.2):
                t.crashes += 1
                t.notes.append("the daemons did not start: " + first.tail(300) + second.tail(300))
                return t
            leader, standby = (first, second) if first.ready() else (second, first)
            followers.start()
            if not wait_until(lambda: (self.plan(keys) or {}).get("generation", 0) >= 1, 60):
                t.crashes += 1
                t.notes.append("no initial plan")
                return t
            wait_until(lambda: followers.acked >= 1, 10)
            time.sleep(0.3)  # the acknowledgements handled: the job trains
            victims, first_fault, since = act(Scene(self, t, keys, leader, standby, followers))
            self._check(t, keys, victims, first_fault, since, daemons)
        finally:
            try:
                followers.stop()
            finally:
                self._stop_daemons(t, daemons)
        return t

    def _stop_daemons(self, t: Trial, daemons: tuple[Daemon, ...]) -> None:
        # The standby first: stopping the leader first would hand it the job.
        for d in sorted(daemons, key=lambda d: d.ready()):
            if d.crashed():
                t.crashes += 1
                t.notes.append(f"{d.consumer} exited {d.proc.returncode if d.proc else '?'}")
            rc = d.stop()
            if d.alive is False and rc not in (0, None) and not d.killed:
                t.crashes += 1
                t.notes.append(f"{d.consumer} stopped with exit {rc}")

    def members(self, keys: Keys) -> list[list[str]]:
        plan = self.plan(keys) or {}
        excluded = set(plan.get("excluded", ()))
        return [
            [s["worker"] for s in p["stages"] if s["worker"] not in excluded]
            for p in plan.get("pipelines", ())
        ]

    def kill_leader(self, t: Trial, leader: Daemon, standby: Daemon) -> None:
        killed = time.monotonic()
        leader.kill()
        if wait_until(standby.ready, self.args.lease_seconds + 60):
            t.takeover_seconds = time.monotonic() - killed
        else:
            t.crashes += 1
            t.notes.append("the standby never took over")

    # ---- the figures -------------------------------------------------------------------------

    def answered(self, keys: Keys, victim: str) -> bool:
        return any(victim in d.faults for d in self.decisions(keys))

    def _check(self, t: Trial, keys: Keys, victims: set[str], fault_ids: list[str],
               since: float, daemons: tuple[Daemon, ...]) -> None:  # fmt: skip
        recovered = wait_until(lambda: self.excluded(keys, victims), SETTLE_SECONDS)
        if recovered and t.recovery_seconds is None:
            t.recovery_seconds = time.monotonic() - since
        wait_until(lambda: all(self.answered(keys, v) for v in victims), 10)

        def acknowledged() -> bool:
            pending = self.client.xpending_range(keys.events, CONSUMER_GROUP, "-", "+", 10_000)
            held = {str(p["message_id"]) for p in pending}
            return not held & set(fault_ids)

        wait_until(acknowledged, 20)
        time.sleep(1.0)  # a late second decision would show now
        unanswered = [v for v in victims if not self.answered(keys, v)]
        pending = self.client.xpending_range(keys.events, CONSUMER_GROUP, "-", "+", 10_000)
        held = {str(p["message_id"]) for p in pending} & set(fault_ids)
        t.lost += len(unanswered) + len(held)
        if unanswered or held:
            t.notes.append(f"unanswered {sorted(unanswered)}, unacknowledged {sorted(held)}")
        records = self.decisions(keys)
        per_generation: dict[int, int] = {}
        for d in self.decisions(keys, planned=True):
            per_generation[d.generation] = per_generation.get(d.generation, 0) + 1
        t.duplicates += sum(n - 1 for n in per_generation.values())
        for v in victims:
            n = sum(v in d.faults for d in records)
            t.duplicates += max(0, n - 1)
        if not wait_until(lambda: any(d.ready() for d in daemons), self.args.lease_seconds + 30):
            t.crashes += 1
            t.notes.append("no daemon ready after the trial")


@dataclass(frozen=True)
class Scene:
    """What a trial kind acts on once the job trains: the bench, the trial, the job's keys, the
    leading and the standing-by daemon, and the workers' side."""

    bench: Bench
    trial: Trial
    keys: Keys
    leader: Daemon
    standby: Daemon
    followers: PlanFollowers


# What a trial kind returns: the victims, the ids of their real faults, and when the recovery
# clock starts.
Outcome = tuple[set[str], list[str], float]
Kind = Callable[[Scene], Outcome]
