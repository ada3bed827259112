"""Recovery on CPU: reroute and dynamic against a restart from checkpoints; estimator accuracy.

Three runs of the packaged job on a local cluster, one after another in one invocation, each
killing the same worker (kill -9) after --warmup committed steps:

* reroute: the daemon forced to reroute (--policy reroute); measured: the kill -> the first step
  committed by every worker of the new plan (Redis stream timestamps of the step events).
* dynamic: the same with --policy dynamic (layout search, migration of parameters and optimizer
  state, asymmetric pipelines).
* restart: the workers checkpoint every --checkpoint-every steps (chameleon-worker
  --checkpoint-dir); after the kill every process is stopped, and the whole job (daemon and every
  worker, the dead one replaced) starts again; the workers load the newest checkpoint they all
  wrote and resume right after it. Measured: the kill -> the first step committed after the
  restart. The steps committed after that checkpoint are trained again: that lost work is
  reported beside it, not added to it.

group_rebuild_seconds: per backend the workers ran (gloo here), and per run, the build of the new
plan's process groups: the slowest worker's `ack` ready build_seconds less its migration_seconds
(the rendezvous with every member included, the state transfer not), the figure the daemon
prices a new plan's rebuild at once measured (docs/planner.md, "The rebuild"). Part of the
recovery time above, reported apart.

step_time_error: for every plan of the reroute and dynamic runs (the initial plan and the new
one), |measured - estimated| / measured, where estimated is the plan's own estimate (made when it
was published, from the profiles the workers had reported by then) and measured is the median
time between consecutive committed steps of that plan (its first step, which includes the
recovery, excluded); the figure is the largest of them. It is also given per kind of estimate:
`step_time_error_initial` for the initial plans (estimated from the workers' start-up profiles
only) and `step_time_error_after_fault` for the plans chosen at the fault (estimated from the
profiles the workers measured in training on the plan before).

model_error: the same comparison with each plan re-estimated, after the run, from the profiles the
workers had reported by its last committed step (the daemon's view then: start-up profiles
replaced by in-training ones measured on that plan, host capacity included). The published
estimate is a forecast made before the plan ran, so it also carries the machine's change of load
since; this one tells how well the model itself describes a plan whose inputs are measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from chameleond.bench.cluster import kill_and_wait, spec_file, wait_steps, warmed_up, worker_ids
from chameleond.core.estimator import Estimator
from chameleond.core.plan import plan_from_dict
from chameleond.core.spec import JobSpec, LayerProfile, load_spec
from chameleond.extras import require
from chameleond.jobstate.jobspec import fold_profile, measured_layers
from chameleond.local.cluster import ClusterError, Interrupted, LocalCluster
from chameleond.local.monitor import StreamMonitor
from chameleond.local.timeline import group_rebuild_seconds
from chameleond.records import entry_seconds

VICTIM = "w3"  # a stage-1 worker of the packaged 2 x 3 layout (the head: loss and largest state)
MIN_STEPS = 5  # committed steps a plan needs for a measured step time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="steps before the kill (default 20: the workers report an in-training profile first)",
    )
    parser.add_argument("--after", type=int, default=20, help="steps after recovery (default 20)")
    parser.add_argument("--victim", default=VICTIM, help="worker to kill (default %(default)s)")
    parser.add_argument(
        "--checkpoint-every", type=int, default=8, help="restart run: steps between checkpoints"
    )
    parser.add_argument("--spec", type=Path, help="job description (default: the packaged job)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")


def _slowest_worker_seconds(mon: StreamMonitor, gen: int) -> list[float]:
    """Per step of `gen`, the slowest worker's own `step.seconds`, in step order."""
    slowest: dict[int, float] = {}
    for _, f in mon.events:
        if f.get("type") == "step" and f.get("generation") == str(gen):
            step = int(f["step"])
            slowest[step] = max(slowest.get(step, 0.0), float(f.get("seconds", 0) or 0))
    return [s for _, s in sorted(slowest.items()) if s > 0]


