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
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol

import torch
from torch import nn

Batch = Any  # what `collate` returns: a Mapping[str, Tensor], a tuple of tensors, or a tensor
# What a layer takes and returns (`Layers`): a tensor, a tuple/list of tensors, a dict of tensors.
Activation = Any
# (the last layer's output without its "aux_loss", the micro-batch) -> per-sample losses.
Loss = Callable[[Activation, Batch], torch.Tensor]
# (name, parameter) pairs of one layer's trainable parameters, under the model's own state_dict
# names: torch's optimizers take them as they are (`AdamW(named, lr=...)`), and param groups are
# built from the names ("no weight decay on norms and biases").
NamedParameters = list[tuple[str, nn.Parameter]]
OptimizerFactory = Callable[[NamedParameters], torch.optim.Optimizer]
Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]  # -> torch.optim.lr_scheduler.LRScheduler


class MapDataset(Protocol):
    """Map-style: `len()` samples, sample `i` by `dataset[i]` (torch.utils.data.Dataset, a
    Hugging Face datasets.Dataset, a list)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class StreamDataset(Protocol):
    """A stream: iterating it gives the samples in one fixed order (a torch IterableDataset, a
    Hugging Face datasets.IterableDataset from `streaming=True`, a generator function's
    iterable). Sample position p is the p-th sample of the stream; it restarts as a new epoch
    when it ends (chameleond.worker._sampler)."""

    def __iter__(self) -> Any: ...


Dataset = MapDataset | StreamDataset


class WorkerError(Exception):
    """Why `train` ended without training to its end: the base of the library's failures. Each
    kind below is one exit code of `run` (docs/worker.md)."""


class ConfigError(WorkerError, ValueError):
    """The `WorkerConfig` cannot be used (an id, the Redis URL, the bind address, the checkpoint
    directory); the message names the field. Exit 2."""


class RedisUnavailable(WorkerError):
    """The job's Redis is unreachable at start, refused a write, or was away too long for this
    worker to keep its events. Exit 3."""


class JobSpecError(WorkerError):
    """The job's spec is missing, malformed, or its [model.arch] is unusable. Exit 4."""


class BackendUnavailable(WorkerError, RuntimeError):
    """The device is not there, or its collective backend cannot be used here; the message says
    why. Exit 5."""


class DataError(WorkerError, RuntimeError):
    """The training data is unavailable, or differs from what the job's other workers read.
    Exit 6."""


class DeviceFailed(WorkerError, RuntimeError):
    """This worker's own computation failed (a device error, out of memory): not a peer's
    fault. The worker reports itself and leaves (docs/worker.md, "Failure detection"). Exit 7."""


class ModelError(WorkerError, ValueError):
    """The model cannot be trained by the library; the message names the layer. Exit 8."""


class Ending(Enum):
    """Why a worker's training ended without an error (exit 0)."""

    FINISHED = "finished"  # its `max_steps` are committed
    FENCED = "fenced"  # a plan excluded it: the job goes on without it
    STOPPED = "stopped"  # asked to stop (`train`'s `stop` event, SIGTERM or SIGINT under `run`)


@dataclass(frozen=True)
class TrainingResult:
    """How `train` ended: why, the last step this worker committed (-1: none) and the last plan
    generation it trained in (0: none)."""

    ending: Ending
    committed_step: int
    generation: int


@dataclass(frozen=True)
class Tie:
    """One parameter used by two layers (GPT-2's wte and lm_head). Both layers hold their own copy,
    initialised equal; the library sums the two gradients between the layers' owners before the
    update, so the copies stay equal (the Megatron embedding-group rule)."""

    first: tuple[int, str]  # (layer index, parameter name inside that layer's module)
    second: tuple[int, str]


