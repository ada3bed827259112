"""Simulate fault-tolerance policies over a failure trace (docs/simulator.md).

A discrete-event simulation of the job in --spec over --trace (`time_ms,add|remove,nodeN`, or a
packaged trace's name), every policy priced by the daemon's own planner core; --slow-rate
overlays synthetic fail-slow episodes on it (without --trace, they are the whole trace). Prints
a markdown table per policy (average throughput, gap to the proportional ideal, ratio of
chameleon to it, seconds of training, transition, restart, lost work), or with --json an object
whose `policies` maps each policy to its figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from chameleond.core.spec import SpecError, load_spec
from chameleond.sim.engine import compare
from chameleond.sim.policies import POLICIES, SimConfig
from chameleond.sim.report import plot, policy_rows, table
from chameleond.sim.trace import (
    SLOW_FACTOR,
    SLOW_SECONDS,
    JobTrace,
    job_trace,
    overlay,
    synthetic_slow_trace,
)
from chameleond.traces.replay import TraceError, load_trace

COLUMNS = ("policy", "average_throughput", "gap_to_ideal", "chameleon_ratio", "training_s",
           "transition_s", "restart_s", "lost_s", "down_s")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="job spec (TOML or JSON)")
    parser.add_argument(
        "--trace",
        default=None,
        help="trace file or packaged trace name (optional with --slow-rate)",
    )
    parser.add_argument("--policy", default="all", help=f"one of {', '.join(POLICIES)}, or all")
    parser.add_argument(
        "--devices-per-node",
        type=int,
        default=None,
        help="devices a trace node holds (default: devices / the trace's peak nodes)",
    )
    parser.add_argument(
        "--hours",
        type=float,
        default=None,
        help="simulate this long (default: the trace, plus its mean gap)",
    )
    parser.add_argument(
        "--slow-rate",
        type=float,
        default=0.0,
        help="fail-slow episodes per hour over the job, overlaid on the trace",
    )
    parser.add_argument(
        "--slow-factor",
        type=_pair,
        default=SLOW_FACTOR,
        help="LO,HI: a slow worker's speed, drawn uniformly (default %(default)s)",
    )
    parser.add_argument(
        "--slow-seconds",
        type=_pair,
        default=SLOW_SECONDS,
        help="LO,HI: an episode's duration, log-uniform (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the fail-slow episodes")
    parser.add_argument(
        "--straggler-timeout",
        type=float,
        default=None,
        help="seconds after which the baselines take a slow worker as failed",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--plot", default=None, help="write a PNG of throughput over time here")


def _pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    try:
        pair = (float(lo), float(hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI, got {text!r}") from None
    if not 0 < pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI, got {text!r}")
    return pair


def run(args: argparse.Namespace) -> int:
    if args.policy != "all" and args.policy not in POLICIES:
        print(f"simulate: unknown policy {args.policy!r} (one of {', '.join(POLICIES)}, all)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.devices_per_node is not None and args.devices_per_node < 1:
        print("simulate: --devices-per-node must be >= 1", file=sys.stderr)
        return 2
    if args.trace is None and not (args.slow_rate > 0 and args.hours is not None):
        print("simulate: --trace, or --slow-rate with --hours", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        events = load_trace(args.trace) if args.trace is not None else ()
    except (SpecError, TraceError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    end = args.hours * 3600 if args.hours is not None else None
    trace = (
        job_trace(spec, events, devices_per_node=args.devices_per_node, end_seconds=end)
        if args.trace is not None
        else JobTrace((), 1, len(spec.workers), 0, end or 0.0)
    )
    if args.slow_rate > 0:
        slow = synthetic_slow_trace(
            spec, hours=trace.end_seconds / 3600, seed=args.seed,
            episodes_per_hour=args.slow_rate, factor=args.slow_factor, seconds=args.slow_seconds,
        )  # fmt: skip
        trace = overlay(trace, slow)
    policies = POLICIES if args.policy == "all" else (args.policy,)
    cfg = SimConfig(straggler_timeout_seconds=args.straggler_timeout)
    out = compare(spec, trace, policies, cfg)
    results = out.pop("_results")
    if args.plot:
        plot(results, args.plot, f"{spec.name} over {args.trace or 'fail-slow episodes'}")
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{spec.name}: {out['devices']} devices, {out['devices_per_node']} per trace node, "
          f"{out['events']} events ({out['slow_episodes']} fail-slow episodes) over "
          f"{out['seconds'] / 3600:.1f} h")  # fmt: skip
    print(table(policy_rows(results), COLUMNS))
    return 0
