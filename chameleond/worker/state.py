"""What a worker holds between plan generations: its layers, the last committed step, and at most
one pending update (gradients fully summed over the layer owners, not yet applied because the step's
commit vote did not reach this worker). A pending update keeps the global batch its gradients were
summed over: it may be applied under a later plan, whose batch can differ."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from chameleond.worker.layer import LayerState
from chameleond.worker.trainable import Trainable


class WorkerState:
    def __init__(self, model: Trainable, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.layers: dict[int, LayerState] = {}
        self.committed_step = -1  # the last step this worker applied; -1: none yet
        # The global batch of the plan whose steps this worker runs (set by each generation's
        # reconcile, chameleond.worker.migrate).
        self.global_batch: int | None = None
        self.pending_step: int | None = None
        self.pending_layers: tuple[int, ...] = ()
        self.pending_batch: int | None = None  # the global batch of the pending update's step

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

    def apply_pending(self, global_batch: int | None = None) -> int:
        """Apply the pending update (the step committed), dividing its gradient sums by
        `global_batch` (default: the batch recorded with it); returns the step."""
        if self.pending_step is None:
            raise RuntimeError("no pending update to apply")
        batch = self.pending_batch if global_batch is None else global_batch
        if batch is None:
            raise RuntimeError(f"step {self.pending_step}: no global batch to divide its sums by")
        step = self.pending_step
        for i in self.pending_layers:
            self.layer(i).apply_update(batch, step)
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
