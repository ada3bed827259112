"""The user's `Training`, normalised into what the runtime asks of a model: build layer i with
its initial weights, give it its optimizer and scheduler, read a micro-batch, apply the loss.

The checks that need no forward pass run here, at construction, and raise ModelError naming the
layer: a tie naming a parameter that does not exist, tied copies of different shape or different
initial values, a parameter object shared by two layers without a `Tie` (the library would train
two diverging copies of it). The checks that need one are in chameleond.worker._validate.

Layers with a `materialize` function (`Layers.materialize`) live on the `meta` device: they hold
shapes and dtypes, no storage. `build(i)` copies layer i's meta module, gives it uninitialised CPU
storage and lets `materialize(i, module)` fill it (a pretrained directory's tensors of that layer,
or an init function), so a worker holds only the layers it builds and a model too large for one
host can be trained split. The name, the fingerprint and the check of shared parameters read the
meta modules; the tie check builds the two layers of each tie, one tie at a time. A layer that
arrives by migration is built (materialised) too, then overwritten by the state it receives.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from chameleond.worker import _sampler as sampler
from chameleond.worker import _samples as samples
from chameleond.worker.api import PRECISIONS, Batch, Factory, Layers, ModelError, Tie, Training


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    """The batch with every tensor in it on `device` (mappings, tuples and lists, recursively)."""
    return _each_tensor(batch, lambda t: t.to(device, non_blocking=non_blocking))


def pinned(batch: Batch) -> Batch:
    """The batch with every tensor in it in page-locked host memory: a copy to a GPU from there
    does not wait for the device's queue (from pageable memory it may), as a DataLoader's
    `pin_memory=True` gives."""
    return _each_tensor(batch, lambda t: t.pin_memory())


def _each_tensor(batch: Batch, f: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    if isinstance(batch, torch.Tensor):
        return f(batch)
    if isinstance(batch, Mapping):
        return {k: _each_tensor(v, f) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_each_tensor(v, f) for v in batch)
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
            self._names: list[Mapping[str, str]] = []
        else:
            modules = list(model.modules if isinstance(model, Layers) else model)
            if not modules:
                raise ModelError("the model has no layers")
            for i, m in enumerate(modules):
                if not isinstance(m, nn.Module):
                    raise ModelError(f"layer {i} is a {type(m).__name__}, not a torch.nn.Module")
            self.n_layers = len(modules)
            self.ties = tuple(model.ties) if isinstance(model, Layers) else ()
            self._names = list(model.names) if isinstance(model, Layers) else []
            self._modules = modules
        self._materialize = model.materialize if isinstance(model, Layers) else None
        # What checkpoints record beside the weights (Layers.meta), and the weights' digest.
        self.meta: dict[str, str] = dict(model.meta) if isinstance(model, Layers) else {}
        self.weights_digest = model.weights_digest if isinstance(model, Layers) else ""
        for name in ("global_batch", "micro_batch"):
            v = getattr(training, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ModelError(f"Training.{name} must be an integer >= 1, got {v!r}")
        if training.global_batch % training.micro_batch:
            raise ModelError(
                f"Training.global_batch {training.global_batch} is not a multiple of "
                f"micro_batch {training.micro_batch}"
            )
        # The data: ModelError for a dataset the library cannot read (chameleond.worker._sampler).
        prefetch = training.prefetch
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ModelError(f"Training.prefetch must be an integer >= 0, got {prefetch!r}")
        self.reader = sampler.reader_for(
            training.dataset, training.shuffle, training.seed, training.global_batch
        )
        self._prefetcher = sampler.Prefetcher(self._prepare, prefetch)
        # (step, micro-batch) -> the sample ids the training thread read and their tokens, until
        # `read_ids`.
        self._read: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
        self._pin = False  # prepared batches go to page-locked memory (`prepare_for`)
        if training.precision not in PRECISIONS:
            raise ModelError(
                f"Training.precision must be one of {', '.join(PRECISIONS)}, got "
                f"{training.precision!r}"
            )
        self.autocast_dtype: torch.dtype | None = {
            "fp32": None,
            "bf16": torch.bfloat16,
            "fp16": torch.float16,
        }[training.precision]
        scale = training.loss_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ModelError(f"Training.loss_scale must be > 0, got {scale!r}")
        norm = training.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not norm > 0):
            raise ModelError(f"Training.max_grad_norm must be > 0 (or None), got {norm!r}")
        self.evaluation_steps()  # refuses a held-out set that cannot be evaluated
        self._check_ties()
        if self._modules is not None:
            _check_shared(self._modules, self.ties)
        first = self._modules[0] if self._modules is not None else self.build(0)
        self.name = training.name or type(first).__name__
        self.fingerprint = self._fingerprint()

    # layers -----------------------------------------------------------------------------------

    def build(self, index: int) -> nn.Module:
        """A fresh copy of layer `index` with its initial weights (the global RNG is untouched);
        a meta layer materialised on the CPU (`_materialized`)."""
        if not 0 <= index < self.n_layers:
            raise IndexError(f"layer {index} out of range 0..{self.n_layers - 1}")
        if self._modules is not None:
            module = copy.deepcopy(self._modules[index])
            if self._materialize is not None:
                with torch.random.fork_rng(devices=[]):
                    _materialized(index, module, self._materialize)
            return module
        with torch.random.fork_rng(devices=[]):
            module = self._factory(index)
        if not isinstance(module, nn.Module):
            raise ModelError(f"layer {index}: the factory returned a {type(module).__name__}")
        return module

    def param_names(self, index: int, module: nn.Module) -> dict[str, str]:
        """{name inside layer `index`'s module: its name in the model's state_dict}."""
        names = self._names[index] if index < len(self._names) else {}
        return {
            local: names.get(local, f"{index}.{local}")
            for local, _ in module.named_parameters(remove_duplicate=False)
        }

    def optimize(self, index: int, module: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        """Layer `module`'s own optimizer and scheduler (None without one), over its trainable
        parameters as (model name, parameter) pairs: frozen ones (requires_grad False) get no
        optimizer state. A layer without trainable parameters (an activation, a reshape, a frozen
        block) gets a plain SGD over one empty placeholder: torch's optimizers refuse an empty
        parameter list, and the runtime treats every layer alike."""
        names = self.param_names(index, module)
        named = [(names[n], p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            opt: torch.optim.Optimizer = torch.optim.SGD([nn.Parameter(torch.empty(0))], lr=0.0)
            return opt, None
        opt = self.training.optimizer(named)
        sched = None if self.training.scheduler is None else self.training.scheduler(opt)
        return opt, sched

    def autocast(self, device: torch.device) -> Any:
        """The context of a forward (layers and loss) in the training's precision: torch.autocast
        to bf16 or fp16, nothing for fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def check_precision(self, device: torch.device) -> None:
        """ModelError naming the precision and the device when the device cannot run it."""
        precision = self.training.precision
        if self.autocast_dtype is None:
            return
        supported = torch.amp.is_autocast_available(device.type)
        if supported and device.type == "cuda" and self.autocast_dtype == torch.bfloat16:
            supported = torch.cuda.is_bf16_supported()
        if not supported:
            raise ModelError(f"precision {precision!r} is not supported on device {device}")

    def layer_name(self, index: int, module: nn.Module) -> str:
        return f"{index}:{type(module).__name__}"

    # data -------------------------------------------------------------------------------------

    def sample_ids(self, step: int, micro_batch: int, global_batch: int, size: int) -> range:
        """The sample POSITIONS of a micro-batch; `global_batch` is the job's B, whatever a plan
        trains (chameleond.worker._samples). `reader` maps positions to samples."""
        return samples.sample_ids(step, micro_batch, global_batch, size)

    def expect(self, step: int, micro_batches: Sequence[int], job_batch: int, size: int) -> None:
        """This worker reads `micro_batches` of `step` (one entry per read): the prefetcher prepares
        them in its thread (sampler.Prefetcher.expect)."""
        self._prefetcher.expect(step, micro_batches, job_batch, size)

    def batch(
        self, step: int, micro_batch: int, global_batch: int, size: int, device: torch.device
    ) -> Batch:
        """Global micro-batch `micro_batch` of step `step` of a job of global batch `global_batch`,
        collated, on `device`: prefetched if it was expected, else read here."""
        got = self._prefetcher.take((step, micro_batch, global_batch, size))
        self._read[(step, micro_batch)] = (got.samples, got.tokens)
        return to_device(got.batch, device, non_blocking=self._pin)

    def prepare_for(self, device: torch.device) -> None:
        """Batches are for `device`: on a CUDA device the prefetcher leaves them in page-locked
        memory, and `batch` copies them without waiting for the device."""
        self._pin = device.type == "cuda"

    def read_tokens(self, step: int, micro_batches: Sequence[int]) -> int:
        """`Training.tokens` of `micro_batches` of `step` as this worker read them, counted on
        the host when they were prepared (a count on the device would wait for it)."""
        return sum(self._read[(step, g)][1] for g in micro_batches if (step, g) in self._read)

    def read_ids(self, step: int, micro_batches: Sequence[int]) -> tuple[int, ...]:
        """The sample ids (a stream's: the index in its pass) of `micro_batches` of `step` as
        this worker read them; forgets every read of `step` and before."""
        ids = tuple(i for g in micro_batches for i in self._read.get((step, g), ((), 0))[0])
        for key in [k for k in self._read if k[0] <= step]:
            del self._read[key]
        return ids

    def data_stats(self) -> dict[str, float]:
        """Seconds spent preparing micro-batches (reading, collating), seconds the training thread
        waited for one, and `overlap`: the share of preparation hidden behind compute."""
        prepare, wait = self._prefetcher.prepare_seconds, self._prefetcher.wait_seconds
        overlap = min(1.0, max(0.0, 1.0 - wait / prepare)) if prepare > 0 else 0.0
        return {"prepare_seconds": prepare, "wait_seconds": wait, "overlap": overlap}

    def close(self) -> None:
        """Stops the prefetch thread; later reads are made in the reading thread."""
        self._prefetcher.close()

    def _prepare(self, key: sampler.Key, cancelled: sampler.Cancel = None) -> sampler.Prepared:
        positions = self.sample_ids(*key)
        ids, read = self.reader.read(positions, cancelled)
        batch = self.training.collate(read)
        tokens = self.tokens(batch)
        if self._pin:
            batch = pinned(batch)
        return sampler.Prepared(positions, tuple(ids), batch, tokens)

    def inputs(self, batch: Batch) -> torch.Tensor:
        return self.training.inputs(batch)

    def evaluation_steps(self) -> int:
        """How many evaluation steps of B samples `Training.evaluation`'s held-out set gives (0:
        no evaluation); ModelError naming what is wrong with it."""
        evaluation = self.training.evaluation
        if evaluation is None:
            return 0
        every = evaluation.every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ModelError(f"Evaluation.every must be an integer >= 1, got {every!r}")
        n = len(evaluation.dataset)
        samples = min(evaluation.samples or n, n)
        if samples < self.training.global_batch:
            raise ModelError(
                f"the evaluation set has {samples} samples, fewer than one global batch of "
                f"{self.training.global_batch}"
            )
        return samples // self.training.global_batch

    def tokens(self, batch: Batch) -> int:
        """The tokens of a micro-batch (`Training.tokens`), for the tokens/s figures."""
        return int(self.training.tokens(batch))

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
        h = hashlib.sha256(self.reader.name.encode())
        first = self._prepare((0, 0, self.training.global_batch, self.training.micro_batch))
        sampler.sample_digest(first.batch, h)
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
        self.tie_shapes: dict[Tie, tuple[torch.Size, torch.dtype]] = {}  # the parameter's
        self.trained_ties: tuple[Tie, ...] = ()  # the ties of trainable (not frozen) parameters
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
            self.tie_shapes[tie] = (a.shape, a.dtype)
            if a.requires_grad:
                self.trained_ties += (tie,)

    def _fingerprint(self) -> str:
        """Names the model in checkpoints: layers, parameter names and shapes, optimizer."""
        h = hashlib.sha256(f"{self.name}/{self.n_layers}".encode())
        for i in range(self.n_layers):
            module = self._modules[i] if self._modules is not None else self.build(i)
            for name, p in module.named_parameters():
                h.update(f"{i}.{name}:{tuple(p.shape)}:{p.dtype};".encode())
        return h.hexdigest()[:16]


