"""Simulated against measured step time: the small CPU job on a local cluster, then the simulator.

Each run: the packaged job (or --spec) trains --warmup committed steps (by then the workers have
reported in-training profiles), worker --victim is killed (kill -9), the daemon's selector
recovers (or, with --policy reroute|dynamic, the policy forced on the daemon) and the new plan
trains --after steps. Then `chameleond.sim` runs the same policy (`chameleon`: the selector)
over the same job and a one-event trace (the victim fails as many seconds after the first commit
as the kill came), on the daemon's view of the job: the spec with the profiles the workers had
reported (folded as chameleond/handlers/profile.py folds them). Bubble checkpoints are off in the
simulation, as the workers here take none, so a training segment's throughput is B over its
plan's step.

simulated_step_seconds: B / the simulated throughput before the fault (`initial`, from the
profiles reported by the kill) and on the final plan after it (`after_fault`, from the profiles
reported by the end of the run: those measured in that period). measured: the median interval
between consecutive commits of the daemon's initial plan and of its last plan after the fault
(bench recovery's measure). simulated_step_error: |simulated - measured| / measured, the larger
of the two. `forecast_after_fault`: the step after the fault simulated from the profiles at the
kill only (what the daemon knew when it decided), and its error. With --runs N, the median over
the runs is `simulated_step_error_median`. `same_layout`: whether the simulator chose the daemon's
layout (the same workers in the same slots).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from chameleond.bench.cluster import (
    kill_and_wait,
    spec_file,
    wait_steps,
    warmed_up,
    worker_ids,
)
from chameleond.bench.recovery import MIN_STEPS, VICTIM, _spec_by, plan_rows
from chameleond.core.plan import Plan, plan_from_dict
from chameleond.core.spec import JobSpec, load_spec
from chameleond.extras import require
from chameleond.local.cluster import ClusterError, Interrupted, LocalCluster
from chameleond.local.monitor import StreamMonitor
from chameleond.sim.engine import simulate
from chameleond.sim.policies import SimConfig
from chameleond.sim.timeline import Kind
from chameleond.sim.trace import JobEvent, JobTrace

TARGET = 0.15


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warmup",
        type=int,
        default=40,
        help="steps before the kill (default 40: in-training profiles are in)",
    )
    parser.add_argument("--after", type=int, default=40, help="steps on the plan after the fault")
    parser.add_argument("--victim", default=VICTIM, help="worker to kill (default %(default)s)")
    parser.add_argument("--runs", type=int, default=1, help="runs, one after another")
    parser.add_argument(
        "--policy",
        choices=("chameleon", "reroute", "dynamic"),
        default="chameleon",
        help="the daemon's and the simulator's policy: the selector, or one forced",
    )
    parser.add_argument("--spec", type=Path, help="job description (default: the packaged job)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")


def simulated(
    spec: JobSpec, victim: str, fault_seconds: float, policy: str = "chameleon"
) -> dict[str, Any]:
    """`policy` over one fault: step seconds before it and on the final plan."""
    at = max(fault_seconds, 1.0)
    trace = JobTrace((JobEvent(at, frozenset({victim}), frozenset()),), 1, len(spec.workers), 0,
                     at + 3600.0)  # fmt: skip
    result = simulate(spec, trace, policy, SimConfig(bubble_checkpoint_overhead=0.0))
    rates = [s.throughput for s in result.segments if s.kind == Kind.TRAINING and s.throughput > 0]
    batch = spec.training.global_batch
    return {
        "initial": batch / rates[0],
        "after_fault": batch / rates[-1],
        "selected": [str(getattr(r.selected, "value", r.selected)) for r in result.records],
        "plan": result.plan,
    }


def _slots(plan: Plan | None) -> list[tuple[str, int, int, int]]:
    if plan is None:
        return []
    return [(st.worker, st.first_layer, st.end_layer, p.micro_batches)
            for p in plan.pipelines for st in p.stages]  # fmt: skip


def one_run(args: argparse.Namespace, spec_path: Path, tmp: Path) -> dict[str, Any]:
    base = load_spec(spec_path)
    with (
        LocalCluster(
            tmp,
            job="bench",
            workers=worker_ids(spec_path),
            spec_path=spec_path,
            policy=None if args.policy == "chameleon" else args.policy,
        ) as cl,  # fmt: skip
        warmed_up(cl, args.warmup, args.timeout) as mon,
    ):
        old_gen, killed_at = kill_and_wait(mon, cl, args.victim, args.timeout)
        _wait_settled(mon, cl, args)
        mon.read_all()
        rows = plan_rows(mon, "sim-check", base)
        at_kill = _spec_by(base, mon, killed_at)
        at_end = _spec_by(base, mon, max(c.at for c in mon.commits))
        first_commit = min(c.at for c in mon.commits)
        plans = {g: plan_from_dict(p) for g, p in mon.plans.items()}
    before = [r for r in rows if r["generation"] <= old_gen]
    after = [r for r in rows if r["generation"] > old_gen]
    if not before or not after:
        raise ClusterError(f"too few committed steps to measure (plans measured: {rows})")
    fault = killed_at - first_commit
    forecast = simulated(at_kill, args.victim, fault, args.policy)
    model = simulated(at_end, args.victim, fault, args.policy)
    sim = {"initial": forecast["initial"], "after_fault": model["after_fault"]}
    measured = {"initial": before[-1]["measured_step_seconds"],
                "after_fault": after[-1]["measured_step_seconds"]}  # fmt: skip
    errors = {k: abs(sim[k] - m) / m for k, m in measured.items()}
    ahead = forecast["after_fault"]
    daemon_plan = plans.get(after[-1]["generation"])
    return {
        "simulated_step_seconds": {k: round(v, 6) for k, v in sim.items()},
        "measured_step_seconds": measured,
        "errors": {k: round(e, 4) for k, e in errors.items()},
        "simulated_step_error": round(max(errors.values()), 4),
        "forecast_after_fault": {
            "step_seconds": round(ahead, 4),
            "error": round(abs(ahead - measured["after_fault"]) / measured["after_fault"], 4),
            "same_layout": _slots(forecast["plan"]) == _slots(daemon_plan),
        },
        "simulated_selected": model["selected"],
        "daemon_policy": daemon_plan.policy.value if daemon_plan else None,
        "same_layout": _slots(model["plan"]) == _slots(daemon_plan),
        "fault_seconds": round(fault, 3),
        "plans": rows,
    }


def _wait_settled(mon: StreamMonitor, cl: LocalCluster, args: argparse.Namespace) -> None:
    """Until the newest plan after the fault has committed --after steps (a follow-up switch
    may publish one more plan meanwhile)."""
    while True:
        newest = max(c.generation for c in mon.commits)
        wait_steps(mon, cl, max(args.after, MIN_STEPS + 1), newest, args.timeout)
        if max(c.generation for c in mon.commits) == newest:
            return


def run(args: argparse.Namespace) -> int:
    require("worker", "starting workers")
    if args.warmup < MIN_STEPS + 1 or args.after < MIN_STEPS + 1 or args.runs < 1:
        print(f"chameleonctl bench sim-check: --warmup and --after >= {MIN_STEPS + 1}, --runs >= 1"
              " are required", file=sys.stderr)  # fmt: skip
        return 2
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="chameleon-bench-") as d:
            tmp = Path(d)
            spec = spec_file(tmp, args.spec)
            for i in range(args.runs):
                runs.append(one_run(args, spec, tmp / f"run{i}"))
                if not args.json:
                    _print_run(i, runs[-1])
    except (ClusterError, Interrupted, KeyboardInterrupt) as e:
        print(f"chameleonctl bench sim-check: {e}", file=sys.stderr)
        return 1
    errors = [r["simulated_step_error"] for r in runs]
    out = {
        "simulated_step_error": errors[-1] if len(runs) == 1 else max(errors),
        "simulated_step_error_median": statistics.median(errors),
        "target": TARGET,
        "runs": runs,
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"simulated_step_error: median {out['simulated_step_error_median']:.3f}, largest "
            f"{out['simulated_step_error']:.3f} over {len(runs)} run(s) (target <= {TARGET})"
        )
    return 0


def _print_run(i: int, r: dict[str, Any]) -> None:
    s, m, e = r["simulated_step_seconds"], r["measured_step_seconds"], r["errors"]
    print(f"run {i + 1}: fault at {r['fault_seconds']} s; simulated chose {r['simulated_selected']}"
          f", the daemon {r['daemon_policy']} (same layout: {r['same_layout']})")  # fmt: skip
    for k in ("initial", "after_fault"):
        print(f"  {k:>11}: simulated {s[k]:.4f} s, measured {m[k]:.4f} s, error {e[k]:.3f}")
    f = r["forecast_after_fault"]
    print(f"  after the fault from the profiles at the kill: {f['step_seconds']:.4f} s, error "
          f"{f['error']:.3f} (same layout: {f['same_layout']})")  # fmt: skip
