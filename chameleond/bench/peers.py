"""chameleond side by side with TorchFT: the same model, data, batch and kill -9, on one machine.

Both systems train examples/recipe.py's Hugging Face GPT-2 (built from the spec's `[model.arch]`,
no download) on its shuffled samples with its recipe, the same seed, global batch and micro-batch,
on the CPU with gloo, two devices:

* torchft: TorchFT 0.2, one replica group per data-parallel replica (one process each), a real
  Lighthouse, `ProcessGroupGloo`, its DDP and Optimizer wrappers, the data split across the
  groups with its `DistributedSampler` (chameleond/bench/peers_torchft.py), as released;
* torchft_patched: the same with the smallest fix to the all-reduce failure that otherwise ends
  the survivor (AssertionError in backward), so that TorchFT's recovery is measured too;
* torchft_patched_default_heartbeat: the same with the Lighthouse's default heartbeat timeout;
* chameleond: the same two devices as two data-parallel replicas (pp=1), the adaptive policy on
  the job's fixed global batch; chameleond_drop: the `drop` policy (min_global_batch = half the
  batch, TorchFT's way of going on); chameleond_pp2: one pipeline of two stages (every kill takes
  layers, so the job restores its newest checkpoint, written every --checkpoint-every steps).

Each run: a failure-free warm-up, kill -9 of the victim (replica group 1, worker w1) once step
--kill-step has committed, the same process started again --away seconds later, the end --after
seconds after that. Failure detection gets the same budget: the Lighthouse's heartbeat timeout is
chameleond's heartbeat lapse (3 s), and TorchFT also runs with its default (5 s). Each system also
runs failure-free, up to the steps its faulty runs reached, for `loss_vs_failure_free`. Every
figure comes from the systems' own logs (chameleond/bench/peers_figures.py says which); the
chart of samples in the model over time is written to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from chameleond.bench.peers_figures import Commit, Run, draw, figures
from chameleond.bench.peers_torchft import (
    Schedule,
    TorchftRun,
    recipe_module,
    run_torchft,
    sample_id,
)
from chameleond.redisurl import connect

JOB = "bench-peers"
HEARTBEAT_SECONDS = 3.0  # chameleond's heartbeat lapse (daemon default), TorchFT's timeout here
TORCHFT = ("torchft", "torchft_patched", "torchft_patched_default_heartbeat")
CHAMELEOND = ("chameleond", "chameleond_drop", "chameleond_pp2")
RUNS = (*TORCHFT, *CHAMELEOND)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kill-step", type=int, default=10, help="kill once this step committed")
    parser.add_argument("--away", type=float, default=5.0, help="seconds until the victim returns")
    parser.add_argument("--after", type=float, default=20.0, help="seconds trained after it")
    parser.add_argument("--runs", default=",".join(RUNS), help="which runs (comma-separated)")
    parser.add_argument("--no-failure-free", action="store_true", help="skip the reference runs")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="chameleond_pp2's")
    parser.add_argument("--out", type=Path, default=Path("chameleon-peers"), help="chart, logs")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")


def _spec_doc(workers: int, pp: int, min_batch: bool) -> dict[str, Any]:
    from chameleond.cli.up import build_spec_document
    from chameleond.core.spec import load_spec
    from chameleond.local.examples import find_example

    doc = build_spec_document(load_spec(find_example("recipe").spec), job=JOB, workers=workers,
                              pp=pp, bind_addresses=[], mtbf_prior_seconds=None)  # fmt: skip
    if min_batch:
        doc["training"]["min_global_batch"] = doc["training"]["global_batch"] // 2
    return doc


def run_chameleond(
    doc: dict[str, Any], run_dir: Path, when: Schedule, policy: str, checkpoint_every: int
) -> Run:
    """A local cluster of the recipe's workers; w{victim} killed and started again as `when`
    says. The commits come from the job's streams, their samples and losses from the workers'
    own per-step logs."""

    from chameleond.core.plan import plan_from_dict
    from chameleond.local.cluster import ClusterError, LocalCluster
    from chameleond.local.examples import find_example
    from chameleond.local.monitor import StreamMonitor

    run_dir.mkdir(parents=True)
    logs, spec = run_dir / "steps", run_dir / "spec.json"
    logs.mkdir()
    spec.write_text(json.dumps(doc))
    victim = f"w{when.victim}"
    args = ["--checkpoint-dir", str(run_dir / "checkpoints"), "--checkpoint-every",
            str(checkpoint_every)] if checkpoint_every else []  # fmt: skip
    run = Run([], victim=victim)
    cluster = LocalCluster(
        run_dir, job=JOB, workers=[w["id"] for w in doc["workers"]], spec_path=spec,
        policy=policy, worker_args=args, worker_command=find_example("recipe").worker_command(),
        env={"RECIPE_LOG": str(logs), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    with cluster:
        client = connect(cluster.redis_url, decode_responses=True)
        monitor = StreamMonitor(client, JOB)
        cluster.start_daemon()
        cluster.start_workers()
        deadline = time.monotonic() + when.timeout_seconds
        while True:
            monitor.poll(block_ms=100)
            cluster.check_daemon()
            done = monitor.last_commit.step if monitor.last_commit else -1
            now = time.time()
            if run.kill_at is None and when.kill_step is not None and done >= when.kill_step:
                run.kill_at = cluster.kill_worker(victim)
            back_at = run.kill_at + when.away_seconds if run.kill_at is not None else None
            if run.return_at is None and back_at is not None and now >= back_at:
                run.return_at = time.time()
                cluster.start_worker(victim)
            if when.end_step is not None and done + 1 >= when.end_step:
                break
            if run.return_at is not None and now >= run.return_at + when.after_seconds:
                break
            if monitor.state == "unrecoverable":
                raise ClusterError(f"{run_dir.name}: the job is unrecoverable")
            if time.monotonic() > deadline:
                raise ClusterError(f"{run_dir.name}: no end in {when.timeout_seconds} s")
        monitor.read_all()
        client.close()
    lines: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for path in logs.glob("*.jsonl"):
        for text in path.read_text().splitlines():
            e = json.loads(text)
            lines[(e["generation"], e["step"])].append(e)
    for c in monitor.commits:
        entries = lines.get((c.generation, c.step), [])
        if not entries:
            continue  # committed as the run was stopped: no worker logged it
        members = frozenset(plan_from_dict(monitor.plans[c.generation]).workers)
        ids = tuple(i for e in entries for i in e["sample_ids"])
        run.commits.append(Commit(c.step, c.at, entries[0]["step_samples"], ids,
                                  entries[0]["loss"], members))  # fmt: skip
    policies = [p["policy"] for g, p in sorted(monitor.plans.items()) if g > 1]
    run.notes.append(f"plans after the first: {', '.join(policies) or 'none'}")
    return run


def torchft_commits(got: TorchftRun, victim: int) -> Run:
    """TorchFT's committed steps from its replica groups' lines: a step commits in a quorum
    with the work of the groups that took part and whose should_commit() was true."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for x in got.lines:
        if x["committed"] and x["participating"]:
            groups[(x["quorum"], x["step"])].append(x)
    run = Run([], got.kill_at, got.return_at, victim=f"replica{victim}")
    for (_, step), xs in groups.items():
        count = sum(len(x["ids"]) for x in xs)
        run.commits.append(Commit(
            step, max(x["t"] for x in xs), count, tuple(i for x in xs for i in x["ids"]),
            sum(x["loss_sum"] for x in xs) / count, frozenset(f"replica{x['replica']}" for x in xs),
        ))  # fmt: skip
    refused = sum(1 for x in got.lines if not x["committed"])
    run.notes.append(f"iterations whose should_commit() was false: {refused}")
    run.notes += [f"crash: {c}" for c in got.crashes]
    return run


