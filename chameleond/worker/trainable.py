"""The user's `Training`, normalised into what the runtime asks of a model: build layer i with
its initial weights, give it its optimizer and scheduler, read a micro-batch, apply the loss.

The checks that need no forward pass run here, at construction, and raise ModelError naming the
layer: a tie naming a parameter that does not exist, tied copies of different shape or different
initial values, a parameter object shared by two layers without a `Tie` (the library would train
two diverging copies of it). The checks that need one are in chameleond.worker.validate.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from chameleond.worker import samples
from chameleond.worker.api import Batch, Factory, Layers, ModelError, Tie, Training


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch with every tensor in it on `device` (mappings, tuples and lists, recursively)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class Trainable:
    """One `Training`, ready for the runtime."""

    def __init__(self, training: Training) -> None:
        self.training = training
        model = training.model
        self._modules: list[nn.Module] | None = None
        if isinstance(model, Factory):
            if model.count < 1:
                raise ModelError(f"Factory.count must be >= 1, got {model.count}")
            self.n_layers = model.count
            self.ties: tuple[Tie, ...] = tuple(model.ties)
            self._factory = model.layer
        else:
            modules = list(model.modules if isinstance(model, Layers) else model)
            if not modules:
                raise ModelError("the model has no layers")
            for i, m in enumerate(modules):
                if not isinstance(m, nn.Module):
                    raise ModelError(f"layer {i} is a {type(m).__name__}, not a torch.nn.Module")
            self.n_layers = len(modules)
            self.ties = tuple(model.ties) if isinstance(model, Layers) else ()
            self._modules = modules
        for name in ("global_batch", "micro_batch"):
            v = getattr(training, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelError(f"Training.{name} must be an integer >= 1, got {v!r}")
        if training.global_batch % training.micro_batch:
            raise ModelError(
                f"Training.global_batch {training.global_batch} is not a multiple of "
                f"micro_batch {training.micro_batch}"
            )
        if len(training.dataset) < 1:
            raise ModelError("the dataset is empty")
        self._check_ties()
        if self._modules is not None:
            _check_shared(self._modules, self.ties)
        self.name = training.name or type(self.build(0)).__name__
        self.fingerprint = self._fingerprint()

    # layers -----------------------------------------------------------------------------------

    def build(self, index: int) -> nn.Module:
        """A fresh copy of layer `index` with its initial weights (the global RNG is untouched)."""
        if not 0 <= index < self.n_layers:
            raise IndexError(f"layer {index} out of range 0..{self.n_layers - 1}")
        if self._modules is not None:
            return copy.deepcopy(self._modules[index])
        with torch.random.fork_rng(devices=[]):
            module = self._factory(index)
        if not isinstance(module, nn.Module):
            raise ModelError(f"layer {index}: the factory returned a {type(module).__name__}")
        return module

    def optimize(self, module: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        """Layer `module`'s own optimizer and scheduler (None without one). A layer without
        parameters (an activation, a reshape) gets a plain SGD over one empty placeholder: torch's
        optimizers refuse an empty parameter list, and the runtime treats every layer alike."""
        params = list(module.parameters())
        if not params:
            opt: torch.optim.Optimizer = torch.optim.SGD([nn.Parameter(torch.empty(0))], lr=0.0)
            return opt, None
        opt = self.training.optimizer(params)
        sched = None if self.training.scheduler is None else self.training.scheduler(opt)
        return opt, sched

    def layer_name(self, index: int, module: nn.Module) -> str:
        return f"{index}:{type(module).__name__}"

    # data -------------------------------------------------------------------------------------

    def sample_ids(self, step: int, micro_batch: int, global_batch: int, size: int) -> range:
        """`global_batch` is the job's B, whatever a plan trains (chameleond.worker.samples)."""
        return samples.sample_ids(step, micro_batch, global_batch, size)

    def batch(
        self, step: int, micro_batch: int, global_batch: int, size: int, device: torch.device
    ) -> Batch:
        """Global micro-batch `micro_batch` of step `step` of a job of global batch `global_batch`,
        collated, on `device`."""
        data, n = self.training.dataset, len(self.training.dataset)
        ids = self.sample_ids(step, micro_batch, global_batch, size)
        return to_device(self.training.collate([data[i % n] for i in ids]), device)

    def inputs(self, batch: Batch) -> torch.Tensor:
        return self.training.inputs(batch)

    def loss_sum(self, output: torch.Tensor, batch: Batch, samples: int) -> torch.Tensor:
        """The sum of the micro-batch's per-sample losses (PAPER.md section 8)."""
        per_sample = self.training.loss(output, batch)
        if not isinstance(per_sample, torch.Tensor) or per_sample.shape != (samples,):
            got = per_sample.shape if isinstance(per_sample, torch.Tensor) else type(per_sample)
            raise ModelError(
                f"the loss must return one loss per sample (shape [{samples}]), got {got}"
            )
        return per_sample.sum()

    def data_digest(self) -> str:
        """Names the data: the first micro-batch's tensors (two workers reading different data
        would pair one text's inputs with another's targets)."""
        h = hashlib.sha256(str(len(self.training.dataset)).encode())
        _digest(self.batch(0, 0, self.training.global_batch, 1, torch.device("cpu")), h)
        return h.hexdigest()[:16]

    # checks -----------------------------------------------------------------------------------

    def _param(self, module: nn.Module, where: tuple[int, str]) -> nn.Parameter:
        params = dict(module.named_parameters(remove_duplicate=False))
        if where[1] not in params:
            raise ModelError(
                f"tie: layer {where[0]} ({type(module).__name__}) has no parameter {where[1]!r}"
            )
        return params[where[1]]

    def _check_ties(self) -> None:
        self.tie_shapes: list[tuple[torch.Size, torch.dtype]] = []  # per tie: the parameter's
        for tie in self.ties:
            for i, _ in (tie.first, tie.second):
                if not 0 <= i < self.n_layers:
                    raise ModelError(f"tie {tie}: layer {i} out of range 0..{self.n_layers - 1}")
            if tie.first[0] == tie.second[0]:
                raise ModelError(f"tie {tie}: both ends in layer {tie.first[0]}")
            a = self._param(self.build(tie.first[0]), tie.first)
            b = self._param(self.build(tie.second[0]), tie.second)
            if a.shape != b.shape or not torch.equal(a.detach().cpu(), b.detach().cpu()):
                raise ModelError(
                    f"tie {tie}: layer {tie.first[0]}'s {tie.first[1]} and layer "
                    f"{tie.second[0]}'s {tie.second[1]} must start equal (same shape and values)"
                )
            self.tie_shapes.append((a.shape, a.dtype))

    def _fingerprint(self) -> str:
        """Names the model in checkpoints: layers, parameter names and shapes, optimizer."""
        h = hashlib.sha256(f"{self.name}/{self.n_layers}".encode())
        for i in range(self.n_layers):
            module = self._modules[i] if self._modules is not None else self.build(i)
            for name, p in module.named_parameters():
                h.update(f"{i}.{name}:{tuple(p.shape)}:{p.dtype};".encode())
        return h.hexdigest()[:16]


def _digest(value: Any, h: Any) -> None:
    if isinstance(value, torch.Tensor):
        h.update(value.detach().contiguous().cpu().numpy().tobytes())
    elif isinstance(value, Mapping):
        for k in sorted(value):
            h.update(str(k).encode())
            _digest(value[k], h)
    elif isinstance(value, tuple | list):
        for v in value:
            _digest(v, h)
    else:
        h.update(repr(value).encode())


def _check_shared(modules: Sequence[nn.Module], ties: Sequence[Tie]) -> None:
    """A parameter object in two layers must be declared as a Tie: each layer trains its own copy,
    and only a tie keeps the copies equal."""
    tied = {frozenset((t.first, t.second)) for t in ties}
    seen: dict[int, tuple[int, str]] = {}
    for i, m in enumerate(modules):
        for name, p in m.named_parameters(remove_duplicate=False):
            where = seen.setdefault(id(p), (i, name))
            if where[0] != i and frozenset((where, (i, name))) not in tied:
                raise ModelError(
                    f"layer {i}'s parameter {name!r} is layer {where[0]}'s {where[1]!r} too: "
                    f"declare it as Tie(first={where}, second={(i, name)})"
                )
