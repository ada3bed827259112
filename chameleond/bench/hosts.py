"""Faults across hosts: three hosts as network namespaces, an agent on each, faults between them.

Each host is a Linux network namespace with its own address (chameleond/local/netns.py): Redis and
chameleond run in the root namespace on the bridge's address, and `chameleon-agent` runs in each
host, starting that host's workers (the spec's `[[hosts]] name = "h[0-2]", devices = 2`: six
workers, two pipelines of three stages laid across the hosts so that no host holds every copy of a
stage). gloo runs between the hosts' addresses. The faults, one after another once the job trains:

* kill: kill -9 of one worker; its agent restarts it and it rejoins (the daemon takes it back into
  the plan, or keeps it on standby when the current plan is better without it: on a machine of
  two cores six workers may train no faster than four).
* host_loss: every process of one host (agent and workers) killed at once; the agent is started
  again, as systemd or SLURM would, and the host's workers rejoin.
* partition_heal: one host's link down for --partition-seconds, then up: its workers are fenced
  (the job goes on without them), must commit no step meanwhile, and rejoin after the heal.
* slow_link: one host's link limited to --slow-mbit (tc netem), then a worker of another host
  killed so that a new plan is built: the workers' link probes of that plan show the slow link in
  the inter-host figure the planner uses (waited for: within SLOW_LINK_WITHIN of the rate, on a
  link of the slowed host's).

Figures: `hosts` (namespaces used), `faults` (each kind with its count), `lost_events` (fault
entries the daemon never acknowledged, and faults of the run no decision answered),
`duplicate_applications` (a plan generation decided twice), `stale_commits` (step reports of a
generation older than the plan that excluded their worker, made after that plan was decided: a
fenced worker committing),
`agent_restarts` (workers an agent started again that were back in the job afterwards: in the
plan, or on standby where the daemon judged the plan better without them; both lists are given),
`max_resume_seconds` per kind (the fault to the first step committed on a newer plan), and for
slow_link the inter-host bandwidth the daemon planned with before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chameleond.bench.hosts_scene import Scene, spec_document, workers_of
from chameleond.local.cluster import ClusterError, Interrupted
from chameleond.local.netns import Hosts, unavailable

KINDS = ("kill", "host_loss", "partition_heal", "slow_link")
SLOW_LINK_WITHIN = 2.0  # a slowed link is measured within this factor of its rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup", type=int, default=6, help="steps before the first fault")
    parser.add_argument(
        "--partition-seconds", type=float, default=8.0, help="the partition's length (default 8)"
    )
    parser.add_argument(
        "--slow-mbit", type=float, default=40.0, help="the slowed link's rate (default 40 Mbit/s)"
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="faults to run, in order (default all)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="per fault, seconds")
    parser.add_argument("--logs", type=Path, help="keep the run's logs in this directory")


def run(args: argparse.Namespace) -> int:
    why = unavailable()
    if why is not None:
        print(f"chameleonctl bench hosts: network namespaces unavailable: {why}", file=sys.stderr)
        return 2
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        print(f"chameleonctl bench hosts: unknown kinds {unknown}", file=sys.stderr)
        return 2
    try:
        if args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            figures = measure(args.logs, kinds, args)
        else:
            with tempfile.TemporaryDirectory(prefix="chameleon-hosts-") as tmp:
                figures = measure(Path(tmp), kinds, args)
    except (ClusterError, Interrupted, TimeoutError) as e:
        print(f"chameleonctl bench hosts: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(text(figures))
    return 0


def measure(run_dir: Path, kinds: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Run the faults of `kinds` in order on three namespaced hosts; the figures."""
    with Hosts(["h0", "h1", "h2"]) as hosts, Scene(run_dir, hosts, spec_document()) as scene:
        scene.start()
        scene.wait_commits(args.warmup, args.timeout)
        faults: dict[str, int] = {}
        resume: dict[str, float | None] = {}
        extra: dict[str, Any] = {}
        for kind in kinds:
            took = FAULTS[kind](scene, args, extra)
            faults[kind] = faults.get(kind, 0) + 1
            prev = resume.get(kind)
            resume[kind] = took if prev is None or (took is not None and took > prev) else prev
        return {**scene.figures(), "faults": faults, "max_resume_seconds": resume, **extra}


def _kill(scene: Scene, args: argparse.Namespace, extra: dict[str, Any]) -> float | None:
    victim = "h1-0"
    since, gen = scene.kill_worker(victim)
    took = scene.wait_resumed(since, gen, args.timeout)
    scene.wait_rejoined([victim], args.timeout)
    return took


def _host_loss(scene: Scene, args: argparse.Namespace, extra: dict[str, Any]) -> float | None:
    since, gen = scene.kill_host("h2")
    took = scene.wait_resumed(since, gen, args.timeout)
    scene.start_agent("h2")  # as its supervisor (systemd, SLURM, Kubernetes) would
    scene.wait_rejoined(workers_of("h2"), args.timeout)
    return took


def _partition_heal(scene: Scene, args: argparse.Namespace, extra: dict[str, Any]) -> float | None:
    since, gen = scene.partition("h1")
    try:
        took = scene.wait_resumed(since, gen, args.timeout)
        time.sleep(max(0.0, args.partition_seconds - (time.time() - since)))
    finally:
        scene.hosts.heal("h1")
    scene.wait_rejoined(workers_of("h1"), args.timeout)
    return took


def _slow_link(scene: Scene, args: argparse.Namespace, extra: dict[str, Any]) -> float | None:
    before = scene.wait_link_measured(None, args.timeout)
    rate = args.slow_mbit * 1e6 / 8
    scene.hosts.slow_link("h0", rate_mbit=args.slow_mbit)
    try:
        since, gen = scene.kill_worker("h2-1")  # a new plan: its groups are built and probed
        took = scene.wait_resumed(since, gen, args.timeout)
        # The daemon plans with the slowed link once a probe through it is reported: within
        # twice its rate (a probe's own overheads), on a link of h0's.
        seen = scene.wait_link_measured(SLOW_LINK_WITHIN * rate, args.timeout, host="h0")
        scene.wait_rejoined(["h2-1"], args.timeout)
    finally:
        scene.hosts.restore_link("h0")
    extra["slow_link"] = {
        "rate_bytes_per_second": rate,
        "inter_host_bandwidth_before": before,
        "inter_host_bandwidth_after": seen,
    }
    return took


FAULTS: dict[str, Callable[[Scene, argparse.Namespace, dict[str, Any]], float | None]] = {
    "kill": _kill,
    "host_loss": _host_loss,
    "partition_heal": _partition_heal,
    "slow_link": _slow_link,
}


def text(f: dict[str, Any]) -> str:
    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}s"

    lines = [
        f"hosts {f['hosts']}  faults {f['faults']}",
        f"lost_events {f['lost_events']}  duplicate_applications {f['duplicate_applications']}  "
        f"stale_commits {f['stale_commits']}  agent_restarts {f['agent_restarts']}",
        "max_resume_seconds "
        + "  ".join(f"{k} {s(v)}" for k, v in f["max_resume_seconds"].items()),
    ]
    if "slow_link" in f:
        sl = f["slow_link"]
        lines.append(
            f"slow_link: rate {sl['rate_bytes_per_second'] / 1e6:.1f} MB/s, inter-host bandwidth "
            f"planned {_mb(sl['inter_host_bandwidth_before'])} -> "
            f"{_mb(sl['inter_host_bandwidth_after'])}"
        )
    return "\n".join(lines)


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.1f} MB/s"


__all__ = ["KINDS", "add_arguments", "measure", "run"]
