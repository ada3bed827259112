"""Tied parameters: one parameter used by two layers (GPT-2's wte and lm_head), each layer holding
its own copy (chameleond.worker.api.Tie).

After the data-parallel sync every owner of a layer holds that layer's gradient summed over the
step's samples. For each tie, the first owner (in the plan's world order) of each of the two layers
contributes its layer's gradient of the tied parameter, every other member zeros, to one SUM
all-reduce over the world group; each owner of either layer then takes the sum. Both copies get
the same gradient, hence the same update, and stay equal. The sum has two non-zero terms, so it is
the same bits on every worker and in the single-process reference (first + second). Where every
owner of either layer holds both (data-parallel replicas of one stage, a one-stage pipeline), each
adds the two itself, with the same bits, and the all-reduce is left out.
"""

from __future__ import annotations

import torch

from chameleond.worker._backend import communicating
from chameleond.worker._generation import Generation
from chameleond.worker._state import WorkerState
from chameleond.worker.api import Tie


def _grad(state: WorkerState, layer: int, name: str) -> torch.Tensor:
    p = dict(state.layer(layer).module.named_parameters(remove_duplicate=False))[name]
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def sync_ties(gen: Generation, state: WorkerState) -> None:
    ties = state.model.trained_ties  # a frozen tied parameter has no gradient to share
    if not ties:
        return
    plan, me = gen.plan, gen.me
    owners = {w: set(plan.owned_layers(w)) for w in gen.world}
    mine = owners[me]
    if all(_held_together(tie, owners) for tie in ties):
        # Every owner of either layer holds both, with the same summed gradients: each adds the
        # two itself, in the all-reduce's order (zeros + first + second; the other members'
        # zeros add nothing), and no collective is needed. Decided from the plan alone, so every
        # member of the generation decides alike.
        for tie in ties:
            if tie.first[0] in mine:
                first, second = _grad(state, *tie.first), _grad(state, *tie.second)
                total = torch.zeros_like(first)
                total += first
                total += second
                first.copy_(total)
                second.copy_(total)
        return

    def first_owner(layer: int) -> str:
        return next(w for w in gen.world if layer in owners[w])

    parts = []
    for tie in ties:
        shape, dtype = state.model.tie_shapes[tie]
        buf = torch.zeros(shape, dtype=dtype, device=state.device)
        for layer, name in (tie.first, tie.second):
            if first_owner(layer) == me:
                buf += _grad(state, layer, name)
        parts.append(buf)
    flat = torch.cat([b.reshape(-1) for b in parts])
    with communicating():
        gen.world_group.allreduce([flat]).wait()
    gen.check()
    off = 0
    for tie, buf in zip(ties, parts, strict=True):
        total = flat[off : off + buf.numel()].view_as(buf)
        off += buf.numel()
        for layer, name in (tie.first, tie.second):
            if layer in mine:
                _grad(state, layer, name).copy_(total)


def _held_together(tie: Tie, owners: dict[str, set[int]]) -> bool:
    """Whether every worker that owns one of the tie's layers owns the other too."""
    a, b = tie.first[0], tie.second[0]
    return all((a in held) == (b in held) for held in owners.values())
