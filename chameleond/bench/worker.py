"""The worker library on a Hugging Face model: overhead, exactness under faults, estimates.

One invocation, runs one after another on a local cluster, all training examples/hf_gpt2.py (a
transformers GPT2LMHeadModel, random weights, on a BPE of the standard library's sources):

* overhead: the model trained data-parallel on --workers workers (one stage each, no faults)
  through the library, against the same training in the script's plain torch loop, both started
  once and taking turns in blocks of steps (chameleond/bench/worker_overhead.py says how).
  overhead = library / plain step time - 1 (target <= 0.03); overhead_cpu the same with CPU
  seconds per step and process, which other load on the machine barely moves.
* loss_match: the example's job (7 workers: pipelines of 2, 2 and 3 stages) trained --steps steps
  failure-free, then again with two kill -9: --reroute-victim (a replica of its stage survives: the
  job reroutes) and --dynamic-victim (no replica: the job re-partitions). loss_match is the largest
  |loss difference| over the steps (target <= 1e-5). A step's loss is the global mean of the
  per-sample losses every worker of the step agreed on. samples_skipped counts the samples of the
  steps no worker reported committed, samples_repeated those of the steps committed in more than one
  generation (both must be 0): a skipped or repeated micro-batch inside a step shows in its loss.
* estimate_error: |estimated - measured| / measured step time of the re-partitioned plan of the
  faulted run (estimated when the plan was published; measured: the median time between its
  consecutive commits), as in `chameleonctl bench recovery` (target <= 0.15).
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from chameleond.bench.recovery import plan_rows
from chameleond.bench.worker_overhead import add_arguments as overhead_arguments
from chameleond.bench.worker_overhead import overhead
from chameleond.cli.up import build_spec_document
from chameleond.core.spec import SpecError, load_spec, parse_spec
from chameleond.local.cluster import ClusterError, Interrupted
from chameleond.local.examples import ExampleError, FoundExample, find_example
from chameleond.local.faults import Fault
from chameleond.local.monitor import StreamMonitor
from chameleond.local.progress import ProgressView
from chameleond.local.run import LocalRun, RunOptions

JOB = "bench-worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only", choices=("overhead", "faults"), help="run one part only (default: both)"
    )
    overhead_arguments(parser)
    parser.add_argument("--steps", type=int, default=30, help="loss_match: steps per run")
    parser.add_argument("--reroute-victim", default="w0", help="killed at --reroute-step")
    parser.add_argument("--reroute-step", type=int, default=6)
    parser.add_argument("--dynamic-victim", default="w5", help="killed at --dynamic-step")
    parser.add_argument("--dynamic-step", type=int, default=14)
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")


# -- library runs ----------------------------------------------------------------------------------


def _library(
    example: FoundExample,
    doc: dict[str, Any],
    run_dir: Path,
    steps: int,
    faults: tuple[Fault, ...],
    timeout: float,
) -> StreamMonitor:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(doc))
    spec = parse_spec(doc)
    opts = RunOptions(
        job=JOB,
        workers=[w.id for w in spec.workers],
        steps=steps,
        spec_path=spec_path,
        run_dir=run_dir,
        global_batch=spec.training.global_batch,
        faults=faults,
        timeout_seconds=timeout,
        worker_command=example.worker_command(),
    )
    result = LocalRun(opts, ProgressView(io.StringIO())).execute()
    if not result.completed:
        raise ClusterError(f"{run_dir.name}: {result.reason}; logs in {run_dir / 'logs'}")
    return result.monitor


def step_losses(mon: StreamMonitor) -> dict[int, dict[int, float]]:
    """step -> {generation: loss} from every step event (the workers of a step report the same
    all-reduced loss; a step some workers committed late is reported by the others)."""
    out: dict[int, dict[int, float]] = {}
    for _, f in mon.events:
        if f.get("type") == "step":
            out.setdefault(int(f["step"]), {}).setdefault(int(f["generation"]), float(f["loss"]))
    return out


def compare_runs(
    clean: dict[int, dict[int, float]],
    faulted: dict[int, dict[int, float]],
    steps: int,
    global_batch: int,
) -> dict[str, Any]:
    """Steps 0..steps-1 of a faulted run against the failure-free run (`step_losses` of each):
    the largest |loss difference| over every loss any generation reported for a step; the samples
    of the steps the faulted run never reported (skipped) and of each extra generation that
    reported one again (repeated); the steps the failure-free run itself is missing."""
    wanted = range(steps)
    diffs = [
        abs(loss - clean[s][min(clean[s])])
        for s in wanted
        if s in clean and s in faulted
        for loss in faulted[s].values()
    ]
    return {
        "loss_match": max(diffs) if diffs else None,
        "samples_skipped": sum(global_batch for s in wanted if s not in faulted),
        "samples_repeated": sum(
            global_batch * (len(faulted[s]) - 1) for s in wanted if s in faulted
        ),
        "steps_compared": sum(1 for s in wanted if s in clean and s in faulted),
        "failure_free_missing": [s for s in wanted if s not in clean],
    }


def loss_match(args: argparse.Namespace, example: FoundExample, tmp: Path) -> dict[str, Any]:
    base = load_spec(example.spec)
    doc = build_spec_document(base, job=JOB, workers=None, pp=None, bind_addresses=[],
                              mtbf_prior_seconds=None)  # fmt: skip
    faults = (
        Fault("kill", args.reroute_victim, at_step=args.reroute_step),
        Fault("kill", args.dynamic_victim, at_step=args.dynamic_step),
    )
    clean = step_losses(_library(example, doc, tmp / "failure-free", args.steps, (), args.timeout))
    mon = _library(example, doc, tmp / "faults", args.steps, faults, args.timeout)
    compared = compare_runs(
        clean, step_losses(mon), args.steps, parse_spec(doc).training.global_batch
    )
    policies = [p["policy"] for g, p in sorted(mon.plans.items()) if g > 1]
    rows = plan_rows(mon, "faults", base)
    repartitioned = [r for r in rows if r["policy"] == "dynamic"]
    return {
        **compared,
        "estimate_error": repartitioned[-1]["relative_error"] if repartitioned else None,
        "policies": policies,
        "plans": rows,
        "steps": args.steps,
        "faults": [f"kill:{f.worker}@{f.when}" for f in faults],
    }


def run(args: argparse.Namespace) -> int:
    try:
        example = find_example("hf")
        with tempfile.TemporaryDirectory(prefix="chameleon-bench-worker-") as d:
            tmp = Path(d)
            over = None if args.only == "faults" else overhead(args, example, tmp, args.timeout)
            match = None if args.only == "overhead" else loss_match(args, example, tmp)
    except (ExampleError, SpecError) as e:
        print(f"chameleonctl bench worker: {e}", file=sys.stderr)
        return 2
    except (ClusterError, Interrupted, KeyboardInterrupt, subprocess.TimeoutExpired) as e:
        print(f"chameleonctl bench worker: {e}", file=sys.stderr)
        return 1
    out: dict[str, Any] = {"model": example.example.model}
    if over is not None:
        out.update(overhead=over["overhead"], overhead_cpu=over["overhead_cpu"])
    if match is not None:
        out.update({k: match[k] for k in ("loss_match", "samples_skipped", "samples_repeated",
                                          "estimate_error")})  # fmt: skip
    out.update(overhead_run=over, fault_run=match)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    o, m = out["overhead_run"], out["fault_run"]
    print(f"model {out['model']} (examples/hf_gpt2.py), CPU")
    if o is not None:
        print(
            f"  overhead: {out['overhead']:+.4f} (target <= 0.03): library step "
            f"{o['library_step_seconds']} s vs plain torch {o['plain_step_seconds']} s (in "
            f"turns of {o['block_steps']} steps), {o['workers']} data-parallel workers, batch "
            f"{o['global_batch']} in micro-batches of {o['micro_batch']}"
        )
        print(
            f"  overhead_cpu: {out['overhead_cpu']:+.4f}: CPU seconds per step and process, "
            f"library {o['library_cpu_seconds_per_step']} vs plain "
            f"{o['plain_cpu_seconds_per_step']}; chameleond + Redis "
            f"{o['control_plane_cpu_seconds_per_step']}"
        )
    if m is None:
        return
    print(
        f"  loss_match: {out['loss_match']} (target <= 1e-5) over {m['steps_compared']} steps "
        f"with {', '.join(m['faults'])} (plans: {', '.join(m['policies'])}); samples skipped "
        f"{out['samples_skipped']}, repeated {out['samples_repeated']}"
    )
    print(f"  estimate_error after the re-partition: {out['estimate_error']} (target <= 0.15)")