@dataclass(frozen=True)
class Layers:
    """The model as pipeline layers. modules[i](x) -> y, x and y *activations*: a tensor, a
    tuple/list of tensors, or a dict {str: tensor} (one level), e.g. {"hidden": ..., "mask": ...}.
    An activation's shapes may change from micro-batch to micro-batch (variable-length batches);
    its structure (tuple length, dict keys in order) and dtypes at one boundary may not. Integer
    and bool tensors (masks, position ids) travel forward only; floating ones get a gradient back,
    and a layer that feeds another returns at least one. A layer may return a dict holding
    "aux_loss" (a scalar tensor, e.g. a MoE router's balancing loss): it does not flow on, and
    `aux_loss * samples in the micro-batch` is added to the step's loss sum (so it is weighted as
    a loop averaging each micro-batch's loss weights it). modules[0] takes `Training.inputs`'s
    activation; the last returns what `Training.loss` consumes (without "aux_loss")."""

    modules: Sequence[nn.Module]
    ties: Sequence[Tie] = ()
    # Per layer, {parameter name inside the layer's module: the name in the whole model's
    # state_dict} (`split` fills it); missing: "{layer index}.{name inside the layer}".
    names: Sequence[Mapping[str, str]] = ()
    # Layers built on the `meta` device hold no weights: `materialize(i, module)` fills layer i's
    # module in place once it has real (uninitialised) storage, on the worker that holds it (from
    # an init function or a pretrained directory, reading only that layer's tensors).
    materialize: Callable[[int, nn.Module], None] | None = None
    # Names the weights `materialize` reads (a pretrained directory's digest): the job's workers
    # must agree on it. "": nothing to check.
    weights_digest: str = ""
    # Free-form strings every checkpoint records (chameleond.worker.hf: the Hugging Face class and
    # config that `chameleonctl export --hf` needs).
    meta: Mapping[str, str] = field(default_factory=dict)


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
    named = list(module.named_parameters(remove_duplicate=False))
    aliases: dict[int, list[str]] = {}  # a parameter object -> its names in `module`, in order
    for name, p in named:
        aliases.setdefault(id(p), []).append(name)
    every = [name for name, _ in named]
    names = [
        {
            local: _model_name(aliases.get(id(p)), every, local, i)
            for local, p in m.named_parameters(remove_duplicate=False)
        }
        for i, m in enumerate(modules)
    ]
    return Layers(modules, tuple(ties), names)


def _model_name(aliases: list[str] | None, every: list[str], local: str, index: int) -> str:
    """The model's name of the parameter a layer calls `local`: among the names of the same
    parameter object in the model (a tied one has several: GPT-2's "transformer.wte.weight" and
    "lm_head.weight"), the one of the layer's own position, whose suffix is `local` (else the
    first). A parameter not in the model (a tie's copy made before the split) takes the model
    name that ends with `local`, when exactly one does; "{index}.{local}" otherwise."""

    def ends(name: str) -> bool:
        return name == local or name.endswith("." + local)

    if aliases:
        return next((n for n in aliases if ends(n)), aliases[0])
    matches = [n for n in every if ends(n)]
    return matches[0] if len(matches) == 1 else f"{index}.{local}"


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
class StepInfo:
    """One committed step, as `Training.on_step` receives it on every worker of the plan (log it
    from the worker whose `rank` is 0: each step has exactly one)."""

    step: int
    generation: int
    worker: str
    rank: int  # this worker's rank in the plan's world
    loss: float  # the mean per-sample loss over the samples the step trained
    grad_norm: float  # the global gradient norm before clipping (clip_grad_norm_'s return value)
    learning_rate: float  # the step's (before the scheduler steps): the first param group's, of
    # the lowest layer this worker holds with trainable parameters
    samples: int  # trained this step: the job's global batch, or fewer under a drop plan
    skipped_samples: int  # the job's global batch minus `samples` (a drop plan's dropped ids)
    tokens: int  # `Training.tokens` summed over the step's micro-batches
    seconds: float  # this worker's wall time for the step
    overflow: bool = False  # fp16: inf/nan gradients somewhere; the update was skipped
    loss_scale: float = 1.0  # fp16: the loss scale the step ran with
    eval_loss: float | None = None  # `Training.evaluation` ran after this step: its mean loss
    synced_bytes: int = 0  # gradient bytes this worker all-reduced in the step's sync
    sample_ids: tuple[int, ...] = ()  # ids of the samples whose first stage this worker ran
    # The whole step's, from its commit vote: how many samples its first stages read, and the sum
    # of their ids (to account for every sample even where a worker died after the commit).
    step_samples: int = 0
    step_sample_id_sum: int = 0
    # The share of this worker's data preparation (reading, collating) so far that the prefetch
    # thread hid behind compute; None while it has read nothing.
    data_overlap: float | None = None


