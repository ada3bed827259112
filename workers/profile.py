"""Measure every layer's cost on this worker's device, for the planner's performance model.

Per layer, for one micro-batch: forward and backward seconds (median of a few timed repetitions
after a warm-up), parameter bytes, AdamW state bytes (after one real optimizer step), activation
bytes (the tensors autograd saves for backward, parameters excluded) and output bytes (what the
layer would send to the next stage; zero for the head, whose output is the loss). Layers are built
one at a time, so profiling needs the memory of one layer, not of the model.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from workers.model import Arch, LayerState, sample_loss_sum

REPEATS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def profile_layer(arch: Arch, index: int, micro_batch: int, device: torch.device) -> dict[str, Any]:
    layer = LayerState(arch, index, device)
    params = layer.params()
    param_ptrs = {p.data_ptr() for p in params}
    last = index == arch.n_layers - 1
    gen = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, arch.vocab, (micro_batch, arch.seq_len), generator=gen).to(device)
    hidden = torch.randn((micro_batch, arch.seq_len, arch.d_model), generator=gen).to(device)

    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in param_ptrs:
            saved.append(_tensor_bytes(t))
        return t

    fwd: list[float] = []
    bwd: list[float] = []
    out_bytes = 0
    for rep in range(REPEATS + 1):
        x = tokens if index == 0 else hidden.clone().requires_grad_()
        saved.clear()
        _sync(device)
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer.module(x)
            loss = sample_loss_sum(out, tokens) if last else None
        _sync(device)
        t1 = time.perf_counter()
        if loss is not None:
            loss.backward()
        else:
            out.backward(torch.ones_like(out))
        _sync(device)
        t2 = time.perf_counter()
        if rep:  # the first repetition warms up allocator and kernels
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
        out_bytes = 0 if last else _tensor_bytes(out)
    activation_bytes = sum(saved)
    layer.apply_update(micro_batch, 0)  # one real AdamW step creates the optimizer state
    optimizer_bytes = sum(
        _tensor_bytes(v)
        for st in layer.optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
    name = "embedding" if index == 0 else "head" if last else f"block{index - 1}"
    return {
        "name": name,
        "forward_seconds": statistics.median(fwd),
        "backward_seconds": statistics.median(bwd),
        "param_bytes": sum(_tensor_bytes(p) for p in params),
        "optimizer_bytes": optimizer_bytes,
        "activation_bytes": activation_bytes,
        "output_bytes": out_bytes,
    }


def profile_model(arch: Arch, micro_batch: int, device: torch.device) -> dict[str, Any]:
    """The `profile` event's JSON data: {"layers": [...]} in layer order."""
    return {
        "layers": [profile_layer(arch, i, micro_batch, device) for i in range(arch.n_layers)],
        "micro_batch": micro_batch,
        "device": str(device),
    }
