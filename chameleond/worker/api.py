"""The worker library's public surface: what a training script gives, what the library owns.

A training script describes its training once (`Training`) and hands it to `run`; the library then
joins the job, follows the plans, runs 1F1B over the layers this worker holds, reroutes
micro-batches, sums gradients, migrates layers with their optimizer state, writes checkpoints and
reports heartbeats and steps. The model is an ordered list of layers (`Layers`), built the same on
every worker (seed before building it): any worker can then build any layer, and a migration only
moves weights and optimizer state. `chameleond.worker` re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

Batch = Any  # what `collate` returns: a Mapping[str, Tensor], a tuple of tensors, or a tensor
Loss = Callable[[torch.Tensor, Batch], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]  # -> torch.optim.lr_scheduler.LRScheduler


class Dataset(Protocol):
    """Map-style: `len()` samples, sample `i` by `dataset[i]` (torch.utils.data.Dataset, a
    Hugging Face datasets.Dataset, a list)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class ModelError(ValueError):
    """The model cannot be trained by the library; the message names the layer."""


class DataError(RuntimeError):
    """The training data is unavailable, or differs from what the job's other workers read."""


@dataclass(frozen=True)
class Tie:
    """One parameter used by two layers (GPT-2's wte and lm_head). Both layers hold their own copy,
    initialised equal; the library sums the two gradients between the layers' owners before the
    update, so the copies stay equal (the Megatron embedding-group rule)."""

    first: tuple[int, str]  # (layer index, parameter name inside that layer's module)
    second: tuple[int, str]


@dataclass(frozen=True)
class Layers:
    """The model as pipeline layers. modules[i](x) -> y: one tensor in, one tensor out. modules[0]
    takes the batch's input tensor (`Training.inputs`); the last returns what `Training.loss`
    consumes."""

    modules: Sequence[nn.Module]
    ties: Sequence[Tie] = ()


@dataclass(frozen=True)
class Factory:
    """The model as `layer(i) -> nn.Module` for i in range(count), built lazily: a worker builds
    only the layers it holds. `layer(i)` must give the same initial weights on every call and every
    worker (seed inside it, e.g. `torch.manual_seed(seed * 1000 + i)`)."""

    count: int
    layer: Callable[[int], nn.Module]
    ties: Sequence[Tie] = ()


Model = Layers | Factory | Sequence[nn.Module]


def split(
    module: nn.Module,
    into: Callable[[nn.Module], Iterable[nn.Module]],
    ties: Sequence[Tie] = (),
) -> Layers:
    """`module` cut into layers by `into(module)` (e.g. embeddings, each block, norm + head). Every
    parameter of `module` must belong to some layer: a split that drops one is refused (ModelError,
    naming the parameter), since the library would silently never train it."""
    modules = list(into(module))
    kept = {id(p) for m in modules for p in m.parameters()}
    dropped = [
        name for name, p in module.named_parameters(remove_duplicate=False) if id(p) not in kept
    ]
    if dropped:
        shown = ", ".join(dropped[:5]) + (
            f" and {len(dropped) - 5} more" if len(dropped) > 5 else ""
        )
        raise ModelError(
            f"the split of {type(module).__name__} into {len(modules)} layers drops parameters "
            f"{shown}: every parameter must belong to a layer"
        )
    return Layers(modules, tuple(ties))


def default_collate(samples: list[Any]) -> Batch:
    """torch's default collate: stacks tensors, numbers and the fields of mappings."""
    from torch.utils.data import default_collate as collate

    return collate(samples)


def default_inputs(batch: Batch) -> torch.Tensor:
    """What layer 0 takes: batch["input_ids"] of a mapping, batch[0] of a tuple or list, or the
    batch itself when it is a tensor."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        return batch["input_ids"]
    return batch[0]


@dataclass(frozen=True)
class Training:
    """One training job, as the user's script describes it.

    - `model`: `Layers`, a `Factory`, or a plain sequence of modules (no ties).
    - `loss(output, batch)`: the PER-SAMPLE losses of a micro-batch, a 1-D tensor of its samples.
      The library sums them over the step's samples and divides by `global_batch` once, so a
      rerouted or re-partitioned step makes the same update as a failure-free one (a step of a
      `drop` plan, which trains fewer micro-batches, divides by the samples it trained).
    - `dataset`: map-style, indexed by sample id; step s trains ids [s*B, (s+1)*B) modulo its
      length; `collate(samples) -> batch`; `inputs(batch)` picks layer 0's input.
    - `optimizer(params)`: any torch.optim optimizer, built once PER LAYER, so that moving a layer
      moves its optimizer state; `scheduler(optimizer)`, optional, is stepped once per committed
      step for each layer.
    - `global_batch`, `micro_batch`: samples per step and per micro-batch; they must equal the job
      spec's [training] (the planner plans with those).
    - `name`: what the model is called in logs and checkpoints (default: layer 0's class).
    """

    model: Model
    loss: Loss
    dataset: Dataset
    optimizer: OptimizerFactory
    global_batch: int
    micro_batch: int
    collate: Callable[[list[Any]], Batch] = default_collate
    inputs: Callable[[Batch], torch.Tensor] = default_inputs
    scheduler: SchedulerFactory | None = None
    name: str = ""


@dataclass(frozen=True)
class Job:
    """What the job spec says about the training, for a training built once it is known."""

    name: str
    arch: Mapping[str, Any]  # the spec's [model.arch] table (free-form, for the model's builder)
    global_batch: int
    micro_batch: int


# A training that depends on the job: called once the spec is known (the built-in model reads its
# architecture from [model.arch]).
TrainingOf = Callable[[Job], Training]