def measure(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    chosen = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(chosen) - set(RUNS))
    if unknown:
        raise ValueError(f"--runs: unknown {unknown}; known: {', '.join(RUNS)}")
    dp2, pp2 = _spec_doc(2, 1, False), _spec_doc(2, 2, False)
    arch = recipe_module().arch_of(dp2["model"]["arch"])
    B = dp2["training"]["global_batch"]
    spec_file = out / "spec-dp2.json"
    spec_file.write_text(json.dumps(dp2))
    beat = int(HEARTBEAT_SECONDS * 1000)

    def faulty(end_step: int | None = None, kill: bool = True) -> Schedule:
        return Schedule(1, args.kill_step if kill else None, args.away, args.after, end_step,
                        args.timeout)  # fmt: skip

    def one(name: str, when: Schedule) -> Run:
        d = out / name
        if name.startswith("torchft"):
            patched = name != "torchft" and not name.endswith("failure_free")
            hb = None if name.endswith("default_heartbeat") else beat
            return torchft_commits(run_torchft(spec_file, d, 2, when, patched=patched,
                                               heartbeat_timeout_ms=hb), when.victim)  # fmt: skip
        doc = {"chameleond_drop": _spec_doc(2, 1, True)}.get(name, pp2 if "pp2" in name else dp2)
        policy = "drop" if name == "chameleond_drop" else "adaptive"
        every = args.checkpoint_every if "pp2" in name else 0
        return run_chameleond(doc, d, when, policy, every)

    runs = {name: one(name, faulty()) for name in chosen}
    references: dict[str, Run] = {}
    if not args.no_failure_free:
        for family, members in (("torchft", TORCHFT), ("chameleond", CHAMELEOND[:2]),
                                ("chameleond_pp2", CHAMELEOND[2:])):  # fmt: skip
            reached = [max(c.step for c in runs[m].commits) + 1 for m in members if m in runs]
            if reached:
                ref = f"{family}_failure_free"
                references[family] = one(ref, faulty(max(reached), kill=False))

    def want(step: int) -> list[int]:
        return [sample_id(arch, step * B + k) for k in range(B)]

    systems: dict[str, Any] = {}
    for name, run in runs.items():
        family = (
            "torchft" if name in TORCHFT else "chameleond_pp2" if "pp2" in name else "chameleond"
        )
        systems[name] = figures(run, references.get(family), want)
    failure_free = {
        family: {k: v for k, v in figures(ref, None, want).items() if k in ("steps", "goodput",
                 "samples_trained", "final_loss")}
        for family, ref in references.items()
    }  # fmt: skip
    chart = out / "peers.png"
    title = f"recipe GPT-2, 2 devices, kill -9 at step {args.kill_step}, back {args.away:g} s later"
    draw({n: r for n, r in runs.items() if "pp2" not in n}, chart, title)
    return {
        "setup": {
            "model": {k: arch[k] for k in ("n_embd", "n_layer", "n_head", "seq_len", "vocab")},
            "global_batch": B,
            "micro_batch": dp2["training"]["micro_batch"],
            "kill_step": args.kill_step,
            "away_seconds": args.away,
            "after_seconds": args.after,
            "chameleond_heartbeat_timeout_seconds": HEARTBEAT_SECONDS,
            "torchft_heartbeat_timeout_ms": {
                "torchft": beat,
                "torchft_patched": beat,
                "torchft_patched_default_heartbeat": 5000,
            },
            "torchft_timeouts_seconds": {
                "timeout": 60,
                "quorum_timeout": 60,
                "join_timeout": 60,
                "quorum_tick": 0.1,
            },
        },
        "systems": systems,
        "failure_free": failure_free,
        "goodput_ratio": _ratios(systems),
        "chart": str(chart),
    }


