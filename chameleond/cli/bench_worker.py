"""The worker library on a Hugging Face model: overhead, exactness under faults, estimates.

One invocation, runs one after another on a local cluster, all training examples/hf_gpt2.py (a
transformers GPT2LMHeadModel, random weights, on a BPE of the standard library's sources):

* overhead: the model trained data-parallel on --workers workers (one stage each, no faults)
  through the library, against the same training in a plain torch loop (the script's --plain: one
  gloo process group of as many ranks, the same micro-batches, an all-reduce of the gradients, one
  AdamW; each rank in a session of its own, as each worker is). Plain and library runs alternate
  (plain, library, plain, ... for --rounds library runs): each library run is compared with the
  mean of the plain runs on either side of it (the load of a shared machine drifts), and the
  figure is the median over the rounds. Step time: the median time between consecutive commits
  (library) or of rank 0's loop (plain), the first two steps left out. overhead = library / plain
  - 1 (target <= 0.03). overhead_cpu compares CPU seconds per step of one worker (/proc) with
  those of a plain rank (its process time), which other load on the machine barely moves;
  chameleond's and Redis's CPU per step is given beside it.
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
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chameleond.cli.bench_cluster import JOB as BENCH_JOB
from chameleond.cli.bench_cluster import wait_steps, warmed_up
from chameleond.cli.bench_recovery import _slowest_worker_seconds, plan_rows
from chameleond.cli.up import build_spec_document
from chameleond.core.spec import SpecError, load_spec, parse_spec
from chameleond.local.cluster import ClusterError, Interrupted, LocalCluster
from chameleond.local.examples import ExampleError, FoundExample, find_example
from chameleond.local.faults import Fault
from chameleond.local.monitor import StreamMonitor
from chameleond.local.progress import ProgressView
from chameleond.local.run import LocalRun, RunOptions
from chameleond.redis_server import free_port

JOB = "bench-worker"
WARMUP_STEPS = 2  # steps left out of a step-time median (the first pays for warm-up)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="overhead: data-parallel workers")
    parser.add_argument(
        "--overhead-steps", type=int, default=30, help="overhead: steps per run (default 30)"
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=96,
        help="overhead: samples per step (default 96: 24 micro-batches per worker, so a step "
        "lasts as long as the library's fixed cost per step is small against it)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="overhead: library runs, each between plain runs"
    )
    parser.add_argument("--steps", type=int, default=30, help="loss_match: steps per run")
    parser.add_argument("--reroute-victim", default="w0", help="killed at --reroute-step")
    parser.add_argument("--reroute-step", type=int, default=6)
    parser.add_argument("--dynamic-victim", default="w5", help="killed at --dynamic-step")
    parser.add_argument("--dynamic-step", type=int, default=14)
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")


# -- the plain torch loop ------------------------------------------------------------------------


def _plain(
    example: FoundExample, spec: Path, workers: int, steps: int, tmp: Path
) -> dict[str, list[float]]:
    """Rank 0's step seconds and CPU seconds per step, of `workers` plain ranks (torchrun's
    environment, set here)."""
    timings = tmp / f"plain-{time.monotonic_ns()}.json"
    port = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [*example.worker_command(), "--plain", "--spec", str(spec), "--steps", str(steps)]
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank in range(workers):
            env = {
                **base,
                "RANK": str(rank),
                "WORLD_SIZE": str(workers),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            log = (tmp / f"plain-{rank}.log").open("wb")
            logs.append(log)
            extra = ["--timings", str(timings)] if rank == 0 else []
            # Each rank in its own session, as LocalCluster starts workers: with the kernel's
            # autogroup scheduling a session is what shares the CPU with other sessions.
            procs.append(
                subprocess.Popen(  # noqa: S603 - argv of this interpreter and the example script, no shell
                    argv + extra, env=env, stdout=log, stderr=log, start_new_session=True
                )
            )
        for rank, p in enumerate(procs):
            if p.wait(timeout=600) != 0:
                raise ClusterError(
                    f"plain rank {rank} exited {p.returncode}; see {tmp / f'plain-{rank}.log'}"
                )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    data: dict[str, list[float]] = json.loads(timings.read_text())
    return data


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


def _commit_seconds(mon: StreamMonitor) -> list[float]:
    commits = sorted((c.step, c.at) for c in mon.commits)
    return [b[1] - a[1] for a, b in itertools.pairwise(commits) if b[0] == a[0] + 1]


def _cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a live process (Linux /proc), 0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _library_steady(
    example: FoundExample, spec_path: Path, run_dir: Path, steps: int, timeout: float
) -> dict[str, float]:
    """Train `steps` steps after WARMUP_STEPS through the library, no faults: the median time
    between commits, the slowest worker's median step, and the CPU seconds per step of a worker
    and of the control plane (chameleond and Redis) over those steps."""
    workers = [w.id for w in load_spec(spec_path).workers]
    with (
        LocalCluster(
            run_dir,
            job=BENCH_JOB,
            workers=workers,
            spec_path=spec_path,
            worker_command=example.worker_command(),
        ) as cluster,  # fmt: skip
        warmed_up(cluster, WARMUP_STEPS, timeout) as mon,
    ):
        pids = [c.pid for c in cluster.workers.values()]
        control = [cluster.daemon.pid if cluster.daemon else None]
        control.append(cluster.redis.proc.pid if cluster.redis and cluster.redis.proc else None)
        first = len(mon.commits)
        cpu0 = [_cpu_seconds(p) for p in pids], sum(_cpu_seconds(p) for p in control)
        wait_steps(mon, cluster, first + steps, None, timeout)
        done = len(mon.commits) - first
        cpu1 = [_cpu_seconds(p) for p in pids], sum(_cpu_seconds(p) for p in control)
        mon.read_all()
    workers_cpu = cpu0[0], cpu1[0]
    slowest = _slowest_worker_seconds(mon, 1)[WARMUP_STEPS:]
    return {
        "step_seconds": statistics.median(_commit_seconds(mon)[WARMUP_STEPS:]),
        "worker_step_seconds": statistics.median(slowest),
        "cpu_seconds": statistics.fmean(b - a for a, b in zip(*workers_cpu, strict=True)) / done,
        "control_plane_cpu_seconds": (cpu1[1] - cpu0[1]) / done,
    }


def overhead(args: argparse.Namespace, example: FoundExample, tmp: Path) -> dict[str, Any]:
    """Plain and library runs in turn (plain, library, plain, ...): each library run against the
    mean of the plain runs on either side of it; the figure is the median over the rounds."""
    base = load_spec(example.spec)
    doc = build_spec_document(base, job=BENCH_JOB, workers=args.workers, pp=1,
                              bind_addresses=[], mtbf_prior_seconds=None)  # fmt: skip
    doc["training"]["global_batch"] = args.global_batch
    parse_spec(doc)
    spec_path = tmp / "overhead-spec.json"
    spec_path.write_text(json.dumps(doc))
    n = args.overhead_steps
    plains = [_plain(example, spec_path, args.workers, n, tmp)]
    libraries = []
    for r in range(args.rounds):
        run_dir = tmp / f"overhead-{r}"
        libraries.append(_library_steady(example, spec_path, run_dir, n, args.timeout))
        plains.append(_plain(example, spec_path, args.workers, n, tmp))
    plain_step = [statistics.median(p["step_seconds"][WARMUP_STEPS:]) for p in plains]
    plain_cpu = [statistics.median(p["cpu_seconds"][WARMUP_STEPS:]) for p in plains]
    step_ratios = [
        lib["step_seconds"] / ((plain_step[r] + plain_step[r + 1]) / 2)
        for r, lib in enumerate(libraries)
    ]
    cpu_ratios = [
        lib["cpu_seconds"] / ((plain_cpu[r] + plain_cpu[r + 1]) / 2)
        for r, lib in enumerate(libraries)
    ]
    return {
        "overhead": round(statistics.median(step_ratios) - 1, 4),
        "overhead_cpu": round(statistics.median(cpu_ratios) - 1, 4),
        "library_step_seconds": [round(lib["step_seconds"], 4) for lib in libraries],
        "library_worker_step_seconds": [round(lib["worker_step_seconds"], 4) for lib in libraries],
        "plain_step_seconds": [round(x, 4) for x in plain_step],
        "library_cpu_seconds_per_step": [round(lib["cpu_seconds"], 4) for lib in libraries],
        "plain_cpu_seconds_per_step": [round(x, 4) for x in plain_cpu],
        "control_plane_cpu_seconds_per_step": [
            round(lib["control_plane_cpu_seconds"], 4) for lib in libraries
        ],
        "workers": args.workers,
        "global_batch": args.global_batch,
        "micro_batch": doc["training"]["micro_batch"],
        "steps": n,
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
            over = overhead(args, example, tmp)
            match = loss_match(args, example, tmp)
    except (ExampleError, SpecError) as e:
        print(f"chameleonctl bench worker: {e}", file=sys.stderr)
        return 2
    except (ClusterError, Interrupted, KeyboardInterrupt, subprocess.TimeoutExpired) as e:
        print(f"chameleonctl bench worker: {e}", file=sys.stderr)
        return 1
    out = {
        "model": example.example.model,
        "overhead": over["overhead"],
        "overhead_cpu": over["overhead_cpu"],
        "loss_match": match["loss_match"],
        "samples_skipped": match["samples_skipped"],
        "samples_repeated": match["samples_repeated"],
        "estimate_error": match["estimate_error"],
        "overhead_run": over,
        "fault_run": match,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    o, m = out["overhead_run"], out["fault_run"]
    print(f"model {out['model']} (examples/hf_gpt2.py), CPU")
    print(
        f"  overhead: {out['overhead']:+.4f} (target <= 0.03): library step "
        f"{o['library_step_seconds']} s vs plain torch {o['plain_step_seconds']} s (runs in turn), "
        f"{o['workers']} data-parallel workers, batch {o['global_batch']} in micro-batches of "
        f"{o['micro_batch']}"
    )
    print(
        f"  overhead_cpu: {out['overhead_cpu']:+.4f}: CPU seconds per step and worker, library "
        f"{o['library_cpu_seconds_per_step']} vs plain {o['plain_cpu_seconds_per_step']}; "
        f"chameleond + Redis {o['control_plane_cpu_seconds_per_step']}"
    )
    print(
        f"  loss_match: {out['loss_match']} (target <= 1e-5) over {m['steps_compared']} steps "
        f"with {', '.join(m['faults'])} (plans: {', '.join(m['policies'])}); samples skipped "
        f"{out['samples_skipped']}, repeated {out['samples_repeated']}"
    )
    print(f"  estimate_error after the re-partition: {out['estimate_error']} (target <= 0.15)")
