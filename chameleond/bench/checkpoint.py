"""Checkpoint overhead on CPU: stop-and-write (sync) against BAFT's pipeline bubbles (bubble).

The packaged job trains failure-free on a local cluster once per mode and round, the modes
interleaved (sync, bubble, sync, ...); every worker checkpoints every --every steps
(chameleon-worker --checkpoint-mode). A checkpoint of step s costs its time in the interval between
the commits of s and s + 1 (sync: the write after commit s; bubble: the writes during step s + 1),
so each run is its own baseline: the intervals that carry a checkpoint against those that do not,
side by side in one run, which this shared machine's drift between runs cannot blur. Measured, per
mode, pooled over the rounds, after --warmup steps:

* step_seconds: the mean interval between consecutive commits without a checkpoint (a mean,
  since commit times are stamped to the millisecond and a checkpoint costs a fraction of one);
* checkpoint_step_seconds: the same for the intervals with one;
* extra_seconds: their difference, the step time one checkpoint costs;
* overhead: extra_seconds / (every x step_seconds), the share of training time checkpoints take at
  this frequency (JSON keys overhead_sync, overhead_bubble);
* from the workers' `checkpoint` events: how many were written, bytes per file, and the mean
  seconds per checkpoint the worker spent writing inside bubbles and with training stopped (outside
  bubbles; for sync, all of it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chameleond.bench.cluster import spec_file, wait_steps, warmed_up, worker_ids
from chameleond.core.spec import SpecError
from chameleond.extras import require
from chameleond.local.cluster import ClusterError, Interrupted, LocalCluster
from chameleond.local.monitor import StreamMonitor

MODES = ("sync", "bubble")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=150, help="measured steps per run (150)")
    parser.add_argument("--warmup", type=int, default=10, help="steps not measured (default 10)")
    parser.add_argument("--every", type=int, default=5, help="steps between checkpoints (5)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode (default 3)")
    parser.add_argument(
        "--workers",
        type=int,
        default=max(2, min(6, (os.cpu_count() or 2) // 2 * 2)),
        help="CPU workers, one core each where the machine has them (default %(default)s)",
    )
    parser.add_argument("--pp", type=int, default=2, help="stages per pipeline (default 2)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")


def _one_run(args: argparse.Namespace, spec: Path, run_dir: Path, mode: str) -> dict[str, Any]:
    ckpt = run_dir / "checkpoints"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(args.every)]
    flags += ["--checkpoint-mode", mode]
    with (
        LocalCluster(
            run_dir, job="bench", workers=worker_ids(spec), spec_path=spec, worker_args=flags
        ) as cluster,
        warmed_up(cluster, args.warmup, args.timeout) as mon,
    ):
        wait_steps(mon, cluster, args.warmup + args.steps, None, args.timeout)
        mon.read_all()
    # Checkpoints every run finished: of the steps before the last committed (the checkpoint of
    # step s is written during step s + 1).
    last = args.warmup + args.steps - 1
    return {
        "intervals": _intervals(mon, args.warmup, args.every),
        "checkpoints": _checkpoints(mon, last),
    }


def _intervals(mon: StreamMonitor, skip: int, every: int) -> dict[bool, list[float]]:
    """Commit-to-commit intervals after `skip` steps: with a checkpoint (True) or without."""
    commits = sorted((c.step, c.at) for c in mon.commits)[skip:]
    out: dict[bool, list[float]] = {True: [], False: []}
    for (step, at), (after, then) in itertools.pairwise(commits):
        if after == step + 1:
            out[after % every == 0].append(then - at)  # carries the checkpoint of `step`
    return out


def _checkpoints(mon: StreamMonitor, before: int) -> list[Mapping[str, str]]:
    return [f for _, f in mon.events if f.get("type") == "checkpoint" and int(f["step"]) < before]


def _summary(events: list[Mapping[str, str]], runs: int, expected: int) -> dict[str, Any]:
    def mean(key: str) -> float | None:
        values = [float(e[key]) for e in events if key in e]
        return round(statistics.fmean(values), 6) if values else None

    return {
        "written": len(events),
        "due": expected * runs,
        "bytes_per_file": mean("bytes"),
        "bubble_seconds": mean("bubble_seconds"),
        "stall_seconds": mean("stall_seconds"),
    }


def run(args: argparse.Namespace) -> int:
    require("worker", "starting workers")
    if min(args.steps, args.every, args.rounds, args.warmup, args.workers, args.pp) < 1:
        print("chameleonctl bench checkpoint: counts must be >= 1", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    try:
        with tempfile.TemporaryDirectory(prefix="chameleon-bench-") as d:
            tmp = Path(d)
            spec = spec_file(tmp, workers=args.workers, pp=args.pp)
            for r in range(args.rounds):
                for mode in MODES:
                    runs[mode].append(_one_run(args, spec, tmp / f"{mode}-{r}", mode))
            workers = len(worker_ids(spec))
    except SpecError as e:
        print(f"chameleonctl bench checkpoint: {e}", file=sys.stderr)
        return 2
    except (ClusterError, Interrupted, KeyboardInterrupt) as e:
        print(f"chameleonctl bench checkpoint: {e}", file=sys.stderr)
        return 1
    due = (args.warmup + args.steps - 1) // args.every * workers
    out: dict[str, Any] = {"every": args.every, "rounds": args.rounds, "workers": workers}
    for m in MODES:
        pooled = {k: [x for r in runs[m] for x in r["intervals"][k]] for k in (True, False)}
        base, carrying = statistics.fmean(pooled[False]), statistics.fmean(pooled[True])
        out[m] = {
            "step_seconds": round(base, 5),
            "checkpoint_step_seconds": round(carrying, 5),
            "extra_seconds": round(carrying - base, 5),
            "intervals": {"with": len(pooled[True]), "without": len(pooled[False])},
            "checkpoints": _summary(
                [e for r in runs[m] for e in r["checkpoints"]], args.rounds, due
            ),
        }
        out[f"overhead_{m}"] = round((carrying - base) / (args.every * base), 4)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"checkpoint every {args.every} steps, {workers} CPU workers, {args.rounds} rounds")
    for m in MODES:
        r, c = out[m], out[m]["checkpoints"]
        print(
            f"  {m:>6}: a step {r['step_seconds']:.4f} s, with a checkpoint "
            f"{r['checkpoint_step_seconds']:.4f} s: {1000 * r['extra_seconds']:+.2f} ms each, "
            f"{100 * out[f'overhead_{m}']:.2f}% of training time at this frequency"
        )
        print(
            f"          {c['written']} written of {c['due']} due, {c['bytes_per_file']:.0f} bytes "
            f"each; per checkpoint {c['bubble_seconds']} s writing in bubbles, "
            f"{c['stall_seconds']} s with training stopped"
        )
    return 0