def _vote_latency_seconds(mon: StreamMonitor, gen: int) -> list[float]:
    """Per step of `gen`, the shortest `vote_seconds` of its workers: the last to reach the vote
    waits for nobody, so its vote is the all-reduce alone (its latency on the loaded host)."""
    fastest: dict[int, float] = {}
    for _, f in mon.events:
        if f.get("type") == "step" and f.get("generation") == str(gen) and "vote_seconds" in f:
            step, v = int(f["step"]), float(f["vote_seconds"])
            fastest[step] = min(fastest.get(step, v), v)
    return [v for _, v in sorted(fastest.items())]


def _spec_by(base: JobSpec, mon: StreamMonitor, until: float) -> JobSpec:
    """The daemon's view of the job at `until`: every profile event up to then folded into the base
    spec as chameleond/handlers/profile.py folds them (`fold_profile`, under the plan each was
    measured on), with each worker's newest layers."""
    spec = base
    profiles: dict[str, dict[int, LayerProfile]] = {}
    plans = {g: plan_from_dict(p) for g, p in mon.plans.items()}
    for entry_id, f in mon.events:
        if f.get("type") == "profile" and entry_seconds(entry_id) <= until:
            data = json.loads(f["data"])
            model = spec.with_layers(measured_layers(spec.layers, list(profiles.values())))
            plan = plans.get(data.get("generation"))  # None: a start-up profile
            spec, profiles[f["worker"]], _ = fold_profile(spec, data, plan, model)
    return spec.with_layers(measured_layers(spec.layers, list(profiles.values())))


def plan_rows(mon: StreamMonitor, run: str, base: JobSpec) -> list[dict[str, Any]]:
    """Measured vs estimated step seconds of each plan that committed at least MIN_STEPS steps.

    Measured: the median interval between consecutive commits of the plan. It is the step time a
    user sees (throughput = B / it); each interval spans one step of every worker, from the vote
    that commits one step to the vote that commits the next. The slowest worker's own
    `step.seconds` (median) is kept beside it: it is the step of one worker, and a maximum over
    six noisy clocks, so it sits above the interval. `vote_allreduce_seconds` (median over the
    steps) is the commit vote's all-reduce as the last worker to reach it saw it: a measure of the
    host's collective latency, which the model takes from the spec's links.
    """
    by_gen: dict[int, list[tuple[int, float]]] = {}
    for c in mon.commits:
        by_gen.setdefault(c.generation, []).append((c.step, c.at))
    rows = []
    for gen, commits in sorted(by_gen.items()):
        plan = mon.plans.get(gen)
        commits.sort()
        gaps = [b[1] - a[1] for a, b in itertools.pairwise(commits) if b[0] == a[0] + 1]
        if plan is None or len(commits) < MIN_STEPS or len(gaps) < MIN_STEPS - 1:
            continue
        measured = statistics.median(gaps)
        est = float(plan["estimates"]["step_seconds"])
        p = plan_from_dict(plan)
        spec = _spec_by(base, mon, commits[-1][1])
        model = Estimator(spec).step_seconds(p.pipelines, p.routing, p.sync_groups)
        slowest = _slowest_worker_seconds(mon, gen)[1:]  # the first pays for the warm-up
        vote = _vote_latency_seconds(mon, gen)[1:]
        rows.append(
            {
                "run": run,
                "generation": gen,
                "policy": plan["policy"],
                "steps": len(commits),
                "estimated_step_seconds": round(est, 4),
                "measured_step_seconds": round(measured, 4),
                "measured_mean_step_seconds": round(statistics.fmean(gaps), 4),
                "slowest_worker_step_seconds": round(statistics.median(slowest), 4)
                if slowest
                else None,
                "relative_error": round(abs(measured - est) / measured, 4) if measured else None,
                "model_step_seconds": round(model, 4),
                "model_error": round(abs(measured - model) / measured, 4) if measured else None,
                "vote_allreduce_seconds": round(statistics.median(vote), 5) if vote else None,
            }
        )
    return rows


