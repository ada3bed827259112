"""Recovery on CPU: reroute and dynamic against a restart from a checkpoint; estimator accuracy.

Three runs of the packaged job on a local cluster, in this order, in one invocation:

* reroute: the daemon forced to reroute (--policy reroute); after --warmup committed steps one
  worker is kill -9'd; measured: the kill -> the first step committed by every worker of the new
  plan (Redis stream timestamps of the step events).
* dynamic: the same with --policy dynamic (layout search, migration of parameters and optimizer
  state, asymmetric pipelines).
* restart: the same kill, then what a restart-the-world system does: every process is stopped,
  the whole job (daemon and every worker, the dead one replaced) starts again, and the model and
  optimizer state are reloaded from a checkpoint. The workers keep no checkpoint of their own, so
  the checkpoint is measured as what it costs: torch.save then torch.load of the whole model's
  parameters and AdamW state (built from the job's architecture), added to the measured time from
  the kill to the first step committed by the restarted job. Lost work since the last checkpoint is
  not counted, which favours the restart.

step_time_error: for every plan that ran at least three steps, |measured - estimated| / measured,
where measured is the median over its steps of the slowest worker's reported step seconds, and
estimated is the plan's own estimate; the figure is the largest of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from chameleond.local.cluster import ClusterError, Interrupted, LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor

VICTIM = "w3"  # a stage-1 worker of the packaged 2 x 3 layout (the head: loss and largest state)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup", type=int, default=4, help="steps before the kill (default 4)")
    parser.add_argument("--after", type=int, default=5, help="steps after recovery (default 5)")
    parser.add_argument("--victim", default=VICTIM, help="worker to kill (default %(default)s)")
    parser.add_argument("--spec", type=Path, help="job description (default: the packaged job)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")


def _spec_path(args: argparse.Namespace, tmp: Path) -> Path:
    if args.spec:
        return Path(args.spec)
    from chameleond.cli.up import build_spec_document
    from chameleond.jobs import load_default_spec

    doc = build_spec_document(
        load_default_spec(),
        job="bench",
        workers=None,
        pp=None,
        bind_addresses=[],
        mtbf_prior_seconds=None,
    )
    path = tmp / "spec.json"
    path.write_text(json.dumps(doc))
    return path


def _wait_steps(
    mon: StreamMonitor, cluster: LocalCluster, n: int, gen: int | None, timeout: float
) -> None:
    def done() -> bool:
        mon.poll(block_ms=50)
        cluster.check_daemon()
        return sum(1 for c in mon.commits if gen is None or c.generation == gen) >= n

    wait_for(done, timeout, f"{n} committed steps" + (f" on generation {gen}" if gen else ""), 0)


def _plan_errors(mon: StreamMonitor) -> list[dict[str, Any]]:
    """Measured vs estimated step seconds of each plan that ran at least three steps."""
    slowest: dict[tuple[int, int], float] = {}
    for _, f in mon.events:
        if f.get("type") == "step":
            key = (int(f["generation"]), int(f["step"]))
            slowest[key] = max(slowest.get(key, 0.0), float(f.get("seconds", 0) or 0))
    by_gen: dict[int, list[float]] = {}
    for (gen, _), seconds in sorted(slowest.items()):
        if seconds > 0:  # 0: a step reported late, after a recovery, with no time of its own
            by_gen.setdefault(gen, []).append(seconds)
    rows = []
    for gen, vals in sorted(by_gen.items()):
        plan = mon.plans.get(gen)
        if plan is None or len(vals) < 3:
            continue
        measured = statistics.median(vals[1:])  # a plan's first step pays for its warm-up
        est = float(plan["estimates"]["step_seconds"])
        rows.append(
            {
                "generation": gen,
                "policy": plan["policy"],
                "estimated_step_seconds": round(est, 4),
                "measured_step_seconds": round(measured, 4),
                "relative_error": round(abs(measured - est) / measured, 4),
            }
        )
    return rows


def _kill_and_recover(
    args: argparse.Namespace, spec: Path, tmp: Path, policy: str
) -> dict[str, Any]:
    with LocalCluster(
        tmp / policy, job="bench", workers=_worker_ids(spec), spec_path=spec, policy=policy
    ) as cluster:
        cluster.start_daemon()
        cluster.start_workers()
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        try:
            mon = StreamMonitor(client, "bench")
            _wait_steps(mon, cluster, args.warmup, None, args.timeout)
            old_gen = mon.last_commit.generation if mon.last_commit else 0
            killed_at = cluster.kill_worker(args.victim)

            def recovered() -> bool:
                mon.poll(block_ms=20)
                cluster.check_daemon()
                return any(c.generation > old_gen for c in mon.commits)

            wait_for(
                recovered, args.timeout, f"a step on a new plan after killing {args.victim}", 0
            )
            first = next(c for c in mon.commits if c.generation > old_gen)
            _wait_steps(mon, cluster, args.after, first.generation, args.timeout)
            mon.read_all()
            chosen = mon.plans.get(first.generation, {}).get("policy", policy)
            return {
                "seconds": round(first.at - killed_at, 3),
                "generation": first.generation,
                "policy": chosen,
                "plans": _plan_errors(mon),
            }
        finally:
            client.close()


def _worker_ids(spec: Path) -> list[str]:
    from chameleond.core.spec import load_spec

    return [w.id for w in load_spec(spec).workers]


def checkpoint_seconds(spec: Path, tmp: Path) -> dict[str, Any]:
    """torch.save + torch.load of the whole model's parameters and AdamW state."""
    import torch

    from chameleond.core.spec import load_spec

    s = load_spec(spec)
    n_params = sum(layer.param_bytes for layer in s.layers) // 4
    n_opt = sum(layer.optimizer_bytes for layer in s.layers) // 4
    state = {"params": torch.randn(max(1, n_params)), "optimizer": torch.randn(max(1, n_opt))}
    path = tmp / "checkpoint.pt"
    t = time.perf_counter()
    torch.save(state, path)
    saved = time.perf_counter() - t
    t = time.perf_counter()
    torch.load(path)
    loaded = time.perf_counter() - t
    return {
        "bytes": path.stat().st_size,
        "save_seconds": round(saved, 4),
        "load_seconds": round(loaded, 4),
    }


