"""The start-up checks that need a forward pass: a model the runtime cannot pipeline is refused
before anything is measured or sent, with a message naming the layer (ModelError).

Messages between stages have one fixed shape per stage boundary, allocated before they arrive, so
every layer must return one tensor whose shape depends on the micro-batch size only: the same on
two calls with the same input, and the same for two different micro-batches. A layer that feeds
another must return floating point values (its gradient flows back). The loss must give one value
per sample. The checks run the first two micro-batches of step 0 through fresh copies of the
layers, one layer at a time, without gradients; the shapes they find are the messages' shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chameleond.worker._trainable import Trainable
from chameleond.worker.api import ModelError


@dataclass(frozen=True)
class Output:
    """What a layer returns for one micro-batch: the shape and dtype of a message after it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def check_model(model: Trainable, micro_batch: int, device: torch.device) -> list[Output]:
    """Each layer's output for one micro-batch; ModelError for a layer that breaks the rules.
    The layers run in the training's precision (autocast), so the shapes and dtypes found are the
    messages' in training."""
    model.check_precision(device)
    autocast = model.autocast(device)
    global_batch = model.training.global_batch
    batches = [
        model.batch(0, g, global_batch, micro_batch, device)
        for g in range(min(2, global_batch // micro_batch))
    ]
    xs = []
    for batch in batches:
        x = model.inputs(batch)
        if not isinstance(x, torch.Tensor):
            raise ModelError(f"inputs(batch) returned a {type(x).__name__}, not a tensor")
        xs.append(x)
    outputs: list[Output] = []
    for i in range(model.n_layers):
        module = model.build(i).to(device)
        what = f"layer {i} ({type(module).__name__})"
        with torch.no_grad(), autocast:
            ys = [module(x) for x in xs]
            again = module(xs[0])
        for y in (*ys, again):
            if not isinstance(y, torch.Tensor):
                raise ModelError(
                    f"{what} returned a {type(y).__name__}, not a tensor: a layer takes one tensor "
                    "and returns one (wrap it to pick the tensor out)"
                )
        if again.shape != ys[0].shape:
            raise ModelError(
                f"{what} changed its output shape between two calls on the same input: "
                f"{tuple(ys[0].shape)}, then {tuple(again.shape)}"
            )
        for y in ys[1:]:
            if y.shape != ys[0].shape:
                raise ModelError(
                    f"{what} returned shape {tuple(ys[0].shape)} for micro-batch 0 and "
                    f"{tuple(y.shape)} for micro-batch 1: messages between stages have one "
                    "fixed shape (pad every batch to the same length)"
                )
        if i < model.n_layers - 1 and not ys[0].is_floating_point():
            raise ModelError(
                f"{what} returns {ys[0].dtype}: a layer that feeds another must return floating "
                "point values (its gradient flows back)"
            )
        outputs.append(Output(tuple(ys[0].shape), ys[0].dtype))
        xs = ys
    with torch.no_grad(), autocast:
        model.loss_sum(xs[0], batches[0], micro_batch)
    return outputs
