"""A training recipe as teams write it, under chameleond: a Hugging Face GPT-2 (built from a config,
random weights, no download), AdamW with named param groups (no weight decay on biases and norms),
linear warm-up then cosine decay, global gradient clipping, shuffled data, mixed precision,
optionally LoRA adapters (peft) on a frozen base model or a streaming dataset, and a per-step
callback that a trainer would point at TensorBoard or W&B (here: one JSON line per step).

    python examples/recipe.py --job J --worker-id w0       # one worker (chameleon-worker's flags)
    python examples/recipe.py --plain --spec SPEC --steps N --out losses.json [--device cuda:0]
                                                           # the same recipe in a plain torch loop

The job's spec gives the model and the recipe in `[model.arch]` (keys and defaults: `ARCH`). With
RECIPE_LOG=DIR each worker appends its committed steps to DIR/<worker>.jsonl (`on_step`).

`--plain` is this recipe without chameleond, as its team would write it: the whole model in one
process, one AdamW over the model's named parameters, `torch.autocast` and `torch.amp.GradScaler`,
`clip_grad_norm_`, the samples in the order the library's shuffle gives them
(`chameleond.worker.permutation`, one permutation of the dataset per epoch from the seed).
`chameleonctl bench training` compares the two step for step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from chameleond.worker import Evaluation, Job, StepInfo, Training, default_collate, hf, run

# [model.arch] keys and their defaults.
ARCH: dict[str, Any] = {
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 2,
    "seq_len": 16,
    "vocab": 128,
    "seed": 0,
    "lr": 3e-3,
    "weight_decay": 0.1,
    "warmup": 4,  # steps of linear warm-up
    "total_steps": 200,  # the cosine reaches 10% of lr here
    "max_grad_norm": 0.5,
    "precision": "fp32",
    "loss_scale": 65536.0,  # fp16: the initial loss scale
    "shuffle": True,
    "samples": 600,  # dataset size (an epoch)
    "stream": False,  # a streaming datasets.IterableDataset instead of a map-style one
    "hf_datasets": True,  # the data as a Hugging Face `datasets` dataset; false: a list of samples
    "lora": False,  # LoRA adapters (r=4) on the attention and MLP projections, base frozen
    "eval_every": 0,  # a held-out loss every N steps (0: none)
    "eval_samples": 16,  # held-out samples (ids past the training set's)
    # The model family, built from a config: gpt2, llama, qwen2, mistral (its sliding window half
    # the sequence) or mixtral (a Mixture-of-Experts: 4 experts, 2 per token, its router's
    # balancing loss in the objective).
    "family": "gpt2",
    "padded": False,  # variable-length samples, each micro-batch padded to its longest (a mask)
    # A save_pretrained directory to start from (each worker reads only its layers' tensors);
    # "": the model built from the config and the seed.
    "pretrained": "",
    "intermediate": 0,  # the MLP's width (0: 4 x n_embd; 2 x for an expert)
    "router_aux_loss_coef": 0.02,  # mixtral: the balancing loss's weight in the objective
    "optimizer": "adamw",  # or "sgd" (plain, no state)
}
FAMILIES = ("gpt2", "llama", "qwen2", "mistral", "mixtral")


def arch_of(table: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(table) - set(ARCH))
    if unknown:
        raise ValueError(f"model.arch: unknown keys {unknown}; known: {sorted(ARCH)}")
    arch = {**ARCH, **table}
    if arch["family"] not in FAMILIES:
        raise ValueError(f"model.arch.family {arch['family']!r}: one of {', '.join(FAMILIES)}")
    return arch


def config_of(arch: Mapping[str, Any]) -> Any:
    """The family's config at the arch's sizes, dropout off (a rerouted micro-batch computes on
    another worker exactly what it computes on its own)."""
    d, family = int(arch["n_embd"]), arch["family"]
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=arch["vocab"], n_positions=arch["seq_len"], n_embd=d,
            n_layer=arch["n_layer"], n_head=arch["n_head"], resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    moe = family == "mixtral"
    common: dict[str, Any] = dict(
        vocab_size=arch["vocab"], hidden_size=d, num_hidden_layers=arch["n_layer"],
        num_attention_heads=arch["n_head"], num_key_value_heads=arch["n_head"],
        intermediate_size=int(arch["intermediate"]) or (2 if moe else 4) * d,
        max_position_embeddings=arch["seq_len"], bos_token_id=0, eos_token_id=0,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=int(arch["seq_len"]) // 2)
    return transformers.MixtralConfig(
        **common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=float(arch["router_aux_loss_coef"]),
    )  # fmt: skip


def model_of(arch: Mapping[str, Any]) -> torch.nn.Module:
    """The same initial model on every worker and in the plain loop: seeded (or read from the
    `pretrained` directory), dropout off."""
    if arch["pretrained"]:
        return transformers.AutoModelForCausalLM.from_pretrained(
            arch["pretrained"], attn_implementation="sdpa"
        )
    torch.manual_seed(arch["seed"])
    model = transformers.AutoModelForCausalLM.from_config(
        config_of(arch), attn_implementation="sdpa"
    )
    if arch["lora"]:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)
        model = get_peft_model(model, lora).base_model.model  # the LM with adapters inside
    return model


def sample(i: int, arch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Sample i: a token sequence with a pattern to learn (a start and a stride drawn from i);
    `padded`: of a length drawn from i too, between half the sequence and all of it."""
    g = torch.Generator().manual_seed(int(arch["seed"]) * 1_000_003 + i)
    start = int(torch.randint(0, arch["vocab"], (1,), generator=g))
    n = int(arch["seq_len"])
    if arch["padded"]:
        n = n // 2 + int(torch.randint(0, n - n // 2 + 1, (1,), generator=g))
    ids = (start + torch.arange(n) * (1 + i % 5)) % arch["vocab"]
    return {"input_ids": ids, "labels": ids.clone()}


