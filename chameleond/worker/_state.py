"""What a worker holds between plan generations: its layers, the last committed step, and at most
one pending update (gradients fully summed over the layer owners, not yet applied because the step's
commit vote did not reach this worker). A pending update keeps the global batch its gradients were
summed over: it may be applied under a later plan, whose batch can differ. Applying it needs the
step's `Commit` (its gradient norm and overflow decision): the workers whose vote completed keep
theirs (`last_commit`) and hand it over in the next generation's reconciliation."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from chameleond.worker._commit import Commit, seed
from chameleond.worker._layer import LayerState, scale_gradients
from chameleond.worker._trainable import Trainable


class WorkerState:
    def __init__(self, model: Trainable, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.layers: dict[int, LayerState] = {}
        self.committed_step = -1  # the last step this worker applied; -1: none yet
        # The global batch of the plan whose steps this worker runs (set by each generation's
        # reconcile, chameleond.worker._migrate).
        self.global_batch: int | None = None
        self.pending_step: int | None = None
        self.pending_layers: tuple[int, ...] = ()
        self.pending_batch: int | None = None  # the global batch of the pending update's step
        self.last_commit: Commit | None = None  # the vote's outcome of the last applied step

    def layer(self, index: int) -> LayerState:
        try:
            return self.layers[index]
        except KeyError:
            raise RuntimeError(f"layer {index} is not held by this worker") from None

    def build_from_seed(self, index: int) -> LayerState:
        """Only valid before any step committed: the initial weights are a function of the seed."""
        st = LayerState(self.model, index, self.device, version=-1)
        self.layers[index] = st
        return st

    def mark_pending(
        self, step: int, layers: Iterable[int], global_batch: int | None = None
    ) -> None:
        """Step `step`'s gradients of `layers` are summed, over `global_batch` samples (default:
        the running plan's, `self.global_batch`)."""
        self.pending_step = step
        self.pending_layers = tuple(layers)
        self.pending_batch = self.global_batch if global_batch is None else global_batch

    def seed(self, global_batch: int) -> float:
        """The backward seed of a step's loss sum over `global_batch` samples (commit.seed)."""
        fp16 = self.model.training.precision == "fp16"
        return seed(self.loss_scale() if fp16 else None, global_batch)

    def loss_scale(self) -> float:
        """The fp16 loss scale of the layers held (1.0 otherwise): every layer at the committed
        step holds the same one."""
        scales = {self.layers[i].scale for i in sorted(self.layers)}
        if len(scales) > 1:
            raise RuntimeError(f"layers hold different loss scales {sorted(scales)}")
        return scales.pop() if scales else 1.0

    def learning_rate(self) -> float:
        """The first param group's learning rate of the lowest layer held with trainable
        parameters (nan when none is)."""
        for i in sorted(self.layers):
            layer = self.layers[i]
            if layer.params():
                return float(layer.optimizer.param_groups[0]["lr"])
        return math.nan

    def apply_pending(self, global_batch: int | None = None, commit: Commit | None = None) -> int:
        """Apply the pending update (the step committed, as `commit` says), dividing its gradient
        sums by `global_batch` (default: the batch recorded with it) and unscaling and clipping
        them as the commit decides; returns the step. Without clipping or fp16 the commit changes
        nothing and may be left out."""
        if self.pending_step is None:
            raise RuntimeError("no pending update to apply")
        batch = self.pending_batch if global_batch is None else global_batch
        if batch is None:
            raise RuntimeError(f"step {self.pending_step}: no global batch to divide its sums by")
        step = self.pending_step
        training = self.model.training
        if commit is None:
            if training.max_grad_norm is not None or training.precision == "fp16":
                raise RuntimeError(f"step {step}: clipping and fp16 need the step's commit")
            commit = Commit(step, math.nan, math.nan, 0, overflow=False)
        if commit.step != step:
            raise RuntimeError(f"commit of step {commit.step} for pending step {step}")
        max_norm = training.max_grad_norm
        layers = [self.layer(i) for i in self.pending_layers]
        if not commit.overflow:
            scaled: dict[float, list[torch.Tensor]] = {}  # factor -> gradients (fp16: per scale)
            for layer in layers:
                factor = commit.factor(batch, layer.seed(batch), max_norm)
                scaled.setdefault(factor, []).extend(layer.gradients())
            for factor, grads in scaled.items():
                scale_gradients(grads, batch, factor)
        for layer in layers:
            layer.step_optimizer(step, commit.overflow)
        self.last_commit = commit
        self.committed_step = step
        self.pending_step = None
        self.pending_layers = ()
        self.pending_batch = None
        return step

    def discard_step(self) -> None:
        """Forget every gradient of an uncommitted step (including a pending one)."""
        for layer in self.layers.values():
            layer.discard_gradients()
        self.pending_step = None
        self.pending_layers = ()
        self.pending_batch = None

    def drop_except(self, keep: Iterable[int]) -> list[int]:
        keep_set = set(keep)
        dropped = sorted(i for i in self.layers if i not in keep_set)
        for i in dropped:
            del self.layers[i]
        return dropped