@dataclass(frozen=True)
class Evaluation:
    """Every `every` committed steps, the mean per-sample loss of the model on `dataset` (a
    held-out map-style dataset), forward only; the first `samples` of it (default: all, rounded
    down to whole global batches). Reported as `StepInfo.eval_loss` and the step event's
    `eval_loss`."""

    dataset: MapDataset
    every: int
    samples: int = 0


def default_tokens(batch: Batch) -> int:
    """Tokens in a micro-batch: the ones of its `attention_mask` when the batch has one, else the
    elements of its input tensor."""
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return int(batch["attention_mask"].sum().item())
    inputs = default_inputs(batch)
    return int(inputs.numel()) if isinstance(inputs, torch.Tensor) else 0


@dataclass(frozen=True)
class Training:
    """One training job, as the user's script describes it.

    - `model`: `Layers`, a `Factory`, or a plain sequence of modules (no ties).
    - `loss(output, batch)`: the PER-SAMPLE losses of a micro-batch, a 1-D tensor of its samples.
      The library sums them over the step's samples and divides by `global_batch` once, so a
      rerouted or re-partitioned step makes the same update as a failure-free one (a step of a
      `drop` plan, which trains fewer micro-batches, divides by the samples it trained).
    - `dataset`: map-style or a stream; step s trains positions [s*B, (s+1)*B);
      `collate(samples) -> batch`; `inputs(batch)` gives layer 0's input activation (a tensor,
      a tuple/list or a dict of tensors: `Layers`). Without `shuffle`,
      position p of a map-style dataset is sample p modulo its length; with `shuffle`,
      positions map to sample ids through a permutation per epoch drawn from `seed`. A stream
      (an IterableDataset) is read in its own order, position p its p-th sample.
    - `optimizer(named)`: any torch.optim optimizer over (name, parameter) pairs of the layer's
      trainable parameters (model state_dict names), built once PER LAYER, so that moving a layer
      moves its optimizer state; `scheduler(optimizer)`, optional, is stepped once per committed
      step for each layer. Frozen parameters (requires_grad False) get no gradient, no sync and
      no optimizer state.
    - `global_batch`, `micro_batch`: samples per step and per micro-batch; they must equal the job
      spec's [training] (the planner plans with those).
    - `precision`: "fp32", or autocast to "bf16" / "fp16" in every layer's forward and the loss;
      fp16 scales the loss dynamically from `loss_scale`, one overflow decision per step for the
      whole job.
    - `max_grad_norm`: clip the gradients by their norm over the whole model (every stage, tied
      weights once), as `clip_grad_norm_` in a one-process loop; None: no clipping.
    - `on_step(info)`: called on every worker after each committed step (StepInfo).
    - `evaluation`: a held-out loss every N steps (Evaluation).
    - `tokens(batch)`: the tokens of a micro-batch, for the tokens/s figures.
    - `prefetch`: micro-batches each worker prepares ahead of its step in a background thread.
    - `name`: what the model is called in logs and checkpoints (default: layer 0's class).
    """

    model: Model
    loss: Loss
    dataset: Dataset
    optimizer: OptimizerFactory
    global_batch: int
    micro_batch: int
    collate: Callable[[list[Any]], Batch] = default_collate
    inputs: Callable[[Batch], Activation] = default_inputs
    scheduler: SchedulerFactory | None = None
    name: str = ""
    precision: Precision = "fp32"
    loss_scale: float = 2.0**16  # fp16: the initial loss scale (GradScaler's init_scale)
    max_grad_norm: float | None = None
    shuffle: bool = False
    seed: int = 0
    on_step: Callable[[StepInfo], None] | None = None
    evaluation: Evaluation | None = None
    tokens: Callable[[Batch], int] = default_tokens
    prefetch: int = 4


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
