"""Fail-slow on CPU: one worker at half speed in a 2-pipeline job, with and without mitigation.

Two runs of the packaged job (--pipelines pipelines of --stages stages, each worker priced as a
device of its own: `slow_job`), one after the other in one invocation. The default, two
pipelines of one stage, puts one worker on each core of a 2-core machine: a process throttled
there is slowed as a throttled device is. With more workers than cores its peers take the cores
it leaves, and the job hardly slows (two pipelines of three stages on 2 cores: unmitigated 0.99
of healthy in one run, 0.66 and 0.74 in others), which measures the machine, not the decision.
Each trains healthy for --healthy-seconds, then one worker (--victim) is slowed to --factor of its
speed for real: every CPU second its process spends costs it 1/factor seconds of wall time, as
pauses (chameleond/local/slowdown.py), its compute and its communication alike.

* unmitigated: `slow_mitigation` off, its default (detection and metrics on, no decision):
  the job runs at the slow worker's pace. `throughput_slow_unmitigated` is measured over
  --measure-steps committed steps once the slowness has settled.
* mitigated: the daemon with `--slow-mitigation`. `detect_seconds` is the onset to the daemon's
  decision about the slow worker; `throughput_mitigated` the plan it chose, over --measure-steps
  steps; `throughput_model_best_raw` the model's best candidate for the slow cluster (the global
  batch over the shortest estimated step among the decision's feasible candidates), and
  `throughput_model_best` the same in this machine's units: the unmitigated run's throughput
  measured (the plan `keep` prices) times the model's best over its `keep`, both from the one
  decision (`model_gain`). The model's absolute step times are off from the steps measured on a
  shared CPU by a factor of their own; the ratio is what the decision rests on. Then the
  worker is restored: `recover_detect_seconds` is the restore to the first decision about it
  (`recovered_by`, its cause): its recovery, or first a change of speed (a worker left part of
  its work reads slower than it is on a shared CPU: jobstate/slowness.py), whose plan gives its
  share back; or, where the plan excluded it (fenced, exit 9), its restart by the bench as its
  supervisor would to the decision on its rejoin.

`throughput_healthy` is the mitigated run's healthy phase, and `false_alarms` the slow episodes the
daemon detected in the healthy phases of both runs (no worker was slowed then; the machine's own
noise, the other run's start-up and whatever else runs here are all there is). `samples_lost` and
`samples_repeated` come from the committed steps (a step number missing between the first and the
last, or committed twice). `simulated` compares the policies on a fail-slow trace at 1,024 devices
(chameleond/sim: the same core as the daemon).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from chameleond.bench.cluster import JOB, spec_file, warmed_up, worker_ids
from chameleond.core.fields import SpecError
from chameleond.extras import require
from chameleond.local.cluster import ClusterError, Interrupted, LocalCluster, wait_for
from chameleond.local.monitor import StreamMonitor
from chameleond.records import DecisionRecord, read_record


def slow_job(
    tmp: Path, pipelines: int = 2, stages: int = 3, global_batch: int | None = None
) -> Path:
    """The packaged job as `pipelines` pipelines of `stages` stages (and `global_batch` samples
    a step, when given), without its shared-host table: each worker is priced as a device of
    its own (as on accelerators), so a worker back to full speed adds capacity the planner
    takes back."""
    path = spec_file(tmp, workers=pipelines * stages, pp=stages)
    doc = json.loads(path.read_text())
    doc["hosts"] = {}
    if global_batch is not None:
        doc["training"]["global_batch"] = doc["training"]["min_global_batch"] = global_batch
    path.write_text(json.dumps(doc))
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pipelines", type=int, default=2, help="pipelines (default 2)")
    parser.add_argument("--stages", type=int, default=1, help="stages per pipeline (default 1)")
    parser.add_argument(
        "--global-batch",
        type=int,
        help="samples a step (default the packaged job's 12: 3 micro-batches a pipeline)",
    )
    parser.add_argument(
        "--victim", help="the worker slowed (default: the middle stage of the last pipeline)"
    )
    parser.add_argument("--factor", type=float, default=0.5, help="its speed (default 0.5)")
    parser.add_argument(
        "--healthy-seconds",
        type=float,
        default=600.0,
        help="the mitigated run's healthy phase, where false alarms are counted (default 600)",
    )
    parser.add_argument("--measure-steps", type=int, default=20, help="steps per throughput")
    parser.add_argument("--timeout", type=float, default=300.0, help="per phase, seconds")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator's comparison")


def run(args: argparse.Namespace) -> int:
    require("worker", "bench slow (it runs CPU workers)")
    if (
        not 0 < args.factor < 1
        or args.healthy_seconds < 0
        or args.measure_steps < 3
        or args.pipelines < 2
        or args.stages < 1
    ):
        print(
            "chameleonctl bench slow: --factor in (0, 1), --healthy-seconds >= 0, "
            "--measure-steps >= 3, --pipelines >= 2 and --stages >= 1 are required",
            file=sys.stderr,
        )
        return 2
    if args.victim is None:
        args.victim = f"w{(args.pipelines - 1) * args.stages + args.stages // 2}"
    try:
        with tempfile.TemporaryDirectory(prefix="chameleon-slow-") as tmp:
            figures = measure(Path(tmp), args)
    except (ClusterError, Interrupted, TimeoutError, SpecError) as e:
        print(f"chameleonctl bench slow: {e}", file=sys.stderr)
        return 1
    print(json.dumps(figures, indent=2) if args.json else text(figures))
    return 0


def measure(tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    off = _run(tmp / "unmitigated", args, mitigate=False, healthy=min(args.healthy_seconds, 30.0))
    on = _run(tmp / "mitigated", args, mitigate=True, healthy=args.healthy_seconds)
    healthy, slow, mitigated = on["healthy"], off["slow"], on["slow"]
    # The model's best in this machine's units: what it expects of the slow cluster against what
    # it expects of the healthy one, times the healthy throughput measured.
    gain = _ratio(on["model_best"], on["model_keep"])
    calibrated = None if gain is None or slow is None else gain * slow
    figures: dict[str, Any] = {
        "victim": args.victim,
        "factor": args.factor,
        "pipelines": args.pipelines,
        "stages": args.stages,
        "global_batch": args.global_batch,
        "throughput_healthy": healthy,
        "throughput_slow_unmitigated": slow,
        "throughput_mitigated": mitigated,
        "throughput_model_best": calibrated,
        "throughput_model_best_raw": on["model_best"],
        "model_gain": gain,
        "mitigated_over_unmitigated": _ratio(mitigated, slow),
        "mitigated_over_model_best": _ratio(mitigated, calibrated),
        "mitigated_over_model_best_raw": _ratio(mitigated, on["model_best"]),
        "selected": on["selected"],
        "detect_seconds": on["detect_seconds"],
        "recover_detect_seconds": on["recover_detect_seconds"],
        "recovered_by": on["recovered_by"],
        "healthy_seconds": off["healthy_seconds"] + on["healthy_seconds"],
        "false_alarms": off["false_alarms"] + on["false_alarms"],
        "samples_lost": off["lost"] + on["lost"],
        "samples_repeated": off["repeated"] + on["repeated"],
    }
    if not args.no_sim:
        figures["simulated"] = simulated()
    return figures


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _run(
    run_dir: Path, args: argparse.Namespace, *, mitigate: bool, healthy: float
) -> dict[str, Any]:
    from chameleond.local.slowdown import Slowdown

    run_dir.mkdir(parents=True)
    spec = slow_job(run_dir, args.pipelines, args.stages, args.global_batch)
    batch = json.loads(spec.read_text())["training"]["global_batch"]
    cluster = LocalCluster(
        run_dir, job=JOB, workers=worker_ids(spec), spec_path=spec,
        daemon_args=["--slow-mitigation"] if mitigate else [],
    )  # fmt: skip
    out: dict[str, Any] = {}
    with cluster, warmed_up(cluster, 5, args.timeout) as mon:
        start = time.monotonic()
        while time.monotonic() - start < healthy:
            mon.poll(block_ms=200)
            cluster.check_daemon()
        out["healthy"] = _throughput(mon, cluster, batch, args.measure_steps, args.timeout)
        out["healthy_seconds"] = time.monotonic() - start
        out["false_alarms"] = _episodes(cluster)
        victim = cluster.workers[args.victim].pid
        if victim is None:
            raise ClusterError(f"{args.victim} is not running")
        slowdown = Slowdown(victim, args.factor)
        slowdown.start()
        onset = time.time()
        try:
            if mitigate:
                decision = _decision(mon, cluster, args.victim, ("slow",), onset, args.timeout)
                out["detect_seconds"] = decision.at - onset
                out["selected"] = _candidate(decision)
                out["model_best"] = _model_best(decision, batch)
                out["model_keep"] = _model_best(decision, batch, "keep")
                _settle(mon, cluster, decision.generation, args.timeout)
            else:
                time.sleep(10.0)  # longer than detection takes: the same moment as mitigated's
            out["slow"] = _throughput(mon, cluster, batch, args.measure_steps, args.timeout)
        finally:
            slowdown.stop()
        if mitigate:
            restored = time.time()
            # Back to speed: its recovery, or first a change of speed (a worker left part of its
            # work reads slower than it is on a shared CPU: jobstate/slowness.py).
            words: tuple[str, ...] = ("recovered", "slow: speed")
            if out["selected"] == "exclude":
                # The plan fenced it (exit 9): its supervisor starts it again, as chameleon-agent
                # or systemd would, and the new process rejoins.
                child = cluster.workers[args.victim]
                if child.proc is not None:
                    child.proc.wait(timeout=args.timeout)
                cluster.start_worker(args.victim)
                words = ("rejoined",)
            back = _decision(mon, cluster, args.victim, words, restored, args.timeout)
            out["recover_detect_seconds"] = back.at - restored
            out["recovered_by"] = back.cause
        mon.read_all()
        steps = [c.step for c in mon.commits]
        out["repeated"] = len(steps) - len(set(steps))
        out["lost"] = max(steps) - min(steps) + 1 - len(set(steps)) if steps else 0
    return out


def _throughput(
    mon: StreamMonitor, cluster: LocalCluster, batch: int, n: int, timeout: float
) -> float:
    """Samples per second over the next `n` committed steps."""
    first = len(mon.commits)

    def enough() -> bool:
        mon.poll(block_ms=100)
        cluster.check_daemon()
        return len(mon.commits) >= first + n + 1

    wait_for(enough, timeout, f"{n} more committed steps", 0)
    window = mon.commits[first : first + n + 1]
    return n * batch / (window[-1].at - window[0].at)


def _decision(
    mon: StreamMonitor,
    cluster: LocalCluster,
    worker: str,
    words: tuple[str, ...],
    since: float,
    timeout: float,
) -> DecisionRecord:
    """The first decision after `since` whose cause says `worker` is one of `words` (slow,
    recovered, rejoined)."""
    found: list[DecisionRecord] = []

    def decided() -> bool:
        mon.poll(block_ms=100)
        cluster.check_daemon()
        for entry_id, fields in mon.decisions:
            r = read_record(entry_id, fields)
            if (
                isinstance(r, DecisionRecord)
                and r.at >= since
                and any(f"{worker} {word}" in r.cause for word in words)
            ):
                found.append(r)
                return True
        return False

    wait_for(decided, timeout, f"a decision about {worker} ({', '.join(words)})", 0)
    return found[0]


def _settle(mon: StreamMonitor, cluster: LocalCluster, generation: int, timeout: float) -> None:
    """Until the plan of `generation` (or a later one) has committed two steps."""

    def trained() -> bool:
        mon.poll(block_ms=100)
        cluster.check_daemon()
        return sum(c.generation >= generation for c in mon.commits) >= 2

    wait_for(trained, timeout, f"two steps on generation {generation}", 0)


def _candidate(decision: DecisionRecord) -> str:
    """The candidate a slow decision selected (its note: `slow: exclude selected`)."""
    words = decision.note.split()
    return words[1] if len(words) == 3 and words[0] == "slow:" else decision.selected or "keep"


def _model_best(decision: DecisionRecord, batch: int, policy: str | None = None) -> float | None:
    """The global batch over the shortest estimated step of the decision's feasible candidates
    (of `policy` only, when given)."""
    steps = [
        float(c["step_seconds"])
        for c in decision.candidates
        if c.get("feasible", True)
        and isinstance(c.get("step_seconds"), int | float)
        and (policy is None or c.get("policy") == policy)
    ]
    return batch / min(steps) if steps else None


def _episodes(cluster: LocalCluster) -> int:
    """Slow episodes the daemon detected so far (its metric)."""
    with urllib.request.urlopen(f"{cluster.http_url}/metrics", timeout=5) as r:  # noqa: S310
        body = r.read().decode()
    total = 0.0
    for m in re.finditer(
        r'^chameleon_slow_episodes_total\{[^}]*outcome="detected"[^}]*\} (\S+)$', body, re.M
    ):
        total += float(m.group(1))
    return int(total)


def simulated() -> dict[str, Any]:
    """Every policy on a synthetic fail-slow trace at 1,024 devices (chameleond/sim)."""
    from chameleond.bench.policies import slow_rows

    return slow_rows()


def text(f: dict[str, Any]) -> str:
    def n(x: Any, fmt: str = ".2f") -> str:
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{f['victim']} at {f['factor']:.2f} of its speed; selected {f.get('selected')}",
        f"throughput samples/s: healthy {n(f['throughput_healthy'])}, slow unmitigated "
        f"{n(f['throughput_slow_unmitigated'])}, mitigated {n(f['throughput_mitigated'])}, "
        f"model best {n(f['throughput_model_best'])}",
        f"mitigated / unmitigated {n(f['mitigated_over_unmitigated'])}, mitigated / model best "
        f"{n(f['mitigated_over_model_best'])}",
        f"detect {n(f['detect_seconds'])} s, recover detect {n(f['recover_detect_seconds'])} s",
        f"false alarms {f['false_alarms']} over {f['healthy_seconds']:.0f} s healthy; samples "
        f"lost {f['samples_lost']}, repeated {f['samples_repeated']}",
    ]
    if "simulated" in f:
        lines.append(f"simulated: {json.dumps(f['simulated'])}")
    return "\n".join(lines)
