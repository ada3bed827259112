"""Simulate fault-tolerance policies over a failure trace (docs/simulator.md).

A discrete-event simulation of the job in --spec over --trace (`time_ms,add|remove,nodeN`, or a
packaged trace's name), every policy priced by the daemon's own planner core. Prints a markdown
table per policy (average throughput, gap to the proportional ideal, ratio of chameleon to it,
seconds of training, transition, restart, lost work), or with --json an object whose `policies`
maps each policy to its figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from chameleond.core.spec import SpecError, load_spec
from chameleond.sim.engine import compare
from chameleond.sim.policies import POLICIES
from chameleond.sim.report import plot, policy_rows, table
from chameleond.sim.trace import job_trace
from chameleond.traces.replay import TraceError, load_trace

COLUMNS = ("policy", "average_throughput", "gap_to_ideal", "chameleon_ratio", "training_s",
           "transition_s", "restart_s", "lost_s", "down_s")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="job spec (TOML or JSON)")
    parser.add_argument("--trace", required=True, help="trace file or packaged trace name")
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
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--plot", default=None, help="write a PNG of throughput over time here")


def run(args: argparse.Namespace) -> int:
    if args.policy != "all" and args.policy not in POLICIES:
        print(f"simulate: unknown policy {args.policy!r} (one of {', '.join(POLICIES)}, all)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.devices_per_node is not None and args.devices_per_node < 1:
        print("simulate: --devices-per-node must be >= 1", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec)
        events = load_trace(args.trace)
    except (SpecError, TraceError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    end = args.hours * 3600 if args.hours is not None else None
    trace = job_trace(spec, events, devices_per_node=args.devices_per_node, end_seconds=end)
    policies = POLICIES if args.policy == "all" else (args.policy,)
    out = compare(spec, trace, policies)
    results = out.pop("_results")
    if args.plot:
        plot(results, args.plot, f"{spec.name} over {args.trace}")
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{spec.name}: {out['devices']} devices, {out['devices_per_node']} per trace node, "
          f"{out['events']} events over {out['seconds'] / 3600:.1f} h")  # fmt: skip
    print(table(policy_rows(results), COLUMNS))
    return 0
