"""Failure-free training in one process: the oracle the distributed runs are compared against.

Same layers (their initial weights), same data (sample ids [s*B, (s+1)*B)), same math (per-sample
losses summed over the batch, tied gradients added, divided once by B, per-layer optimizers and
schedulers). The distributed runs differ from this only in the order in which gradient sums are
added up. A step may train only some of its global micro-batches (`trained`, as under a drop plan):
their sample ids stay where B puts them, and the sums are divided by the samples trained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from chameleond.worker._activation import run_stage
from chameleond.worker._layer import LayerState
from chameleond.worker._trainable import Trainable
from chameleond.worker.api import Training


def reference_losses(
    training: Training | Trainable,
    steps: int,
    first_step: int = 0,
    trained: Callable[[int], Sequence[int]] | None = None,
) -> list[float]:
    """The global mean loss of steps first_step .. first_step + steps - 1 (starting from the
    initial weights); `trained(step)`: the global micro-batches step `step` trains (default:
    all)."""
    model = training if isinstance(training, Trainable) else Trainable(training)
    global_batch, micro_batch = model.training.global_batch, model.training.micro_batch
    torch.set_num_threads(1)
    device = torch.device("cpu")
    layers = [LayerState(model, i, device) for i in range(model.n_layers)]
    losses: list[float] = []
    for step in range(first_step + steps):
        total = 0.0
        ids = range(global_batch // micro_batch) if trained is None else trained(step)
        samples = len(ids) * micro_batch
        for g in ids:
            batch = model.batch(step, g, global_batch, micro_batch, device)
            out = run_stage([layer.module for layer in layers], model.inputs(batch))[0]
            loss = model.loss_sum(out, batch, micro_batch)
            loss.backward()
            total += float(loss.item())
        for tie in model.ties:
            (i, a), (j, b) = tie.first, tie.second
            pa = dict(layers[i].module.named_parameters(remove_duplicate=False))[a]
            pb = dict(layers[j].module.named_parameters(remove_duplicate=False))[b]
            summed = _grad(pa) + _grad(pb)
            _grad(pa).copy_(summed)
            _grad(pb).copy_(summed)
        for layer in layers:
            layer.apply_update(samples, step)
        if step >= first_step:
            losses.append(total / samples)
    return losses


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
