"""The chaos bench's trial kinds (the list and what each shows: chameleond/bench/chaos.py).

Each is a function of a `Scene` (the running `Bench`, the trial, its keys, the leading and the
standing-by daemon, the workers' side): it does its harm and returns the victims, the ids of their
real faults and when the recovery clock starts. `KINDS` names them; chaos.py runs them.
"""

from __future__ import annotations

import signal
import subprocess
import time
import zlib

from chameleond.auth import SIG_FIELD, event_payload, signed_json
from chameleond.bench.chaos_runner import (
    SETTLE_SECONDS,
    Bench,
    Kind,
    Outcome,
    Scene,
    wait_until,
)
from chameleond.local.chaos import PlanFollowers
from chameleond.local.fuzz import fuzzed_entries
from chameleond.protocol import Keys
from chameleond.redisurl import connect


def one_fault(bench: Bench, keys: Keys, followers: PlanFollowers) -> tuple[str, list[str], float]:
    """A worker of the plan dies and its fault is written: the victim, the fault's id, when."""
    victim = bench.rng.choice([w for p in bench.members(keys) for w in p])
    followers.kill(victim)
    since = time.monotonic()
    return victim, [bench.fault(keys, victim)], since


def kill(s: Scene) -> Outcome:
    bench, t, keys = s.bench, s.trial, s.keys
    victim, ids, since = one_fault(bench, keys, s.followers)
    time.sleep(bench.rng.uniform(0.0, 1.5))
    bench.kill_leader(t, s.leader, s.standby)
    return {victim}, ids, since


def stall(s: Scene) -> Outcome:
    bench, t, keys = s.bench, s.trial, s.keys
    victim, ids, since = one_fault(bench, keys, s.followers)
    time.sleep(bench.rng.uniform(0.0, 1.0))
    assert s.leader.proc is not None
    s.leader.proc.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        if wait_until(s.standby.ready, bench.args.lease_seconds + 60):
            t.takeover_seconds = time.monotonic() - stopped
        else:
            t.crashes += 1
            t.notes.append("the standby never took over from a stalled leader")
    finally:
        s.leader.proc.send_signal(signal.SIGCONT)
    try:
        rc = s.leader.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rc = None
    s.leader.killed = True  # its exit is the point of the trial, checked here
    if rc != 1:
        t.crashes += 1
        t.notes.append(f"the resumed leader exited {rc}, not 1 (lease lost)")
    return {victim}, ids, since


def storm(s: Scene) -> Outcome:
    bench, t, keys = s.bench, s.trial, s.keys
    pipeline = bench.rng.choice(bench.members(keys))
    victims = set(bench.rng.sample(pipeline, 2))
    for v in victims:
        s.followers.kill(v)
    kill_at = bench.rng.randrange(40) if bench.rng.random() < 0.5 else -1
    since, ids = time.monotonic(), []
    for i in range(40):
        if i == kill_at:
            bench.kill_leader(t, s.leader, s.standby)
        if i % 8 == 7:  # a stranger: dead-lettered
            bench.fault(keys, f"stranger{i}")
        else:
            ids.append(bench.fault(keys, bench.rng.choice(sorted(victims))))
    return victims, ids, since


def redis_restart(s: Scene) -> Outcome:
    return outage(s, 0.0)


def redis_outage(s: Scene) -> Outcome:
    return outage(s, s.bench.args.outage_seconds)


def outage(s: Scene, away: float) -> Outcome:
    bench, t, keys = s.bench, s.trial, s.keys
    victim, ids, since = one_fault(bench, keys, s.followers)
    time.sleep(bench.rng.uniform(0.0, 1.0))
    if bench.excluded(keys, {victim}):  # decided before Redis went away
        t.recovery_seconds = time.monotonic() - since
    back = bench.restart_redis(away)
    return {victim}, ids, max(since, back) if away else since


def fuzz(s: Scene) -> Outcome:
    bench, t, keys = s.bench, s.trial, s.keys
    victim = bench.rng.choice([w for p in bench.members(keys) for w in p])
    entries = fuzzed_entries(bench.rng, 300, bench.workers)
    ids: list[str] = []
    since = time.monotonic()
    raw = connect(bench.redis.url)  # bytes in, bytes out
    try:
        for i, fields in enumerate(entries):
            if i == len(entries) // 2:
                s.followers.kill(victim)
                since = time.monotonic()
                ids.append(bench.fault(keys, victim))
            if i % 3:  # signed: what a client holding the secret could write, to the parser
                fields = {**fields, SIG_FIELD: bench.keyring.sign(event_payload(t.job, fields))}
            raw.xadd(keys.events, fields)  # type: ignore[arg-type]
    finally:
        raw.close()
    time.sleep(bench.rng.uniform(0.0, 1.5))
    bench.kill_leader(t, s.leader, s.standby)
    return {victim}, ids, since


def forged(s: Scene) -> Outcome:
    """An unsigned plan and one signed with a stranger's key, both of a higher generation;
    an unsigned fault and one signed with the stranger's key, each about a healthy worker.
    A plan counts as accepted when a worker's watcher (holding the job's key) takes it, or
    the daemon that takes over resumes from it; a fault when a decision answers it."""
    bench, t, keys = s.bench, s.trial, s.keys
    members = [w for p in bench.members(keys) for w in p]
    plan = bench.plan(keys) or {}
    plan.pop(SIG_FIELD, None)
    generation = int(plan.get("generation", 1))
    forged_plans = []
    for n, signer in ((100, None), (200, bench.stranger)):
        doc = {**plan, "generation": generation + n, "excluded": members[1:],
               "cause": "forged"}  # fmt: skip
        text = signed_json(signer, "plan", t.job, doc)
        bench.client.set(keys.plan, text)
        bench.client.set(keys.plan_packed, zlib.compress(text.encode()))  # what workers read
        bench.client.publish(keys.plans_channel, str(generation + n))
        t.forged_sent += 1
        reader = connect(bench.redis.url)
        from chameleond.worker._link import (
            PlanWatcher,  # the workers' own (needs chameleond[worker])
        )

        watcher = PlanWatcher(reader, t.job, bench.keyring)
        watcher.refresh()  # what a worker does on the message
        reader.close()
        forged_plans.append((generation + n, watcher.newest_generation == generation + n))
    healthy = bench.rng.sample(members, 2)
    bench.fault(keys, healthy[0], cause="forged")  # unsigned
    bench.fault(keys, healthy[1], signer=bench.stranger, cause="forged")
    t.forged_sent += 2
    bench.kill_leader(t, s.leader, s.standby)  # the standby resumes from what Redis holds
    code, body = s.standby.get("/api/v1/plan")
    resumed = body.get("generation") if code == 200 and isinstance(body, dict) else None
    for forged_generation, worker_took_it in forged_plans:
        if worker_took_it or resumed == forged_generation:
            t.forged_accepted += 1
            t.notes.append(f"forged plan {forged_generation} accepted")
    victim = bench.rng.choice([w for w in members if w not in healthy])
    s.followers.kill(victim)
    since = time.monotonic()
    ids = [bench.fault(keys, victim)]
    wait_until(lambda: bench.answered(keys, victim), SETTLE_SECONDS)
    for w in healthy:
        if bench.answered(keys, w):
            t.forged_accepted += 1
            t.notes.append(f"the forged fault about {w} was decided")
    return {victim}, ids, since


KINDS: dict[str, Kind] = {
    "kill": kill,
    "stall": stall,
    "storm": storm,
    "redis_restart": redis_restart,
    "redis_outage": redis_outage,
    "fuzz": fuzz,
    "forged": forged,
}
