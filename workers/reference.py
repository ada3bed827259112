"""Failure-free training in one process: the oracle the distributed runs are compared against.

Same layers (from the seed), same data (sample ids [s*B, (s+1)*B)), same math (per-sample mean loss,
summed over the batch, divided once by B, per-layer AdamW). The distributed runs differ from this
only in the order in which gradient sums are added up.
"""

from __future__ import annotations

import torch

from workers.data import Corpus
from workers.model import Arch, LayerState, run_layers, sample_loss_sum


def reference_losses(
    arch: Arch,
    global_batch: int,
    micro_batch: int,
    steps: int,
    corpus: Corpus | None = None,
    first_step: int = 0,
) -> list[float]:
    """The global mean loss of steps first_step .. first_step + steps - 1 (starting from the
    seed)."""
    corpus = corpus or Corpus()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    layers = [LayerState(arch, i, device) for i in range(arch.n_layers)]
    losses: list[float] = []
    for step in range(first_step + steps):
        total = 0.0
        for g in range(global_batch // micro_batch):
            inputs, targets = corpus.micro_batch(step, g, global_batch, micro_batch, arch.seq_len)
            loss = sample_loss_sum(run_layers(layers, inputs), targets)
            loss.backward()
            total += float(loss.item())
        for layer in layers:
            layer.apply_update(global_batch, step)
        if step >= first_step:
            losses.append(total / global_batch)
    return losses