def _restart(args: argparse.Namespace, spec: Path, tmp: Path) -> dict[str, Any]:
    workers = _worker_ids(spec)
    with LocalCluster(tmp / "restart", job="bench", workers=workers, spec_path=spec) as cluster:
        cluster.start_daemon()
        cluster.start_workers()
        client = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        try:
            mon = StreamMonitor(client, "bench")
            _wait_steps(mon, cluster, args.warmup, None, args.timeout)
            killed_at = cluster.kill_worker(args.victim)
            # Restart the world: every process stops; the job starts again from nothing but Redis.
            cluster.stop_workers()
            if cluster.daemon is not None:
                cluster._stop_children([cluster.daemon], 5.0)
            client.delete(*[k for k in client.scan_iter("chameleon:bench:*")])
            mon = StreamMonitor(client, "bench")
            cluster.start_daemon()
            cluster.start_workers()
            _wait_steps(mon, cluster, 1, None, args.timeout)
            first = mon.commits[0]
            return {"restart_to_first_step_seconds": round(first.at - killed_at, 3)}
        finally:
            client.close()


def run(args: argparse.Namespace) -> int:
    try:
        with tempfile.TemporaryDirectory(prefix="chameleon-bench-") as d:
            tmp = Path(d)
            spec = _spec_path(args, tmp)
            reroute = _kill_and_recover(args, spec, tmp, "reroute")
            dynamic = _kill_and_recover(args, spec, tmp, "dynamic")
            restart = _restart(args, spec, tmp)
            ckpt = checkpoint_seconds(spec, tmp)
    except (ClusterError, Interrupted, KeyboardInterrupt) as e:
        print(f"chameleonctl bench recovery: {e}", file=sys.stderr)
        return 1
    restart_seconds = restart["restart_to_first_step_seconds"] + ckpt["load_seconds"]
    plans = reroute["plans"] + dynamic["plans"]
    errors = [p["relative_error"] for p in plans]
    out = {
        "reroute_seconds": reroute["seconds"],
        "dynamic_seconds": dynamic["seconds"],
        "restart_seconds": round(restart_seconds, 3),
        "step_time_error": max(errors) if errors else None,
        "speedup_reroute": round(restart_seconds / reroute["seconds"], 1)
        if reroute["seconds"]
        else None,
        "speedup_dynamic": round(restart_seconds / dynamic["seconds"], 1)
        if dynamic["seconds"]
        else None,
        "restart": {**restart, "checkpoint": ckpt},
        "plans": plans,
        "victim": args.victim,
        "policies_seen": [reroute["policy"], dynamic["policy"]],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out, args)
    return 0


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 1) if b > 0 else None


def _print(out: dict[str, Any], args: argparse.Namespace) -> None:
    restart, ckpt = out["restart"], out["restart"]["checkpoint"]
    print(f"worker {args.victim} killed (kill -9) after {args.warmup} steps, CPU")
    print(f"  reroute : {out['reroute_seconds']:.3f} s to the first step on the new plan (< 1 s)")
    print(f"  dynamic : {out['dynamic_seconds']:.3f} s (target < 3 s)")
    print(
        f"  restart : {out['restart_seconds']:.3f} s = "
        f"{restart['restart_to_first_step_seconds']:.3f} s full restart + "
        f"{ckpt['load_seconds']:.3f} s checkpoint load ({ckpt['bytes']} bytes)"
    )
    print(
        f"  faster than restart: reroute {out['speedup_reroute']}x, "
        f"dynamic {out['speedup_dynamic']}x (target >= 10x)"
    )
    for p in out["plans"]:
        print(
            f"  plan {p['generation']} ({p['policy']}): estimated "
            f"{p['estimated_step_seconds']:.4f} s, measured {p['measured_step_seconds']:.4f} s, "
            f"error {100 * p['relative_error']:.1f}%"
        )
    print(f"  step_time_error (largest): {out['step_time_error']} (target <= 0.15)")
