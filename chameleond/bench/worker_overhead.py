"""`overhead` of `chameleonctl bench worker`: the library against a plain torch loop, side by side.

Both trainings run examples/hf_gpt2.py on the same spec: the library on --workers workers (one stage
each, data-parallel, no faults) under a local chameleond; the plain loop (the script's --plain loop,
paced by chameleond.bench.plain_gated: one gloo process group of as many ranks, each its share of
the same micro-batches, one all-reduce of the gradients, one AdamW; what a user writes without
chameleond) on as many ranks, each in a session of its own as each worker is. Both are started once,
warmed up, then take turns in blocks of --block-steps steps (plain, library, plain, ..., --rounds
library blocks), each pausing between two steps while the other runs (chameleond.worker._gate), so
every library block is measured within seconds of a plain block on either side, under the same load.
Both use one torch thread per process (OMP_NUM_THREADS=1; the library and the plain loop both set
torch's threads to 1).

Each process times its own steps, the same way in both trainings (chameleond.worker._gate): wall
seconds and CPU seconds of the whole process (gloo's and the library's threads included) from the
start of a step to the start of the next. The first step of a block is left out (the other
training's turn left the caches cold). A step's time is its slowest process's; a block's time the
median of its steps; each library block is compared with the mean of the plain blocks on either
side, and `overhead` is the median of these ratios, minus 1. `overhead_cpu` is the same with the CPU
seconds per step, averaged over the processes, which other load on the machine barely moves.
chameleond's and Redis's CPU per library step is given beside it, and so is the CPU each paused
training spent while the other ran (its background: heartbeats, plan watch, the gate's polling)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chameleond.cli.up import build_spec_document
from chameleond.core.spec import load_spec, parse_spec
from chameleond.local.cluster import ClusterError, LocalCluster
from chameleond.local.examples import FoundExample
from chameleond.redis_server import free_port

JOB = "bench-worker-overhead"
WARMUP_STEPS = 3  # steps before the first block: the first pays for the process's warm-up


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="overhead: data-parallel workers")
    parser.add_argument(
        "--global-batch",
        type=int,
        default=96,
        help="overhead: samples per step (default 96: 24 micro-batches per worker)",
    )
    parser.add_argument(
        "--block-steps", type=int, default=6, help="overhead: steps per turn (default 6)"
    )
    parser.add_argument(
        "--rounds", type=int, default=6, help="overhead: library turns, each between plain turns"
    )


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a live process (Linux /proc), 0 when unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (OSError, TypeError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(pids: Sequence[int | None]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def _wait_records(
    paths: Sequence[Path], steps: int, alive: Callable[[], None], timeout: float
) -> None:
    """Until every record file holds steps 0..steps-1 (each process reached the gate of `steps`)."""
    from chameleond.worker._gate import read_record

    deadline = time.monotonic() + timeout
    while not all(len(read_record(p)) >= steps for p in paths):
        alive()
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f} s waiting for step {steps - 1}")
        time.sleep(0.02)


def _block(records: Sequence[dict[int, tuple[float, float]]], steps: range) -> tuple[float, float]:
    """A block's step seconds (median over its steps of the slowest process) and CPU seconds per
    step and process (median of the mean over the processes); its first step left out."""
    measured = steps[1:]
    wall = [max(r[s][0] for r in records) for s in measured]
    cpu = [statistics.fmean(r[s][1] for r in records) for s in measured]
    return statistics.median(wall), statistics.median(cpu)


def _ratios(library: Sequence[float], plain: Sequence[float]) -> list[float]:
    """Each library block against the mean of the plain blocks before and after it."""
    return [lib / ((plain[r] + plain[r + 1]) / 2) for r, lib in enumerate(library)]


def _plain_ranks(
    example: FoundExample, spec: Path, workers: int, steps: int, gate: Path, logs: Path
) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "chameleond.bench.plain_gated", "--example", str(example.script),
            "--spec", str(spec), "--steps", str(steps), "--gate", str(gate)]  # fmt: skip
    procs = []
    for rank in range(workers):
        env = {**base, "RANK": str(rank), "WORLD_SIZE": str(workers),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        with (logs / f"plain-{rank}.log").open("wb") as log:
            # Each rank in its own session, as LocalCluster starts workers: with the kernel's
            # autogroup scheduling a session is what shares the CPU with other sessions.
            procs.append(
                subprocess.Popen(  # noqa: S603 - argv of this interpreter and the example script, no shell
                    argv, env=env, stdout=log, stderr=log, start_new_session=True
                )
            )
    return procs


def overhead(
    args: argparse.Namespace, example: FoundExample, tmp: Path, timeout: float
) -> dict[str, Any]:
    from chameleond.worker._gate import GATE_ENV, open_gate, read_record

    base = load_spec(example.spec)
    doc = build_spec_document(base, job=JOB, workers=args.workers, pp=1,
                              bind_addresses=[], mtbf_prior_seconds=None)  # fmt: skip
    doc["training"]["global_batch"] = args.global_batch
    parse_spec(doc)
    run_dir = tmp / "overhead"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(doc))
    gate = run_dir / "gate"
    k, rounds = args.block_steps, args.rounds
    if k < 2 or rounds < 1:
        raise ClusterError("--block-steps must be >= 2 and --rounds >= 1")
    plain_steps = WARMUP_STEPS + k * (rounds + 1)
    open_gate(gate, 0, WARMUP_STEPS)
    workers = [w.id for w in load_spec(spec_path).workers]
    lib_paths = [Path(f"{gate}.{w}") for w in workers]
    plain_paths = [Path(f"{gate}.plain{r}") for r in range(args.workers)]
    procs: list[subprocess.Popen[bytes]] = []
    with LocalCluster(run_dir, job=JOB, workers=workers, spec_path=spec_path,
                      worker_command=example.worker_command(), env={GATE_ENV: str(gate)},
                      ) as cluster:  # fmt: skip
        try:

            def alive() -> None:
                cluster.check_daemon()
                for w, child in cluster.workers.items():
                    if not child.alive:
                        raise ClusterError(f"worker {w} exited; see {child.log_path}")
                for r, p in enumerate(procs):
                    if p.poll() not in (None, 0):
                        raise ClusterError(f"plain rank {r} exited {p.returncode}; see {run_dir}")

            cluster.start_daemon()
            cluster.start_workers()
            _wait_records(lib_paths, WARMUP_STEPS, alive, timeout)
            procs += _plain_ranks(example, spec_path, args.workers, plain_steps, gate, run_dir)
            lib_pids = [c.pid for c in cluster.workers.values()]
            control = [cluster.daemon.pid if cluster.daemon else None]
            control.append(cluster.redis.proc.pid if cluster.redis and cluster.redis.proc else None)
            plain_pids: list[int | None] = [p.pid for p in procs]
            limits = {"plain": 0, "library": WARMUP_STEPS}
            idle = {"plain": [0.0, 0.0], "library": [0.0, 0.0]}  # CPU, wall of the paused one
            control_cpu = 0.0

            def turn(kind: str, steps: int) -> None:
                nonlocal control_cpu
                paused = lib_pids + control if kind == "plain" else plain_pids
                c0, w0, ctl0 = _cpu(paused), time.monotonic(), _cpu(control)
                limits[kind] += steps
                open_gate(gate, limits["plain"], limits["library"])
                paths = plain_paths if kind == "plain" else lib_paths
                _wait_records(paths, limits[kind], alive, timeout)
                other = "library" if kind == "plain" else "plain"
                idle[other][0] += _cpu(paused) - c0
                idle[other][1] += time.monotonic() - w0
                if kind == "library":
                    control_cpu += _cpu(control) - ctl0

            turn("plain", WARMUP_STEPS)
            starts = {"plain": [], "library": []}  # type: dict[str, list[int]]
            for _ in range(rounds):
                for kind in ("plain", "library"):
                    starts[kind].append(limits[kind])
                    turn(kind, k)
            starts["plain"].append(limits["plain"])
            turn("plain", k)
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    lib_records = [read_record(p) for p in lib_paths]
    plain_records = [read_record(p) for p in plain_paths]
    lib = [_block(lib_records, range(s, s + k)) for s in starts["library"]]
    plain = [_block(plain_records, range(s, s + k)) for s in starts["plain"]]
    step_ratios = _ratios([b[0] for b in lib], [b[0] for b in plain])
    cpu_ratios = _ratios([b[1] for b in lib], [b[1] for b in plain])
    return {
        "overhead": round(statistics.median(step_ratios) - 1, 4),
        "overhead_cpu": round(statistics.median(cpu_ratios) - 1, 4),
        "step_ratios": [round(r, 4) for r in step_ratios],
        "cpu_ratios": [round(r, 4) for r in cpu_ratios],
        "library_step_seconds": [round(b[0], 4) for b in lib],
        "plain_step_seconds": [round(b[0], 4) for b in plain],
        "library_cpu_seconds_per_step": [round(b[1], 4) for b in lib],
        "plain_cpu_seconds_per_step": [round(b[1], 4) for b in plain],
        "control_plane_cpu_seconds_per_step": round(control_cpu / (rounds * k), 4),
        # CPU cores the paused training used while the other ran: its share of the machine
        "paused_library_cores": round(idle["library"][0] / max(idle["library"][1], 1e-9), 4),
        "paused_plain_cores": round(idle["plain"][0] / max(idle["plain"][1], 1e-9), 4),
        "workers": args.workers,
        "global_batch": args.global_batch,
        "micro_batch": doc["training"]["micro_batch"],
        "block_steps": k,
        "rounds": rounds,
    }
