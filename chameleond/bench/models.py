"""`bench training`'s models: causal LMs nobody here wrote, trained under faults, exported, and the
memory a worker holds.

* models: examples/recipe.py with `family` = llama, qwen2, mistral (its sliding window half the
  sequence) and mixtral (a Mixture-of-Experts with its router's balancing loss in the objective),
  every one on padded variable-length batches, each run with the same two kill -9 as the recipe's
  fp32 run (a reroute, then a re-partition), against the same recipe in a plain torch loop;
  `loss_match` per class (target <= 1e-5).
* export_logits_match: the mixtral run's last checkpoint (written when training ends) through
  `chameleonctl export --hf`, loaded with `AutoModelForCausalLM.from_pretrained`: its logits
  against the checkpoint's own tensors in the library's layers on the same batch (target
  <= 1e-5).
* rss_ratio: a larger Llama started from a save_pretrained directory on four workers (one
  pipeline of four stages, so each holds a quarter of the layers and reads only their tensors):
  each worker's peak RSS over what it must hold: its layers' parameters, gradients and optimizer
  state and the activations of the micro-batches in flight on its stage (as the workers profiled
  them), plus a runtime allowance measured here, the peak RSS of a process that imports the
  example (torch, transformers, datasets, the library) and builds a gloo group of one (target
  <= 1.5). A worker that built the whole model would hold every layer's parameters besides.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from chameleond.core.plan import Plan

MODEL_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# The rss run's Llama: about 110 M parameters, so that a quarter of its training state dwarfs
# the runtime, and the whole model would not.
RSS_ARCH = {
    "family": "llama",
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "vocab": 8192,
    "seq_len": 32,
    "samples": 400,
}
RSS_WORKERS = ["w0", "w1", "w2", "w3"]


def models(
    run: Callable[[str, dict[str, Any]], dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """{class name: the run's comparison with the plain loop}, `run(name, arch)` being one
    library run under the bench's faults compared with the plain loop (bench.training)."""
    out: dict[str, dict[str, Any]] = {}
    for family, cls in MODEL_FAMILIES.items():
        got = run(family, {"family": family, "padded": True})
        out[cls] = {"loss_match": got["loss_abs"], **got}
    return out


def export_logits_match(example_script: Path, arch: Mapping[str, Any], checkpoints: Path,
                        out: Path) -> float:  # fmt: skip
    """Max |logit difference| between `chameleonctl export --hf`'s directory, loaded with
    from_pretrained, and the newest complete checkpoint's tensors in the library's layers."""
    subprocess.run(  # noqa: S603 - this interpreter's chameleonctl, no shell
        [sys.executable, "-m", "chameleond.cli.ctl", "export", "--checkpoint", str(checkpoints),
         "--hf", str(out)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    probe = f"""
        import json, sys, torch, transformers
        sys.path.insert(0, {str(example_script.parent)!r})
        import recipe
        from chameleond.worker import hf
        from pathlib import Path
        from chameleond.cli.export import complete_step, model_tensors
        arch = recipe.arch_of(json.loads({json.dumps(dict(arch))!r}))
        _, files = complete_step(Path({str(checkpoints)!r}))
        _, tensors = model_tensors(files)
        layers = hf.split_causal_lm(recipe.model_of(arch))
        for i, module in enumerate(layers.modules):
            names = layers.names[i]
            for local, p in module.named_parameters(remove_duplicate=False):
                with torch.no_grad():
                    p.copy_(tensors[names[local]])
        rows = [recipe.sample(i, arch) for i in range(4)]
        batch = recipe.collate(rows)
        x = hf.causal_lm_inputs(batch)
        with torch.no_grad():
            for module in layers.modules:
                x = module(x)
            ours = x["logits"] if isinstance(x, dict) else x
            model = transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})
            theirs = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits
        real = batch["attention_mask"].bool()
        print(float((ours - theirs)[real].abs().max()))
    """
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-c", textwrap.dedent(probe)],
        check=True, timeout=300, capture_output=True, text=True,
    )  # fmt: skip
    return float(done.stdout.strip().splitlines()[-1])


def save_pretrained(example_script: Path, arch: Mapping[str, Any], out: Path) -> None:
    """The seeded model of `arch` as a save_pretrained directory (the rss run starts from it)."""
    code = f"""
        import json, sys
        sys.path.insert(0, {str(example_script.parent)!r})
        import recipe
        recipe.model_of(recipe.arch_of(json.loads({json.dumps(dict(arch))!r}))).save_pretrained(
            {str(out)!r})
    """
    subprocess.run(  # noqa: S603
        [sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=600
    )


def runtime_allowance(example_script: Path) -> int:
    """The peak RSS, bytes, of a process that imports the example and joins a gloo group of
    one: what every worker holds before it holds any layer."""
    code = f"""
        import os, resource, sys, tempfile
        sys.path.insert(0, {str(example_script.parent)!r})
        import recipe, redis, torch, torch.distributed as dist
        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        dist.all_reduce(torch.zeros(1))
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-c", textwrap.dedent(code)],
        check=True, timeout=120, capture_output=True, text=True,
    )  # fmt: skip
    return int(done.stdout.strip().splitlines()[-1])


def held_bytes(profile: Mapping[str, Any], layers: list[int], in_flight: int) -> int:
    """What a worker holding `layers` must hold to train them: parameters, gradients (the
    trainable parameters' size), optimizer state, and the activations of `in_flight`
    micro-batches, from the workers' profile."""
    total = 0
    for j in layers:
        layer = profile["layers"][j]
        total += 2 * int(layer["param_bytes"]) + int(layer["optimizer_bytes"])
        total += in_flight * int(layer["activation_bytes"])
    return total


def rss_ratio(
    lines: Mapping[str, list[dict[str, Any]]],
    plan: Plan,
    profiles: Mapping[str, Mapping[str, Any]],
    allowance: int,
) -> dict[str, Any]:
    """Per worker of the plan's one pipeline: peak RSS, what it must hold, and their ratio; the
    largest ratio."""
    stages = plan.pipelines[0].stages
    per_worker: dict[str, Any] = {}
    for s, stage in enumerate(stages):
        worker = stage.worker
        if worker not in lines or worker not in profiles:
            continue
        peak = max(int(e["max_rss"]) for e in lines[worker])
        need = held_bytes(profiles[worker], list(stage.layers), len(stages) - s) + allowance
        per_worker[worker] = {"peak_rss": peak, "expected": need, "ratio": peak / need}
    worst = max((w["ratio"] for w in per_worker.values()), default=float("nan"))
    # What a worker that built the whole model would hold besides: every layer's parameters.
    some: Mapping[str, Any] = next(iter(profiles.values()), {"layers": []})
    whole = sum(int(layer["param_bytes"]) for layer in some["layers"])
    return {
        "rss_ratio": worst,
        "allowance_bytes": allowance,
        "whole_model_param_bytes": whole,
        "workers": per_worker,
    }


def profiles_of(events: list[tuple[str, Mapping[str, str]]]) -> dict[str, dict[str, Any]]:
    """worker -> the data of its last profile event."""
    out: dict[str, dict[str, Any]] = {}
    for _, f in events:
        if f.get("type") == "profile":
            out[f["worker"]] = json.loads(f["data"])
    return out
