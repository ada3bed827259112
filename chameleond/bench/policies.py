"""Every fault-tolerance policy over the failure traces and the example jobs (docs/simulator.md).

Traces: the packaged ones (chameleond/traces, from the Oobleck artifact) and two synthetic ones
per job drawn at Llama 3's published interruption rate: `llama3-24h` (24 hours at the rate the
16,384-GPU job saw, one every 3.1 h) and `llama3-30d` (30 days at its per-device rate scaled to
this job's size); a synthetic interruption takes down one host of 8 devices for 4 hours. Fail-slow
(chameleond/sim/trace.py): `slow-24h`, 24 hours of fail-slow episodes alone, and `NAME+slow`, the
same process of episodes overlaid on trace NAME (a real preemption trace by default). Jobs:
examples/gpt-32.toml, cluster-1024.toml, cluster-8192.toml. Prints a markdown table per job x
trace (and with --plots DIR a PNG each); flags where a baseline's average beats chameleon's
(among the baselines that keep the global batch) or chameleon-elastic's (among all).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from chameleond.core.spec import JobSpec, load_spec
from chameleond.sim.engine import compare
from chameleond.sim.policies import POLICIES, VARIABLE_BATCH
from chameleond.sim.report import plot, policy_rows, table
from chameleond.sim.trace import (
    LLAMA3_GPU_SECONDS_PER_INTERRUPTION,
    JobTrace,
    job_trace,
    overlay,
    synthetic_slow_trace,
    synthetic_trace,
)
from chameleond.traces import packaged_traces
from chameleond.traces.replay import TraceEvent, load_trace

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SPECS = ("gpt-32", "cluster-1024", "cluster-8192")
SYNTHETIC = ("llama3-24h", "llama3-30d")
SLOW_ONLY = "slow-24h"
OVERLAY = "+slow"
FAIL_SLOW = (SLOW_ONLY, "oobleck-p3-trace" + OVERLAY)
LLAMA3_JOB_SECONDS_PER_INTERRUPTION = LLAMA3_GPU_SECONDS_PER_INTERRUPTION / 16384
# Real traces per job size by default: the larger jobs take the short synthetic ones and the
# fixed-interval Oobleck traces (tens of events); --traces asks for any.
DEFAULT_TRACES = {
    "gpt-32": (*packaged_traces(), *SYNTHETIC, *FAIL_SLOW),
    "cluster-1024": ("oobleck-1h", "oobleck-3h", *SYNTHETIC, *FAIL_SLOW),
    "cluster-8192": ("llama3-24h",),
}
COLUMNS = ("policy", "average_throughput", "gap_to_ideal", "chameleon_ratio", "training_s",
           "transition_s", "restart_s", "lost_s", "down_s")  # fmt: skip


def beaten_by(results: dict[str, Any]) -> list[str]:
    """The policies ahead of chameleon where both train the same batch (the baselines that keep
    B), and those ahead of chameleon-elastic (every baseline: it may shrink B like drop-replica);
    each as `baseline > ours`."""
    out = []
    for ours, rivals in (
        ("chameleon", [p for p in results if p not in VARIABLE_BATCH and p != "chameleon"]),
        ("chameleon-elastic", [p for p in results if not p.startswith("chameleon")]),
    ):
        if ours not in results:
            continue
        mine = results[ours].average_throughput
        ahead = [p for p in rivals if results[p].average_throughput > mine * (1 + 1e-9)]
        out += [f"{p} > {ours}" for p in ahead]
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--specs", default=",".join(SPECS),
                        help="example jobs (names under examples/) or spec files")  # fmt: skip
    parser.add_argument("--traces", default=None,
                        help="traces (packaged names, files, llama3-24h, llama3-30d, slow-24h, "
                             "NAME+slow); default: per job, see the module doc")  # fmt: skip
    parser.add_argument("--plots", default=None, help="write one PNG per job x trace here")
    parser.add_argument("--seed", type=int, default=1, help="seed of the synthetic traces")


def _events(name: str, devices: int, seed: int) -> tuple[TraceEvent, ...]:
    if name == "llama3-24h":
        per_gpu = LLAMA3_JOB_SECONDS_PER_INTERRUPTION * devices
        return synthetic_trace(
            devices, 8, hours=24, seed=seed, gpu_seconds_per_interruption=per_gpu
        )
    if name == "llama3-30d":
        return synthetic_trace(devices, 8, hours=30 * 24, seed=seed)
    return load_trace(name)


def _trace(name: str, spec: JobSpec, seed: int) -> JobTrace:
    if name == SLOW_ONLY:
        return synthetic_slow_trace(spec, hours=24, seed=seed)
    if name.endswith(OVERLAY):
        fail_stop = _trace(name.removesuffix(OVERLAY), spec, seed)
        episodes = synthetic_slow_trace(spec, hours=fail_stop.end_seconds / 3600, seed=seed)
        return overlay(fail_stop, episodes)
    events = _events(name, len(spec.workers), seed)
    per_node = 8 if name in SYNTHETIC else None
    end = 24 * 3600.0 if name == "llama3-24h" else None
    return job_trace(spec, events, devices_per_node=per_node, end_seconds=end)


def _spec(name: str) -> JobSpec:
    path = Path(name)
    return load_spec(path if path.suffix in (".toml", ".json") else EXAMPLES / f"{name}.toml")


def row(spec: JobSpec, name: str, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every policy over trace `name`: the JSON row and the results."""
    trace = _trace(name, spec, seed)
    t0 = time.perf_counter()
    out = compare(spec, trace, POLICIES)
    wall = time.perf_counter() - t0
    res = out.pop("_results")
    out.update(trace=name, hours=trace.end_seconds / 3600, simulate_seconds=wall,
               beaten_by=beaten_by(res))  # fmt: skip
    return out, res


def slow_rows(spec_name: str = "cluster-1024", seed: int = 1) -> dict[str, Any]:
    """The fail-slow rows of one job (`slow-24h`, a preemption trace with fail-slow overlaid),
    by trace."""
    spec = _spec(spec_name)
    return {name: row(spec, name, seed)[0] for name in FAIL_SLOW}


def run(args: argparse.Namespace) -> int:
    results: list[dict[str, Any]] = []
    for spec_name in [s for s in args.specs.split(",") if s]:
        spec = _spec(spec_name)
        spec_name = spec.name
        n = len(spec.workers)
        names = args.traces.split(",") if args.traces else DEFAULT_TRACES.get(spec_name, SYNTHETIC)
        for name in names:
            out, res = row(spec, name, args.seed)
            beaten, wall = out["beaten_by"], out["simulate_seconds"]
            if args.plots:
                Path(args.plots).mkdir(parents=True, exist_ok=True)
                path = Path(args.plots) / f"{spec_name}--{name.replace('/', '_')}.png"
                plot(res, path, f"{spec_name} over {name}")
                out["plot"] = str(path)
            results.append(out)
            if not args.json:
                print(f"\n### {spec_name} ({n} devices) over {name}: {out['events']} events "
                      f"({out['slow_episodes']} fail-slow episodes), "
                      f"{out['hours']:.1f} h, {out['devices_per_node']} devices per "
                      f"node; simulated in {wall:.1f} s")  # fmt: skip
                print(table(policy_rows(res), COLUMNS))
                if beaten:
                    print(f"\nbeaten by: {', '.join(beaten)}")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0
