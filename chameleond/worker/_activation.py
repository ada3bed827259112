"""Activations: what a layer takes and returns, and what travels between pipeline stages.

An activation is a tensor, a tuple or list of tensors, or a dict {str: tensor} (one level). Its
tensors' shapes may change from micro-batch to micro-batch (variable-length batches); its
`Structure` (the container, the dict's keys in order, each tensor's dtype) is fixed at a stage
boundary (chameleond.worker._validate finds it at start-up). Integer and bool tensors (attention
masks, position ids) travel forward only; floating tensors get a gradient back.

A layer may return a dict holding "aux_loss" (a scalar tensor, e.g. a MoE router's balancing
loss): `run_stage` removes it from what flows on and returns the stage's aux losses summed, which
the runtime adds to the step's loss sum, `aux_loss * samples` per micro-batch.

On the wire a forward message is a header (`encode_header`: a fixed-size int64 tensor holding each
tensor's dtype code and shape) followed by the tensors, one send each. The header's size depends on
the boundary's structure only (`header_size`), so the receiver allocates it before it arrives,
reads the shapes from it, then allocates the tensors (chameleond.worker._step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chameleond.worker.api import ModelError

AUX_LOSS = "aux_loss"
MAX_DIMS = 8  # dimensions a message's tensor may have
_SLOT = 2 + MAX_DIMS  # header words per tensor: dtype code, number of dims, the dims (padded)
# Wire codes of the dtypes an activation may hold (the index is the code).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODES = {d: i for i, d in enumerate(DTYPES)}

Activation = Any  # a tensor, a tuple/list of tensors or a dict {str: tensor}


@dataclass(frozen=True)
class Structure:
    """The fixed part of an activation: its container ("tensor", "tuple", "list" or "dict"), the
    dict's keys in order (empty otherwise), and each tensor's dtype, in flattening order."""

    kind: str
    keys: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def floating(self) -> tuple[int, ...]:
        """The positions of the floating tensors: those a gradient flows back to."""
        return tuple(i for i, d in enumerate(self.dtypes) if d.is_floating_point)

    def __str__(self) -> str:
        dtypes = [str(d).removeprefix("torch.") for d in self.dtypes]
        if self.kind == "tensor":
            return f"a {dtypes[0]} tensor"
        names = self.keys or tuple(map(str, range(len(dtypes))))
        entries = ", ".join(f"{n}: {d}" for n, d in zip(names, dtypes, strict=True))
        return f"a {self.kind} ({entries})"


def flatten(
    activation: Activation, what: str = "an activation"
) -> tuple[Structure, list[torch.Tensor]]:
    """(structure, tensors in order); ModelError naming `what` for a value that is no
    activation."""
    keys: tuple[str, ...] = ()
    tensors: list[Any]
    if isinstance(activation, torch.Tensor):
        kind, tensors = "tensor", [activation]
    elif isinstance(activation, Mapping):
        kind, tensors = "dict", list(activation.values())
        if not all(isinstance(k, str) for k in activation):
            raise ModelError(f"{what} is a dict whose keys are not all strings: {list(activation)}")
        keys = tuple(activation)
    elif isinstance(activation, tuple | list):
        kind = "tuple" if isinstance(activation, tuple) else "list"
        tensors = list(activation)
    else:
        raise ModelError(
            f"{what} is a {type(activation).__name__}: expected a tensor, a tuple or list of "
            "tensors, or a dict of str to tensor"
        )
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            name = keys[i] if keys else i
            raise ModelError(
                f"{what} holds a {type(t).__name__} at {name!r}: an activation's values are tensors"
            )
    return Structure(kind, keys, tuple(t.dtype for t in tensors)), tensors


def unflatten(structure: Structure, tensors: Sequence[torch.Tensor]) -> Activation:
    """The activation of `structure` holding `tensors` (flatten's inverse)."""
    if structure.kind == "tensor":
        return tensors[0]
    if structure.kind == "dict":
        return dict(zip(structure.keys, tensors, strict=True))
    return tuple(tensors) if structure.kind == "tuple" else list(tensors)


def header_size(structure: Structure) -> int:
    """The int64 words of a forward message's header at a boundary of `structure`."""
    return _SLOT * len(structure.dtypes)


def encode_header(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The header of a forward message of `tensors`, on the CPU: per tensor its dtype's code, its
    number of dimensions and its dimensions, padded to MAX_DIMS."""
    words: list[int] = []
    for t in tensors:
        if t.dtype not in _CODES or t.dim() > MAX_DIMS:
            raise ModelError(
                f"a {t.dtype} tensor of shape {tuple(t.shape)} cannot travel between stages: "
                f"dtypes {', '.join(map(str, DTYPES))}, at most {MAX_DIMS} dimensions"
            )
        words += [_CODES[t.dtype], t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]
    return torch.tensor(words, dtype=torch.int64)


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of each tensor of a forward message, from its header."""
    words = header.tolist()
    out = []
    for i in range(0, len(words), _SLOT):
        code, ndim = words[i], words[i + 1]
        out.append((DTYPES[code], tuple(words[i + 2 : i + 2 + ndim])))
    return out


def split_aux(output: Activation, what: str = "a layer") -> tuple[Activation, torch.Tensor | None]:
    """(output without "aux_loss", the aux loss or None). The aux loss must be a scalar tensor."""
    if not isinstance(output, Mapping) or AUX_LOSS not in output:
        return output, None
    aux = output[AUX_LOSS]
    if not isinstance(aux, torch.Tensor) or aux.dim() != 0:
        shown = tuple(aux.shape) if isinstance(aux, torch.Tensor) else type(aux).__name__
        raise ModelError(f"{what} returned an aux_loss that is not a scalar tensor: {shown}")
    return {k: v for k, v in output.items() if k != AUX_LOSS}, aux


def run_stage(
    modules: Sequence[torch.nn.Module], x: Activation
) -> tuple[Activation, torch.Tensor | None]:
    """Run `modules` in order on `x`: (the last one's output without its aux loss, the sum of the
    aux losses the modules returned, or None)."""
    aux_sum: torch.Tensor | None = None
    for module in modules:
        x, aux = split_aux(module(x), type(module).__name__)
        if aux is not None:
            aux_sum = aux if aux_sum is None else aux_sum + aux
    return x, aux_sum


def nbytes(activation: Activation) -> int:
    """The bytes of an activation's tensors."""
    return sum(t.numel() * t.element_size() for t in flatten(activation)[1])
