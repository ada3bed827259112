"""Decision latency of the planner: fault set in -> selected plan with manifest and rounds out.

For clusters of 8 to 1,024 devices (GPT 1.3B-class per-layer profile, 4 stages per pipeline,
8 devices per host, 8 micro-batches per pipeline) and several failure sets each, times `decide()`
(both candidates: rerouting table, Algorithm 1, Hungarian assignment, migration manifest, colouring
rounds, estimates, selection). Up to 64 devices, the search's optimum by Algorithm 1's objective
(`SearchResult.optimum`) is checked against the exact search of the same space (`bench/exact.py`):
`optimality_gap`, and that search's CPU time.

The search keeps per-job tables across decisions (`search.job_tables`: nothing a fault changes),
as the daemon's decisions of one job share them. Each job's first decision starts cold and is
reported on its own (`first_seconds`, `first_cpu_seconds`); the percentiles are of the decisions
after it, each timed as the daemon makes it: after `decide.prepare` (untimed: the daemon runs it
between faults), which leaves the search's results for the loss of the plan's last host and of
one, two and four workers. The same decisions with those results dropped, the search run inside
the decision on the kept tables, are timed in turns with them (`unprepared_*`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from chameleond.bench.exact import exact
from chameleond.core.decide import decide, initial_plan, prepare
from chameleond.core.plan import Plan
from chameleond.core.search import forget_results, forget_tables, search
from chameleond.core.spec import JobSpec, load_spec, parse_spec

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
STAGES = 4
GIB = 2**30
# Beyond this the exact search is not run (it takes seconds at 64); the gap is then null.
EXACT_MAX_DEVICES = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="device counts")
    parser.add_argument("--repeat", type=int, default=5, help="timed decisions per failure set")
    parser.add_argument(
        "--spec", default=None, help="time decisions on this job spec (examples/cluster-8192.toml)"
    )


def cluster_spec(devices: int) -> JobSpec:
    """A GPT 1.3B-class job on `devices` devices: devices / 4 pipelines of 4 stages."""
    block = {
        "name": "block", "count": 24, "forward_seconds": 0.004, "backward_seconds": 0.008,
        "param_bytes": 100_716_544, "optimizer_bytes": 604_299_264,
        "activation_bytes": 142_606_336, "output_bytes": 8_388_608,
    }  # fmt: skip
    embedding = dict(block, name="embedding", count=1, forward_seconds=0.0003,
                     backward_seconds=0.0006, param_bytes=214_171_648,
                     optimizer_bytes=1_285_029_888, activation_bytes=8_388_608)  # fmt: skip
    head = dict(block, name="head", count=1, forward_seconds=0.007, backward_seconds=0.014,
                param_bytes=205_852_672, optimizer_bytes=1_235_116_032,
                activation_bytes=411_705_344, output_bytes=0)  # fmt: skip
    pipelines = devices // STAGES
    return parse_spec(
        {
            "job": {"name": f"bench-{devices}", "rebuild_seconds": 2.0},
            "workers": [
                {"id": f"w{i}", "host": f"h{i // 8}", "memory_bytes": 32 * GIB}
                for i in range(devices)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e11, "latency_seconds": 5e-6},
                "inter_host": {"bandwidth_bytes_per_second": 1.25e10, "latency_seconds": 1e-5},
            },
            "model": {"layers": [embedding, block, head]},
            "training": {"global_batch": 8 * pipelines, "micro_batch": 1},
            "plan": {"stages": STAGES},
            "search": {"min_stages": 2, "max_stages": 8},
        }
    )


def failure_sets(devices: int, seed: int = 0) -> list[list[str]]:
    """A first-stage worker, a last-stage worker, two and four random workers."""
    rng = random.Random(seed + devices)  # noqa: S311 - seeded choice of benchmark faults, not a secret
    ids = [f"w{i}" for i in range(devices)]
    return [
        ["w1" if devices > 8 else "w0"],
        [ids[-1]],
        rng.sample(ids, 2),
        rng.sample(ids, 4 if devices > 8 else 3),
    ]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _timed(spec: JobSpec, current: Plan, failed: list[str]) -> tuple[int, float, float]:
    """One decision: (plans considered, wall seconds, CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    d = decide(spec, current, failed, mtbf_seconds=spec.mtbf_prior_seconds, generation=2)
    return d.plans_considered, time.perf_counter() - t0, time.process_time() - c0


def measure(devices: int, repeat: int, spec: JobSpec | None = None) -> dict[str, Any]:
    spec = spec or cluster_spec(devices)
    forget_tables()  # this job's first decision builds its tables, as the daemon's first does
    current = initial_plan(spec, generation=1)
    sets = failure_sets(devices)
    considered, first_s, first_cpu = _timed(spec, current, sets[0])
    # Wall and CPU seconds of the decisions prepared for (True) and not (False).
    samples: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    gaps: list[float] = []
    exact_cpu: list[float] = []
    for failed in sets:
        for _ in range(repeat):
            for prepared in (True, False):
                forget_results()
                if prepared:
                    prepare(spec, current)
                plans, wall, c = _timed(spec, current, failed)
                samples[prepared].append(wall)
                cpu[prepared].append(c)
                considered = max(considered, plans)
        survivors = [w.id for w in spec.workers if w.id not in failed]
        if devices > EXACT_MAX_DEVICES:
            continue
        c0 = time.process_time()
        ref = exact(spec, survivors)
        exact_cpu.append(time.process_time() - c0)
        found = search(spec, survivors).optimum
        if ref.layout is not None and found is not None:
            gaps.append(max(0.0, (found.seconds - ref.layout.seconds) / ref.layout.seconds))
    return {
        "devices": devices,
        "p50_seconds": statistics.median(samples[True]),
        "p99_seconds": _percentile(samples[True], 0.99),
        # CPU time: what a decision costs, whatever else the machine runs meanwhile.
        "p50_cpu_seconds": statistics.median(cpu[True]),
        "p99_cpu_seconds": _percentile(cpu[True], 0.99),
        "unprepared_p50_seconds": statistics.median(samples[False]),
        "unprepared_p99_seconds": _percentile(samples[False], 0.99),
        "unprepared_p99_cpu_seconds": _percentile(cpu[False], 0.99),
        "first_seconds": first_s,
        "first_cpu_seconds": first_cpu,
        "plans_considered": considered,
        "optimality_gap": max(gaps) if gaps else None,
        "exact_cpu_seconds": max(exact_cpu) if exact_cpu else None,  # slowest failure set
    }


def run(args: argparse.Namespace) -> int:
    try:
        sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    except ValueError:
        print(f"bench planner: --sizes: not a list of integers: {args.sizes}")
        return 2
    if any(n < 8 or n % 8 for n in sizes) or args.repeat < 1:
        print("bench planner: sizes must be multiples of 8 (>= 8) and --repeat >= 1")
        return 2
    rows = []
    spec = load_spec(args.spec) if args.spec else None
    if spec is not None:
        sizes = [len(spec.workers)]
    if not args.json:
        print(f"{'devices':>7} {'p50_ms':>9} {'p99_ms':>9} {'p99_cpu_ms':>10} "
              f"{'unprep_p99_ms':>13} {'first_ms':>9} "
              f"{'first_cpu_ms':>12} {'plans_considered':>16} {'gap':>8} "
              f"{'exact_cpu_s':>11}")  # fmt: skip
    for n in sizes:
        row = measure(n, args.repeat, spec)
        rows.append(row)
        if not args.json:
            gap = "-" if row["optimality_gap"] is None else f"{row['optimality_gap']:.4f}"
            cpu = row["exact_cpu_seconds"]
            exact_s = "-" if cpu is None else f"{cpu:.2f}"
            print(
                f"{n:>7} {row['p50_seconds'] * 1e3:>9.2f} {row['p99_seconds'] * 1e3:>9.2f} "
                f"{row['p99_cpu_seconds'] * 1e3:>10.2f} "
                f"{row['unprepared_p99_seconds'] * 1e3:>13.2f} {row['first_seconds'] * 1e3:>9.2f} "
                f"{row['first_cpu_seconds'] * 1e3:>12.2f} {row['plans_considered']:>16} {gap:>8} "
                f"{exact_s:>11}",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0
