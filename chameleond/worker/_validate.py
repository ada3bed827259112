"""The start-up checks that need a forward pass: a model the runtime cannot pipeline is refused
before anything is measured or sent, with a message naming the layer (ModelError).

Layers take and return activations (chameleond.worker._activation: a tensor, a tuple/list of
tensors or a dict of them, one level; a dict may hold a scalar "aux_loss", which does not flow
on). An activation's shapes may differ between micro-batches (variable-length batches), but its
structure (container, dict keys in order) and dtypes are fixed per stage boundary: the receiver
of a message allocates its header from them. So a layer must return the same structure for two
micro-batches, and the same shapes on two calls with the same input. A layer that feeds another
must return at least one floating tensor (its gradient flows back). The loss must give one value
per sample. The checks run the first two micro-batches of step 0 through fresh copies of the
layers, one layer at a time, without gradients; the structures they find are the boundaries'.
"""

from __future__ import annotations

from typing import Any

import torch

from chameleond.worker._activation import Structure, flatten, split_aux
from chameleond.worker._trainable import Trainable
from chameleond.worker.api import ModelError


def check_model(model: Trainable, micro_batch: int, device: torch.device) -> list[Structure]:
    """Each layer's output structure; ModelError for a layer that breaks the rules. The layers
    run in the training's precision (autocast), so the dtypes found are the messages' in
    training."""
    model.check_precision(device)
    autocast = model.autocast(device)
    global_batch = model.training.global_batch
    batches = [
        model.batch(0, g, global_batch, micro_batch, device)
        for g in range(min(2, global_batch // micro_batch))
    ]
    xs: list[Any] = [model.inputs(batch) for batch in batches]
    _same([flatten(x, "inputs(batch)")[0] for x in xs], "inputs(batch)")
    outputs: list[Structure] = []
    for i in range(model.n_layers):
        module = model.build(i).to(device)
        what = f"layer {i} ({type(module).__name__})"
        with torch.no_grad(), autocast:
            ys = [split_aux(module(x), what)[0] for x in xs]
            again = split_aux(module(xs[0]), what)[0]
        found = [flatten(y, f"the output of {what}") for y in (*ys, again)]
        shapes = [[tuple(t.shape) for t in tensors] for _, tensors in found]
        if shapes[-1] != shapes[0] or found[-1][0] != found[0][0]:
            raise ModelError(
                f"{what} changed its output shape between two calls on the same input: "
                f"{_shown(shapes[0])}, then {_shown(shapes[-1])}"
            )
        structure = _same([s for s, _ in found[:-1]], what)
        if i < model.n_layers - 1 and not structure.floating:
            raise ModelError(
                f"{what} returns {structure}: a layer that feeds another must return at least "
                "one floating point tensor (its gradient flows back)"
            )
        outputs.append(structure)
        xs = ys
    with torch.no_grad(), autocast:
        model.loss_sum(xs[0], batches[0], micro_batch)
    return outputs


def _same(structures: list[Structure], what: str) -> Structure:
    """The one structure of `structures` (one per micro-batch); ModelError naming `what` if
    they differ."""
    for g, s in enumerate(structures[1:], 1):
        if s != structures[0]:
            raise ModelError(
                f"{what} returned {structures[0]} for micro-batch 0 and {s} for micro-batch {g}: "
                "an activation's structure (its dict keys or tuple length) and dtypes are fixed "
                "(its shapes may vary)"
            )
    return structures[0]


def _shown(shapes: list[tuple[int, ...]]) -> str:
    return str(shapes[0]) if len(shapes) == 1 else str(shapes)
