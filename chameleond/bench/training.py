"""The worker library's training loop against the same recipe in a plain torch loop, under faults.

One invocation, runs one after another on a local cluster (a real daemon, real Redis, seven worker
processes on real gloo), all training examples/recipe.py (a Hugging Face GPT-2 with AdamW over
named param groups, warm-up + cosine, global gradient clipping, shuffled data), each with two
kill -9: --reroute-victim (a replica of its stage survives: the job reroutes) and --dynamic-victim
(no replica: the job re-partitions). The same recipe runs in one process as its team would write
it (`recipe.py --plain`: the whole model, one AdamW, torch.autocast, GradScaler,
clip_grad_norm_), on the same samples in the same order. The workers' own `on_step` logs (one
JSON line per committed step and worker) give every figure:

* loss_match_fp32: max |loss - plain loss| over the steps (target <= 1e-5);
* grad_norm_match: max |grad norm - plain| / plain (target <= 1e-5);
* loss_match_bf16: the same run in bf16 against the plain loop in bf16, relative (<= 2e-2);
* samples_lost / samples_repeated: what each committed step trained against the plain loop's
  samples of that step: the count and id sum of the samples its first stages read, which every
  worker's line carries from the step's commit vote (a worker killed right after a commit leaves
  no line of its own), and, where every first-stage worker of the step logged its share, the
  ids themselves; over the fp32 run and a streamed-dataset run (a
  Hugging Face IterableDataset) in which --restore-step kills every worker that holds layer 0
  (w0, w2, w4): the job restores the newest checkpoint and trains the steps after it again, the
  stream read again from the restored position (target 0 / 0). A step trained again after a
  restore counts once: the model's history holds the last generation that committed it;
* lora_synced_bytes_ratio: a LoRA run's gradient bytes all-reduced per step over the bytes of the
  adapter tensors in the synced layers (target <= 1.1), with what syncing the whole layers would
  cost and the checkpoint bytes of a step beside the fp32 run's;
* prefetch_overlap: the smallest share, over the workers that read data and every run, of their
  data preparation hidden behind compute (target >= 0.9); each run's own smallest beside it;
* models, export_logits_match, rss_ratio: Llama, Qwen2, Mistral and a Mixture-of-Experts
  (Mixtral) on padded variable-length batches under the same two faults, the Mixtral run's last
  checkpoint exported to a Hugging Face directory, and each worker's peak memory on a model split
  four ways (chameleond.bench.models).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from chameleond.bench import models
from chameleond.cli.up import build_spec_document
from chameleond.core.plan import plan_from_dict
from chameleond.core.spec import SpecError, load_spec, parse_spec
from chameleond.local.cluster import ClusterError, Interrupted
from chameleond.local.examples import ExampleError, FoundExample, find_example
from chameleond.local.faults import Fault
from chameleond.local.monitor import StreamMonitor
from chameleond.local.progress import ProgressView
from chameleond.local.run import LocalRun, RunOptions

JOB = "bench-training"
Lines = dict[str, list[dict[str, Any]]]  # worker -> its on_step lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=24, help="steps per run")
    parser.add_argument("--reroute-victim", default="w0", help="killed at --reroute-step")
    parser.add_argument("--reroute-step", type=int, default=6)
    parser.add_argument("--dynamic-victim", default="w5", help="killed at --dynamic-step")
    parser.add_argument("--dynamic-step", type=int, default=14)
    parser.add_argument(
        "--restore-step", type=int, default=12, help="the streamed run loses layer 0 here"
    )
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value  # the workers inherit it from the cluster
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _library(
    example: FoundExample,
    doc: dict[str, Any],
    run_dir: Path,
    args: argparse.Namespace,
    faults: tuple[Fault, ...],
) -> tuple[StreamMonitor, Lines]:
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "steps"
    logs.mkdir()
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(doc))
    spec = parse_spec(doc)
    opts = RunOptions(
        job=JOB,
        workers=[w.id for w in spec.workers],
        steps=args.steps,
        spec_path=spec_path,
        run_dir=run_dir,
        global_batch=spec.training.global_batch,
        faults=faults,
        timeout_seconds=args.timeout,
        checkpoint_every=args.checkpoint_every,
        worker_command=example.worker_command(),
    )
    with _env("RECIPE_LOG", str(logs)):
        result = LocalRun(opts, ProgressView(io.StringIO())).execute()
    if not result.completed:
        raise ClusterError(f"{run_dir.name}: {result.reason}; logs in {run_dir / 'logs'}")
    lines = {
        p.stem: [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(logs.glob("*.jsonl"))
    }
    return result.monitor, lines


def _trained(mon: StreamMonitor, lines: Lines) -> dict[int, list[int]]:
    """step -> the global micro-batches the plan that committed it trains."""
    from chameleond.worker._samples import trained_micro_batches

    out: dict[int, list[int]] = {}
    for entries in lines.values():
        for e in entries:
            plan = plan_from_dict(mon.plans[e["generation"]])
            out[e["step"]] = trained_micro_batches(plan)
    return out


def _plain(
    example: FoundExample, doc: dict[str, Any], run_dir: Path, steps: int, trained: Any
) -> dict[str, Any]:
    """The recipe in a plain torch loop, in its own process (one torch thread, as the workers)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec_path, out, thinned = run_dir / "spec.json", run_dir / "plain.json", run_dir / "t.json"
    spec_path.write_text(json.dumps(doc))
    thinned.write_text(json.dumps(trained))
    subprocess.run(  # noqa: S603 - this interpreter and the example script, no shell
        [*example.worker_command(), "--plain", "--spec", str(spec_path), "--steps", str(steps),
         "--out", str(out), "--trained", str(thinned)],
        check=True, timeout=600,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def compare(lines: Lines, ref: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """The library's committed steps 0..steps-1 (every worker's on_step lines) against the plain
    loop's: the largest absolute and relative loss differences and relative grad norm
    difference over every line of a step (in every generation that committed it); the samples
    the plain loop trained that the step, as the model's history holds it (the last generation
    that committed it: a restore trains the steps after its checkpoint again), did not train
    (lost) and those it trained beyond them (repeated)."""
    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for entries in lines.values():
        for e in entries:
            by_step.setdefault(e["step"], {}).setdefault(e["generation"], []).append(e)
    loss_abs = loss_rel = norm_rel = 0.0
    lost = repeated = checked = 0
    for s in range(steps):
        want = collections.Counter(ref["ids"][s])
        generations = by_step.get(s, {})
        if not generations:
            lost += sum(want.values())
            continue
        history = generations[max(generations)]
        count = {e["step_samples"] for e in history}
        id_sum = {e["step_sample_id_sum"] for e in history}
        if len(count) != 1 or len(id_sum) != 1:
            raise ValueError(f"step {s}: workers disagree on what it trained: {count} {id_sum}")
        n, total = count.pop(), id_sum.pop()
        lost += max(0, sum(want.values()) - n)
        repeated += max(0, n - sum(want.values()))
        if n == sum(want.values()) and total != sum(want.elements()):
            lost, repeated = lost + 1, repeated + 1  # as many, not the same ones
        got = collections.Counter(i for e in history for i in e["sample_ids"])
        if sum(got.values()) == n:  # every first-stage worker logged its share: the ids too
            checked += 1
            lost += sum((want - got).values()) if got != want else 0
            repeated += sum((got - want).values()) if got != want else 0
        for gen_lines in generations.values():
            for e in gen_lines:
                diff = abs(e["loss"] - ref["loss"][s])
                loss_abs = max(loss_abs, diff)
                loss_rel = max(loss_rel, diff / abs(ref["loss"][s]))
                if not e["overflow"] and ref["grad_norm"][s] > 0:
                    norm_rel = max(norm_rel, abs(e["grad_norm"] / ref["grad_norm"][s] - 1))
    return {
        "loss_abs": loss_abs,
        "loss_rel": loss_rel,
        "grad_norm_rel": norm_rel,
        "samples_lost": lost,
        "samples_repeated": repeated,
        "steps_committed": sum(1 for s in range(steps) if s in by_step),
        "steps_ids_checked": checked,
    }


def _layer_bytes(doc: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """Per layer of the recipe's split model: (trainable bytes, all parameter bytes)."""
    from chameleond.worker.hf import split_causal_lm

    sys.path.insert(0, str(find_example("recipe").script.parent))
    import recipe

    layers = split_causal_lm(recipe.model_of(recipe.arch_of(doc["model"]["arch"]))).modules
    trainable = [sum(p.nbytes for p in m.parameters() if p.requires_grad) for m in layers]
    return trainable, [sum(p.nbytes for p in m.parameters()) for m in layers]


def synced_bytes(mon: StreamMonitor, lines: Lines, layer_bytes: list[int]) -> tuple[int, int]:
    """(bytes the workers all-reduced, the bytes of the layers they synced) over every line:
    a worker syncs the layers of its plan's sync groups, once per group."""
    done = expected = 0
    for worker, entries in lines.items():
        for e in entries:
            plan = plan_from_dict(mon.plans[e["generation"]])
            for group in plan.sync_groups:
                if worker in group.workers:
                    expected += sum(layer_bytes[j] for j in group.layers)
            done += e["synced_bytes"]
    return done, expected


def checkpoint_bytes(mon: StreamMonitor) -> int:
    """The bytes of the newest step every layer of which a checkpoint holds."""
    per_step: dict[int, int] = collections.defaultdict(int)
    for _, f in mon.events:
        if f.get("type") == "checkpoint":
            per_step[int(f["step"])] += int(f["bytes"])
    return per_step[max(per_step)] if per_step else 0


def measure(args: argparse.Namespace, example: FoundExample, tmp: Path) -> dict[str, Any]:
    base = load_spec(example.spec)
    doc = build_spec_document(base, job=JOB, workers=None, pp=None, bind_addresses=[],
                              mtbf_prior_seconds=None)  # fmt: skip
    faults = (
        Fault("kill", args.reroute_victim, at_step=args.reroute_step),
        Fault("kill", args.dynamic_victim, at_step=args.dynamic_step),
    )
    restore = tuple(Fault("kill", w, at_step=args.restore_step) for w in ("w0", "w2", "w4"))

    def variant(**arch: Any) -> dict[str, Any]:
        d = json.loads(json.dumps(doc))
        d["model"]["arch"].update(arch)
        _blocks(d)
        return d

    runs: dict[str, Any] = {}
    figures: dict[str, Any] = {}
    overlaps: list[float] = []
    lost = repeated = 0
    for name, d, kills in (
        ("fp32", variant(), faults),
        ("bf16", variant(precision="bf16"), faults),
        ("stream", variant(stream=True), restore),
        ("lora", variant(lora=True), faults),
    ):
        mon, lines = _library(example, d, tmp / name, args, kills)
        ref = _plain(example, d, tmp / name, args.steps, _trained(mon, lines))
        got = compare(lines, ref, args.steps)
        got["policies"] = [p["policy"] for g, p in sorted(mon.plans.items()) if g > 1]
        got["checkpoint_bytes"] = checkpoint_bytes(mon)
        run_overlaps = [
            e["data_overlap"]
            for entries in lines.values()
            for e in entries[-1:]
            if e["data_overlap"] is not None
        ]
        got["prefetch_overlap"] = min(run_overlaps) if run_overlaps else None
        runs[name] = got
        overlaps += run_overlaps
        if name in ("fp32", "stream"):
            lost += got["samples_lost"]
            repeated += got["samples_repeated"]
        if name == "lora":
            adapter, whole = _layer_bytes(d)
            done, expected = synced_bytes(mon, lines, adapter)
            _, full = synced_bytes(mon, lines, whole)
            figures["lora_synced_bytes_ratio"] = done / expected
            figures["lora_whole_layers_ratio"] = full / expected

    def family_run(name: str, arch: dict[str, Any]) -> dict[str, Any]:
        d = variant(**arch)
        mon, lines = _library(example, d, tmp / name, args, faults)
        got = compare(lines, _plain(example, d, tmp / name, args.steps, _trained(mon, lines)),
                      args.steps)  # fmt: skip
        got["policies"] = [p["policy"] for g, p in sorted(mon.plans.items()) if g > 1]
        return got

    figures["models"] = models.models(family_run)
    mixtral = variant(family="mixtral", padded=True)["model"]["arch"]
    figures["export_logits_match"] = models.export_logits_match(
        example.script, mixtral, tmp / "mixtral" / "checkpoints", tmp / "export"
    )
    figures.update(_rss(args, example, base, tmp))
    figures.update(
        loss_match_fp32=runs["fp32"]["loss_abs"],
        loss_match_bf16=runs["bf16"]["loss_rel"],
        grad_norm_match=runs["fp32"]["grad_norm_rel"],
        samples_lost=lost,
        samples_repeated=repeated,
        prefetch_overlap=min(overlaps) if overlaps else None,
    )
    return {**figures, "steps": args.steps,
            "faults": [f"kill:{f.worker}@{f.when}" for f in faults],
            "stream_faults": [f"kill:{f.worker}@{f.when}" for f in restore],
            "runs": runs}  # fmt: skip


def _blocks(doc: dict[str, Any]) -> None:
    """The spec's rough per-layer figures for the arch's number of blocks: the embeddings, one
    entry per block, the head."""
    layers = doc["model"]["layers"]
    blocks = int(doc["model"]["arch"].get("n_layer", len(layers) - 2))
    doc["model"]["layers"] = [layers[0], *[layers[1]] * blocks, layers[-1]]


def _rss(args: argparse.Namespace, example: FoundExample, base: Any, tmp: Path) -> dict[str, Any]:
    """rss_ratio's run (chameleond.bench.models): a larger Llama from a save_pretrained directory
    on one pipeline of four workers, a few steps, no fault."""
    pretrained = tmp / "rss-pretrained"
    arch = {**models.RSS_ARCH, "pretrained": str(pretrained)}
    models.save_pretrained(example.script, models.RSS_ARCH, pretrained)
    doc = build_spec_document(base, job=JOB, workers=len(models.RSS_WORKERS),
                              pp=len(models.RSS_WORKERS), bind_addresses=[],
                              mtbf_prior_seconds=None)  # fmt: skip
    doc["model"]["arch"].update(arch)
    _blocks(doc)
    steps = argparse.Namespace(**{**vars(args), "steps": 3, "checkpoint_every": 0})
    mon, lines = _library(example, doc, tmp / "rss", steps, ())
    plan = plan_from_dict(mon.plans[max(mon.plans)])
    got = models.rss_ratio(
        lines, plan, models.profiles_of(mon.events), models.runtime_allowance(example.script)
    )
    return {"rss_ratio": got.pop("rss_ratio"), "rss": got}


def run(args: argparse.Namespace) -> int:
    try:
        example = find_example("recipe")
        with tempfile.TemporaryDirectory(prefix="chameleon-bench-training-") as d:
            out = measure(args, example, Path(d))
    except (ExampleError, SpecError) as e:
        print(f"chameleonctl bench training: {e}", file=sys.stderr)
        return 2
    except (
        ClusterError,
        Interrupted,
        KeyboardInterrupt,
        subprocess.TimeoutExpired,
        subprocess.CalledProcessError,
    ) as e:
        print(f"chameleonctl bench training: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(out)
    return 0


def _print(out: dict[str, Any]) -> None:
    runs = out["runs"]
    print(f"examples/recipe.py, {out['steps']} steps, {', '.join(out['faults'])}, CPU")
    for name, r in runs.items():
        print(
            f"  {name}: plans {', '.join(r['policies'])}; loss max abs {r['loss_abs']:.3g}, "
            f"rel {r['loss_rel']:.3g}; grad norm rel {r['grad_norm_rel']:.3g}; samples lost "
            f"{r['samples_lost']}, repeated {r['samples_repeated']}; checkpoint "
            f"{r['checkpoint_bytes']} B; prefetch overlap {r['prefetch_overlap']}"
        )
    print(f"  loss_match_fp32: {out['loss_match_fp32']:.3g} (target <= 1e-5)")
    print(f"  grad_norm_match: {out['grad_norm_match']:.3g} (target <= 1e-5)")
    print(f"  loss_match_bf16: {out['loss_match_bf16']:.3g} relative (target <= 2e-2)")
    print(
        f"  samples_lost {out['samples_lost']}, samples_repeated {out['samples_repeated']} "
        "(fp32 and streamed runs; target 0 / 0)"
    )
    print(
        f"  lora_synced_bytes_ratio: {out['lora_synced_bytes_ratio']:.3f} (target <= 1.1); "
        f"syncing the whole layers: {out['lora_whole_layers_ratio']:.1f}x the adapters"
    )
    print(f"  prefetch_overlap: {out['prefetch_overlap']} (target >= 0.9)")
    for cls, r in out["models"].items():
        print(
            f"  {cls} (padded, {', '.join(r['policies'])}): loss_match {r['loss_match']:.3g} "
            f"(target <= 1e-5); samples lost {r['samples_lost']}, repeated "
            f"{r['samples_repeated']}"
        )
    print(f"  export_logits_match: {out['export_logits_match']:.3g} (target <= 1e-5)")
    print(
        f"  rss_ratio: {out['rss_ratio']:.3f} (target <= 1.5), runtime allowance "
        f"{out['rss']['allowance_bytes'] / 2**20:.0f} MiB; the whole model's parameters "
        f"{out['rss']['whole_model_param_bytes'] / 2**20:.0f} MiB"
    )