def collate(rows: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The micro-batch padded on the right to its longest sample: pad ids 0, an attention mask,
    labels -100 at the pads (no loss there)."""
    n = max(int(r["input_ids"].shape[0]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), hf.IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for k, r in enumerate(rows):
        m = int(r["input_ids"].shape[0])
        ids[k, :m], labels[k, :m], mask[k, :m] = r["input_ids"], r["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def dataset(arch: Mapping[str, Any]) -> Any:
    """The data as a Hugging Face `datasets` dataset, map-style or a stream; or, without
    `hf_datasets`, as a plain list of samples (a torch map-style dataset)."""
    n = int(arch["samples"])
    if not arch["hf_datasets"]:
        if arch["stream"]:
            raise ValueError("model.arch: stream = true needs hf_datasets = true")
        return [sample(i, arch) for i in range(n)]
    import datasets

    if arch["stream"]:

        def gen() -> Iterator[dict[str, Any]]:
            for i in range(n):
                yield {k: v.tolist() for k, v in sample(i, arch).items()}

        return datasets.IterableDataset.from_generator(gen).with_format("torch")
    rows = [sample(i, arch) for i in range(n)]
    table = {k: [r[k].tolist() for r in rows] for k in ("input_ids", "labels")}
    return datasets.Dataset.from_dict(table).with_format("torch")


def held_out(arch: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Samples the training set does not hold: the ids after its last."""
    n = int(arch["samples"])
    return [sample(n + i, arch) for i in range(int(arch["eval_samples"]))]


def param_groups(named: list[tuple[str, torch.nn.Parameter]], decay: float) -> list[dict[str, Any]]:
    """No weight decay on biases and norms: the named groups of every LLM recipe."""

    def no_decay(name: str) -> bool:
        return name.endswith(".bias") or ".ln_" in name or "ln_f" in name or "norm" in name

    groups = [
        {"params": [(n, p) for n, p in named if not no_decay(n)], "weight_decay": decay},
        {"params": [(n, p) for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]
    # The optimizer is built per layer, and a layer may have no parameter of a group (the
    # embeddings have no bias): torch refuses an empty named group.
    return [g for g in groups if g["params"]]


def optimizer_of(arch: Mapping[str, Any]) -> Any:
    def make(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        if arch["optimizer"] == "sgd":
            return torch.optim.SGD(named, lr=arch["lr"])
        # On a GPU, the fused AdamW: one kernel per step, as GPU recipes use it.
        fused = bool(named) and named[0][1].is_cuda
        groups = param_groups(named, arch["weight_decay"])
        return torch.optim.AdamW(groups, lr=arch["lr"], fused=fused or None)

    return make


def schedule_of(arch: Mapping[str, Any]) -> Any:
    warmup, total = int(arch["warmup"]), int(arch["total_steps"])

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)


def log_step(info: StepInfo) -> None:
    """The trainer's callback: one JSON line per committed step and worker."""
    where = os.environ.get("RECIPE_LOG")
    if not where:
        return
    line = {
        "step": info.step,
        "generation": info.generation,
        "rank": info.rank,
        "loss": info.loss,
        "grad_norm": info.grad_norm,
        "lr": info.learning_rate,
        "samples": info.samples,
        "skipped": info.skipped_samples,
        "tokens": info.tokens,
        "overflow": info.overflow,
        "loss_scale": info.loss_scale,
        "synced_bytes": info.synced_bytes,
        "sample_ids": list(info.sample_ids),
        "step_samples": info.step_samples,
        "step_sample_id_sum": info.step_sample_id_sum,
        "data_overlap": info.data_overlap,
        "eval_loss": info.eval_loss,
        # This process's peak resident memory so far, bytes (Linux gives KiB).
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    with open(Path(where) / f"{info.worker}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def layers_of(arch: Mapping[str, Any]) -> Any:
    """The model as the library's layers: from the `pretrained` directory each worker reads only
    the tensors of the layers it holds (the others stay on the meta device); otherwise every
    worker builds the seeded model and splits it."""
    if arch["pretrained"]:
        return hf.pretrained_causal_lm(arch["pretrained"])
    return hf.split_causal_lm(model_of(arch))


def limit_memory() -> None:
    """With RECIPE_DATA_LIMIT=BYTES, this process may allocate at most BYTES more from here on
    (RLIMIT_DATA over its data size now: its imports and its dataset): a host too small for the
    model."""
    extra = os.environ.get("RECIPE_DATA_LIMIT")
    if extra:
        status = Path("/proc/self/status").read_text()
        data_kib = next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmData:")
        )
        limit = data_kib * 1024 + int(extra)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        threading.stack_size(1 << 20)  # the library's threads: their stacks count as data


def training(job: Job) -> Training:
    arch = arch_of(job.arch)
    data = dataset(arch)  # Arrow reserves its address space here: before the limit
    limit_memory()  # from here on: the model, the worker's layers, its runtime, its training
    layers = layers_of(arch)
    return Training(
        model=layers,
        loss=hf.causal_lm_loss,
        dataset=data,
        collate=collate if arch["padded"] else default_collate,
        inputs=hf.causal_lm_inputs,
        optimizer=optimizer_of(arch),
        scheduler=schedule_of(arch),
        global_batch=job.global_batch,
        micro_batch=job.micro_batch,
        precision=arch["precision"],
        loss_scale=float(arch["loss_scale"]),
        max_grad_norm=arch["max_grad_norm"],
        shuffle=bool(arch["shuffle"]) and not arch["stream"],  # a stream is read in its order
        seed=int(arch["seed"]),
        on_step=log_step,
        evaluation=Evaluation(held_out(arch), every=arch["eval_every"])
        if arch["eval_every"]
        else None,
        name=layers.meta.get("hf_class", "") if hasattr(layers, "meta") else "",
    )


# -- the same recipe without chameleond ----------------------------------------------------------


def plain(
    spec_path: Path,
    steps: int,
    trained: Mapping[int, list[int]] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """`steps` steps of the recipe in one process on `device`: per step its mean loss, gradient
    norm (before clipping), learning rate, whether fp16 overflowed, the sample ids it trained and
    its wall-clock seconds. `trained[step]`: the micro-batches the step trains (default: all), as
    a chameleond `drop` plan trains fewer: the samples of the others are skipped, not moved."""
    from chameleond.core.spec import load_spec
    from chameleond.worker import permutation

    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the workers' kernels
    spec = load_spec(spec_path)
    arch = arch_of(spec.arch)
    B, b = spec.training.global_batch, spec.training.micro_batch
    model = model_of(arch).to(dev)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = optimizer_of(arch)(named)
    sched = schedule_of(arch)(opt)
    precision = arch["precision"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(
        dev.type, init_scale=float(arch["loss_scale"]), enabled=precision == "fp16"
    )
    data = dataset(arch)
    n = int(arch["samples"])
    stream = iter(data) if arch["stream"] else None

    def sample_id(position: int) -> int:
        if arch["stream"] or not arch["shuffle"]:
            return position % n
        return int(permutation(n, int(arch["seed"]), position // n)[position % n])

    keys = ("loss", "grad_norm", "lr", "overflow", "ids", "eval_loss", "seconds")
    out: dict[str, list[Any]] = {k: [] for k in keys}
    for step in range(steps):
        ids = [sample_id(step * B + k) for k in range(B)]
        rows_of = [next(stream) for _ in ids] if stream is not None else None
        every = list(range(B // b))
        micro_batches = every if trained is None else trained.get(step, every)
        samples = len(micro_batches) * b
        used: list[int] = []
        batches = []
        for g in micro_batches:
            part = ids[g * b : (g + 1) * b]
            used += part
            rows = rows_of[g * b : (g + 1) * b] if rows_of else [data[i] for i in part]
            batch = collate(rows)
            if not arch["padded"]:
                del batch["attention_mask"]  # all ones: the model is called without one
            if dev.type == "cuda":  # as a DataLoader with pin_memory=True gives them
                batch = {k: v.pin_memory() for k, v in batch.items()}
            batches.append(batch)
        # A step's time leaves its data out, as a perfect prefetch would.
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for host in batches:
            batch = {k: v.to(dev, non_blocking=True) for k, v in host.items()}
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                per_sample, aux = forward(model, batch)
                # The micro-batch's loss: the mean of its samples', plus the router's balancing
                # loss (a MoE), averaged over the step's micro-batches.
                summed = per_sample.sum() + aux * len(per_sample)
            scaler.scale(summed / samples).backward()
            total += summed.detach().double()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(
            [p for _, p in named], arch["max_grad_norm"] or math.inf
        )
        scale_before = scaler.get_scale() if scaler.is_enabled() else 1.0
        scaler.step(opt)
        scaler.update()
        overflow = scaler.is_enabled() and scaler.get_scale() < scale_before
        out["lr"].append(float(opt.param_groups[0]["lr"]))
        sched.step()
        out["loss"].append(float(total) / samples)
        out["grad_norm"].append(float(norm))
        out["overflow"].append(bool(overflow))
        out["ids"].append(used)
        every = int(arch["eval_every"])
        out["eval_loss"].append(
            evaluate(model, arch, B) if every and (step + 1) % every == 0 else None
        )
        out["seconds"].append(time.perf_counter() - t0)  # the loss's float() waited for the device
    return out


def forward(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-sample losses of a micro-batch and, for a MoE model, its router's balancing loss
    times its coefficient (as the model's own `loss` adds it); 0 otherwise."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    out = model(**inputs)
    aux = getattr(out, "aux_loss", None)
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0))
    aux = torch.zeros(()) if aux is None else coef * aux
    return hf.causal_lm_loss(out.logits, batch), aux


def evaluate(model: torch.nn.Module, arch: Mapping[str, Any], global_batch: int) -> float:
    """The mean per-sample loss on the held-out samples (whole global batches), in eval mode."""
    rows = held_out(arch)
    rows = rows[: len(rows) // global_batch * global_batch]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(arch["precision"])
    dev = next(model.parameters()).device
    model.eval()
    with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
        total = 0.0
        for k in range(0, len(rows), global_batch):  # one global batch at a time
            batch = {key: v.to(dev) for key, v in collate(rows[k : k + global_batch]).items()}
            if not arch["padded"]:
                del batch["attention_mask"]
            per_sample, aux = forward(model, batch)
            total += float(per_sample.sum() + aux * len(per_sample))
    model.train()
    return total / len(rows)


def main() -> int:
    if "--plain" not in sys.argv:
        return run(training)
    parser = argparse.ArgumentParser(description="the recipe in a plain torch loop")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--trained", type=Path, help="JSON {step: [micro-batch, ...]}: the steps a drop thinned"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda:N, ...")
    args = parser.parse_args()
    trained = None
    if args.trained is not None:
        trained = {int(s): gs for s, gs in json.loads(args.trained.read_text()).items()}
    args.out.write_text(json.dumps(plain(args.spec, args.steps, trained, args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