def _ratios(systems: dict[str, Any]) -> dict[str, Any]:
    """chameleond (adaptive) goodput over each TorchFT run's, whole run and fault window."""
    mine = systems.get("chameleond")
    out: dict[str, Any] = {}
    for peer in TORCHFT:
        theirs = systems.get(peer)
        if mine is None or theirs is None:
            continue
        out[f"vs_{peer}"] = {
            k: mine["goodput"][k] / theirs["goodput"][k]
            if mine["goodput"][k] and theirs["goodput"][k]
            else None
            for k in ("whole", "fault_window")
        }
    return out


def run(args: argparse.Namespace) -> int:
    from chameleond.extras import MissingExtra, require
    from chameleond.local.cluster import ClusterError, Interrupted

    try:
        require("compare", "chameleonctl bench peers")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        args.out.mkdir(parents=True, exist_ok=True)
        for old in args.out.iterdir():
            if old.is_dir() and old.name.startswith(("torchft", "chameleond")):
                shutil.rmtree(old)
        result = measure(args, args.out)
    except (MissingExtra, ValueError) as e:
        print(f"chameleonctl bench peers: {e}", file=sys.stderr)
        return 2
    except (ClusterError, Interrupted, KeyboardInterrupt, TimeoutError, RuntimeError) as e:
        print(f"chameleonctl bench peers: {e}", file=sys.stderr)
        return 1
    (args.out / "peers.json").write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    s = result["setup"]
    print(f"recipe GPT-2 {s['model']}, B={s['global_batch']} b={s['micro_batch']}, 2 devices, "
          f"kill -9 at step {s['kill_step']}, back after {s['away_seconds']:g} s")  # fmt: skip

    def num(x: Any, f: str = ".2f") -> str:
        return "-" if x is None else format(x, f)

    print(f"{'run':36} {'resume s':>8} {'rejoin s':>8} {'goodput':>8} {'window':>8} {'lost':>5} "
          f"{'rep.':>5} {'disc.':>5} {'loss':>7} {'vs ff':>7}")  # fmt: skip
    for name, f in result["systems"].items():
        rates = f["goodput"]
        cells = [num(f["resume_seconds"]), num(f["rejoin_seconds"]), num(rates["whole"], ".1f"),
                 num(rates["fault_window"], ".1f"), f["samples_lost"], f["samples_repeated"],
                 f["samples_discarded"], num(f["final_loss"], ".4f"),
                 num(f["loss_vs_failure_free"], "+.3f")]  # fmt: skip
        widths = (8, 8, 8, 8, 5, 5, 5, 7, 7)
        print(f"{name:36} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
        for note in f["notes"]:
            print(f"    {note}")
    for family, f in result["failure_free"].items():
        rate = num(f["goodput"]["whole"], ".1f")
        print(f"{family} failure-free: {f['steps']} steps, goodput {rate} samples/s")
    for peer, r in result["goodput_ratio"].items():
        print(f"goodput chameleond / {peer[3:]}: whole {num(r['whole'])}, "
              f"fault window {num(r['fault_window'])}")  # fmt: skip
    print(f"chart: {result['chart']}")