def _kill_and_recover(
    args: argparse.Namespace, spec: Path, tmp: Path, policy: str
) -> dict[str, Any]:
    with (
        LocalCluster(
            tmp / policy, job="bench", workers=worker_ids(spec), spec_path=spec, policy=policy
        ) as cluster,
        warmed_up(cluster, args.warmup, args.timeout) as mon,
    ):
        old_gen, killed_at = kill_and_wait(mon, cluster, args.victim, args.timeout)
        first = next(c for c in mon.commits if c.generation > old_gen)
        wait_steps(mon, cluster, args.after, first.generation, args.timeout)
        mon.read_all()
        chosen = mon.plans.get(first.generation, {}).get("policy", policy)
        return {
            "seconds": round(first.at - killed_at, 3),
            "generation": first.generation,
            "group_rebuild_seconds": group_rebuild_seconds(mon.events, first.generation),
            "policy": chosen,
            "plans": plan_rows(mon, policy, load_spec(spec)),
        }


def _restart(args: argparse.Namespace, spec: Path, tmp: Path) -> dict[str, Any]:
    """Checkpoints on; kill one worker; stop everything; start everything; resume."""
    ckpt = tmp / "checkpoints"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(args.checkpoint_every)]
    workers = worker_ids(spec)
    with (
        LocalCluster(
            tmp / "restart", job="bench", workers=workers, spec_path=spec, worker_args=flags
        ) as cluster,
        warmed_up(cluster, args.warmup, args.timeout) as mon,
    ):
        client = mon.client
        killed_at = cluster.kill_worker(args.victim)
        mon.poll(block_ms=1)
        before = mon.last_commit
        last_step = before.step if before else -1
        step_seconds = plan_rows(mon, "restart", load_spec(spec))
        # Restart the world: every process stops; the job starts again from its checkpoints,
        # with a fresh daemon (the job's keys removed: nothing survives but the files).
        cluster.stop_workers()
        cluster.stop_daemon()
        stopped_at = time.time()
        client.delete(*client.keys("chameleon:bench:*"))
        mon = StreamMonitor(client, "bench")
        cluster.start_daemon()
        cluster.start_workers()
        wait_steps(mon, cluster, 1, None, args.timeout)
        first = mon.commits[0]
        resumed_after = first.step - 1  # the checkpoint's step
        lost_steps = max(0, last_step - resumed_after)
        per_step = step_seconds[0]["measured_step_seconds"] if step_seconds else None
        return {
            "seconds": round(first.at - killed_at, 3),
            "stopped_after_kill_seconds": round(stopped_at - killed_at, 3),
            "checkpoint_every": args.checkpoint_every,
            "last_step_before_kill": last_step,
            "resumed_from_checkpoint_step": resumed_after,
            "lost_steps": lost_steps,
            "lost_seconds": round(lost_steps * per_step, 3) if per_step else None,
        }


