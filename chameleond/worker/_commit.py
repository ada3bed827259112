"""What a step's commit vote decides for every worker alike: the step's loss, its gradient norm
over the whole model, whether fp16 gradients overflowed, and the tokens it trained; and the fp16
loss scale those decisions drive.

Each worker's row of the vote (chameleond.worker._runtime) carries its share: the loss sum of the
micro-batches whose last stage it ran, the tokens, the count and the id sum of the samples of those
whose first stage it ran, and the sum of squares of the gradient sums of the layers it is the first
owner of (tied copies counted once).
Summed over the world, the rows give every worker the same `Commit`, so each applies the same
clipping factor and makes the same overflow decision: one decision per step for the whole job,
as `clip_grad_norm_` and `GradScaler` make in a one-process loop.

Gradients are SUMS over the step's samples, times the `seed` the loss sum's backward starts from:
1, or in fp16 S / B, the loss scale S on the MEAN loss, as GradScaler scales it (scaling the sum by
S would make every fp16 activation gradient B times larger than in a one-process loop, and
overflow where it does not). A step of B samples has the gradient norm sqrt(sum of squares) /
(B seed), and the update divides each gradient sum by B, then multiplies it by clip / seed,
clip = min(1, max_grad_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

CLIP_EPS = 1e-6  # clip_grad_norm_'s


@dataclass(frozen=True)
class Commit:
    step: int
    loss_sum: float  # over the samples the step trained
    grad_sq: float  # sum of squares of the gradient sums (x S^2); inf or nan: an overflow
    tokens: int
    overflow: bool  # fp16 only: inf or nan gradients somewhere; the update is skipped
    # The samples the step's first stages read, and the sum of their ids: what the step trained,
    # known to every worker (a worker killed after the commit leaves no log of its share).
    samples_read: int = 0
    sample_id_sum: int = 0

    def grad_norm(self, global_batch: int, seed: float) -> float:
        """The global gradient norm before clipping, in the units of a mean loss's gradients."""
        return math.sqrt(self.grad_sq) / (global_batch * seed)

    def factor(self, global_batch: int, seed: float, max_grad_norm: float | None) -> float:
        """What a gradient sum divided by `global_batch` is multiplied by: unscale, then clip."""
        clip = 1.0
        if max_grad_norm is not None:
            norm = self.grad_norm(global_batch, seed)
            clip = min(1.0, max_grad_norm / (norm + CLIP_EPS))
        return clip / seed


def seed(loss_scale: float | None, global_batch: int) -> float:
    """What the backward of a step's loss sum over `global_batch` samples starts from: the loss
    scale on the mean loss in fp16 (`loss_scale` not None), else 1."""
    return 1.0 if loss_scale is None else loss_scale / global_batch


def overflowed(grad_sq: float, fp16: bool) -> bool:
    """An fp16 step whose gradients hold inf or nan skips its update (GradScaler's rule)."""
    return fp16 and not math.isfinite(grad_sq)


@dataclass
class LossScale:
    """Dynamic loss scaling as torch.amp.GradScaler does it, with its defaults: start at 2^16;
    halve on an overflowing step; double after GROWTH_INTERVAL steps in a row without one. Every
    layer holds a copy, moved and checkpointed with it; the copies stay equal, since every layer
    sees the same decisions."""

    scale: float = 2.0**16
    growth_tracker: int = 0

    GROWTH = 2.0
    BACKOFF = 0.5
    GROWTH_INTERVAL = 2000

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.BACKOFF
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.GROWTH_INTERVAL:
            self.scale *= self.GROWTH
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