def _materialized(index: int, module: nn.Module, fill: Callable[[int, nn.Module], None]) -> None:
    """Gives `module` (a copy of meta layer `index`) uninitialised CPU storage and lets `fill`
    write its values, without gradient tracking. Floating point tensors are first set to NaN, so
    one that `fill` leaves unwritten (in whole or in part) is found, as is one it leaves on meta
    (a submodule replaced by a meta one); an integer tensor counts as written when `fill` changed
    it in place or replaced it. ModelError names the layer and the tensor."""
    module.to_empty(device="cpu")
    before: dict[str, tuple[int, int, int]] = {}
    with torch.no_grad():
        for name, t in _tensors(module):
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
            before[name] = (id(t), t.data_ptr(), t._version)
        fill(index, module)
    where = f"layer {index} ({type(module).__name__})"
    for name, t in _tensors(module):
        if t.is_meta:
            raise ModelError(f"{where}: materialize left tensor {name!r} on the meta device")
        if t.is_floating_point() or t.is_complex():
            unwritten = bool(torch.isnan(t.detach()).any())
        else:
            unwritten = before.get(name) == (id(t), t.data_ptr(), t._version) and t.numel() > 0
        if unwritten:
            raise ModelError(
                f"{where}: materialize did not initialise tensor {name!r} (every value of "
                "every parameter and buffer must be written; a floating point one still holds "
                "NaN where it was not, or the source holds NaN)"
            )


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    params = module.named_parameters(remove_duplicate=False)
    buffers = module.named_buffers(remove_duplicate=False)
    return [*params, *((n, b) for n, b in buffers if b is not None)]


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
