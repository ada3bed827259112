"""Train a Hugging Face GPT-2 under chameleond: the user's script is the worker.

The model is `transformers.GPT2LMHeadModel` built from a config with random weights (no download),
trained on the Python standard library's sources tokenised by a byte-level BPE trained here
(hf_text.py). The job's spec (examples/hf-gpt2.toml) gives its size in `[model.arch]` and the
batch sizes in `[training]`.

    chameleonctl up --example hf                       # the whole job on this machine, with faults
    python examples/hf_gpt2.py --job J --worker-id w0  # one worker (the flags of chameleon-worker)
    torchrun --nproc-per-node 2 examples/hf_gpt2.py --plain --spec examples/hf-gpt2.toml
                                                       # the same training in a plain torch loop

`--plain` is the loop this script would be without chameleond: one process group, every rank
holding the whole model, its share of the micro-batches, an all-reduce of the gradients, one
AdamW. `chameleonctl bench worker` times it against the library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from hf_text import TokenBlocks, collate, default_cache_dir, stdlib_blocks
from transformers import GPT2Config, GPT2LMHeadModel

from chameleond.worker import Job, Training, run
from chameleond.worker.hf import causal_lm_loss, split_causal_lm

# [model.arch] keys and their defaults: a GPT-2 that trains on a laptop CPU.
ARCH: dict[str, Any] = {
    "n_embd": 64,
    "n_layer": 4,
    "n_head": 4,
    "seq_len": 64,
    "vocab": 1024,
    "seed": 0,
    "lr": 1e-3,
}


def arch_of(table: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(table) - set(ARCH))
    if unknown:
        raise ValueError(f"model.arch: unknown keys {unknown}; known: {sorted(ARCH)}")
    return {**ARCH, **table}


def gpt2(arch: Mapping[str, Any]) -> GPT2LMHeadModel:
    """The model, the same on every worker: seeded before it is built. Dropout is off: a rerouted
    micro-batch must compute on another worker exactly what it computes on its own."""
    torch.manual_seed(arch["seed"])
    config = GPT2Config(
        vocab_size=arch["vocab"],
        n_positions=arch["seq_len"],
        n_embd=arch["n_embd"],
        n_layer=arch["n_layer"],
        n_head=arch["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def text(arch: Mapping[str, Any], cache_dir: Path) -> TokenBlocks:
    return stdlib_blocks(arch["seq_len"], arch["vocab"], cache_dir)


def training(job: Job, cache_dir: Path) -> Training:
    arch = arch_of(job.arch)
    lr = float(arch["lr"])
    return Training(
        model=split_causal_lm(gpt2(arch)),
        loss=causal_lm_loss,
        dataset=text(arch, cache_dir),
        collate=collate,
        optimizer=lambda named: torch.optim.AdamW(named, lr=lr),
        global_batch=job.global_batch,
        micro_batch=job.micro_batch,
        name="GPT2LMHeadModel",
    )


# -- the same training without chameleond ---------------------------------------------------------


class Pace(Protocol):
    """Something a plain loop calls around its steps (`chameleonctl bench worker` times the loop
    and takes turns with the library through one)."""

    def before(self, step: int) -> None: ...

    def close(self) -> None: ...


def plain(
    spec_path: Path, steps: int, cache_dir: Path, timings: Path | None, pace: Pace | None = None
) -> int:
    """Train `steps` steps in one torch.distributed process group (torchrun's environment, or a
    world of one); rank 0 prints each step's loss and writes the step times (wall and this
    process's CPU) and losses to `timings`. `pace.before(step)` is called before each step and
    `pace.close()` after the last."""
    from chameleond.core.spec import load_spec

    spec = load_spec(spec_path)
    arch = arch_of(spec.arch)
    B, b = spec.training.global_batch, spec.training.micro_batch
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("gloo", rank=int(os.environ.get("RANK", "0")),
                            world_size=int(os.environ.get("WORLD_SIZE", "1")))  # fmt: skip
    rank, world = dist.get_rank(), dist.get_world_size()
    if B % (b * world):
        raise SystemExit(f"global batch {B} is not micro-batches of {b} shared by {world} ranks")
    per_rank = B // world
    torch.set_num_threads(1)
    model = gpt2(arch)
    data = text(arch, cache_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=float(arch["lr"]))
    params = list(model.parameters())
    seconds: list[float] = []
    cpu_seconds: list[float] = []
    losses: list[float] = []
    for step in range(steps):
        if pace is not None:
            pace.before(step)
        start, cpu_start = time.perf_counter(), time.process_time()
        loss_sum = torch.zeros(1)
        first = step * B + rank * per_rank
        for m in range(first, first + per_rank, b):
            batch = collate([data[i % len(data)] for i in range(m, m + b)])
            loss = causal_lm_loss(model(batch["input_ids"]).logits, batch).sum()
            loss.backward()
            loss_sum += loss.detach()
        flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None] + [loss_sum])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            if p.grad is not None:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad)).div_(B)
                offset += n
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
        losses.append(float(flat[-1]) / B)
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f} {seconds[-1]:.3f} s", flush=True)
    if pace is not None:
        pace.close()
    if rank == 0 and timings is not None:
        out = {"step_seconds": seconds, "cpu_seconds": cpu_seconds, "losses": losses}
        timings.write_text(json.dumps({**out, "world": world}))
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where the trained tokenizer and token ids are kept")  # fmt: skip
    p.add_argument("--plain", action="store_true", help="train in a plain torch loop instead")
    p.add_argument("--spec", type=Path, help="--plain: the job spec giving model and batch sizes")
    p.add_argument("--steps", type=int, default=20, help="--plain: steps to train")
    p.add_argument("--timings", type=Path, help="--plain: write step times and losses here (JSON)")
    args, rest = p.parse_known_args(argv)
    if args.plain:
        if args.spec is None:
            p.error("--plain needs --spec")
        return plain(args.spec, args.steps, args.cache_dir, args.timings)
    return run(lambda job: training(job, args.cache_dir), rest)


if __name__ == "__main__":
    sys.exit(main())