def run(args: argparse.Namespace) -> int:
    require("worker", "starting workers")
    if args.warmup < 1 or args.after < MIN_STEPS or args.checkpoint_every < 1:
        print(
            f"chameleonctl bench recovery: --warmup >= 1, --after >= {MIN_STEPS} and "
            "--checkpoint-every >= 1 are required",
            file=sys.stderr,
        )
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="chameleon-bench-") as d:
            tmp = Path(d)
            spec = spec_file(tmp, args.spec)
            reroute = _kill_and_recover(args, spec, tmp, "reroute")
            dynamic = _kill_and_recover(args, spec, tmp, "dynamic")
            restart = _restart(args, spec, tmp)
    except (ClusterError, Interrupted, KeyboardInterrupt) as e:
        print(f"chameleonctl bench recovery: {e}", file=sys.stderr)
        return 1
    plans = reroute["plans"] + dynamic["plans"]
    out = {
        "reroute_seconds": reroute["seconds"],
        "dynamic_seconds": dynamic["seconds"],
        "restart_seconds": restart["seconds"],
        # Per backend, per run: the new plan's process groups built (part of the seconds above).
        "group_rebuild_seconds": _per_backend({"reroute": reroute, "dynamic": dynamic}),
        "step_time_error": _largest_error(plans),
        "step_time_error_initial": _largest_error(p for p in plans if p["policy"] == "initial"),
        "step_time_error_after_fault": _largest_error(p for p in plans if p["policy"] != "initial"),
        "model_error": _largest_error(plans, "model_error"),
        "speedup_reroute": _ratio(restart["seconds"], reroute["seconds"]),
        "speedup_dynamic": _ratio(restart["seconds"], dynamic["seconds"]),
        "restart": restart,
        "plans": plans,
        "victim": args.victim,
        "warmup_steps": args.warmup,
        "policies_seen": [reroute["policy"], dynamic["policy"]],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out, args)
    return 0


def _per_backend(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{backend: {run: seconds}} from each run's {backend: seconds}."""
    out: dict[str, dict[str, float]] = {}
    for name, run in runs.items():
        for backend, seconds in run["group_rebuild_seconds"].items():
            out.setdefault(backend, {})[name] = seconds
    return out


def _largest_error(plans: Iterable[dict[str, Any]], key: str = "relative_error") -> float | None:
    errors = [p[key] for p in plans if p[key] is not None]
    return max(errors) if errors else None


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 1) if b > 0 else None


def _print(out: dict[str, Any], args: argparse.Namespace) -> None:
    r = out["restart"]
    print(f"worker {args.victim} killed (kill -9) after {args.warmup} steps, CPU")
    print(f"  reroute : {out['reroute_seconds']:.3f} s to the first step on the new plan (< 1 s)")
    print(f"  dynamic : {out['dynamic_seconds']:.3f} s (target < 3 s)")
    lost = f", {r['lost_seconds']:.3f} s of training" if r["lost_seconds"] is not None else ""
    print(
        f"  restart : {out['restart_seconds']:.3f} s to the first step after stopping and "
        f"restarting every process from the checkpoint of step {r['resumed_from_checkpoint_step']}"
        f" (checkpoint every {r['checkpoint_every']} steps); lost work not included: "
        f"{r['lost_steps']} steps{lost}"
    )
    for backend, runs in out["group_rebuild_seconds"].items():
        each = ", ".join(f"{run} {seconds:.3f} s" for run, seconds in runs.items())
        print(
            f"  group rebuild ({backend}; the new plan's process groups, slowest worker, "
            f"migration excluded): {each}"
        )
    print(
        f"  faster than restart: reroute {out['speedup_reroute']}x, "
        f"dynamic {out['speedup_dynamic']}x (target >= 10x)"
    )
    print("  step time per plan (measured = median time between commits):")
    for p in out["plans"]:
        err = p["relative_error"]
        print(
            f"    {p['run']:>7} run, generation {p['generation']} ({p['policy']}, "
            f"{p['steps']} steps): estimated {p['estimated_step_seconds']:.4f} s, measured "
            f"{p['measured_step_seconds']:.4f} s, error "
            f"{'-' if err is None else f'{100 * err:.1f}%'}; re-estimated from the profiles "
            f"measured on it {p['model_step_seconds']:.4f} s; commit vote all-reduce "
            f"{p['vote_allreduce_seconds']} s"
        )
    print(
        f"  step_time_error (largest): {out['step_time_error']} (target <= 0.15); initial plans "
        f"(start-up profiles): {out['step_time_error_initial']}, plans chosen at the fault "
        f"(in-training profiles): {out['step_time_error_after_fault']}; model_error (each plan "
        f"re-estimated from the profiles measured on it): {out['model_error']}"
    )
