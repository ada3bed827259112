"""One layer as a worker holds it: the user's module, its own optimizer and scheduler, and the last
committed step it reflects.

Per-layer optimizers are exactly one optimizer over all parameters for every element-wise
optimizer (SGD, Adam, AdamW, ...); global gradient clipping is one factor for every layer, decided
at the step's commit (chameleond.worker._commit). Moving a layer moves its whole state: the module's
state_dict (buffers and trainable parameters), the optimizer's and the scheduler's, and in fp16
the loss scale, as one serialized byte buffer (`state_buffer`), bit for bit. A checkpoint file
holds the same state as named tensors instead (`state_tensors`, `load_state_tensors`: module
entries under their names in the whole model, optimizer state beside them), so that any
safetensors reader sees the model's weights. Frozen parameters
(requires_grad False) never change in training: they are left out, and a layer that arrives
takes them from its build (the initial or pretrained weights), so a LoRA model moves and
checkpoints its adapters only.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from chameleond.worker._commit import LossScale, seed
from chameleond.worker._trainable import Trainable
from chameleond.worker.api import ModelError

CHUNK_BYTES = 1 << 20  # a checkpoint writes its data in pieces of this size


@dataclass
class LayerTensors:
    """A layer's state as a checkpoint file holds it (chameleond.worker._checkpoint): its tensors
    under their names in the whole model, where each goes back, and everything that is not a
    tensor."""

    tensors: dict[str, torch.Tensor]  # file name -> a CPU copy, contiguous
    module: dict[str, str]  # module state_dict key -> file name
    optimizer: list[tuple[int, dict[str, str]]]  # optimizer param index -> {state key: file name}
    # The layer's version, the optimizer's param_groups and non-tensor per-parameter state
    # ([index, {key: value}] pairs), the scheduler's and the loss scaler's state_dict, and any
    # non-tensor module state_dict entry.
    rest: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        """The layer's state in LayerState.state_dict's form."""
        other = {int(i): dict(values) for i, values in self.rest["optimizer_state"]}
        state = {
            i: {**{k: self.tensors[n] for k, n in names.items()}, **other.pop(i, {})}
            for i, names in self.optimizer
        }
        state.update(other)
        module = {k: self.tensors[n] for k, n in self.module.items()}
        return {
            "module": {**module, **self.rest["module"]},
            "optimizer": {"state": state, "param_groups": self.rest["param_groups"]},
            "scheduler": self.rest["scheduler"],
            "scaler": self.rest["scaler"],
        }


def state_names(index: int, module: torch.nn.Module, params: Mapping[str, str]) -> dict[str, str]:
    """{module state_dict key: its name in the whole model}. Parameters have theirs (`params`,
    Trainable.param_names); a buffer gets the model prefix its sibling parameters' names imply
    (a submodule whose parameter `attn.c.weight` is `h.0.attn.c.weight` in the model maps
    `attn.bias` to `h.0.attn.bias`), else "{index}.{key}"."""
    prefixes: dict[str, str] = {}  # a module path inside the layer -> its prefix in the model
    for local, full in params.items():
        parts = local.split(".")
        for k in range(len(parts)):
            rest = ".".join(parts[k:])
            if full == rest or full.endswith("." + rest):
                prefixes.setdefault(".".join(parts[:k]), full[: len(full) - len(rest)])
    out = {}
    for key in module.state_dict(keep_vars=True):
        if key in params:
            out[key] = params[key]
            continue
        parts = key.split(".")
        out[key] = f"{index}.{key}"
        for k in range(len(parts) - 1, -1, -1):
            inner = ".".join(parts[:k])
            if inner in prefixes:
                out[key] = prefixes[inner] + ".".join(parts[k:])
                break
    return out


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    c = t.detach().to("cpu", copy=True)
    return c if c.is_contiguous() else c.contiguous()


class LayerState:
    """One layer's module, optimizer and scheduler, and the last committed step they reflect."""

    def __init__(
        self, model: Trainable, index: int, device: torch.device, version: int = -1
    ) -> None:
        self.index = index
        self.device = device
        self.module = model.build(index).to(device)
        self.optimizer, self.scheduler = model.optimize(index, self.module)
        named = list(self.module.named_parameters(remove_duplicate=False))
        self.frozen = frozenset(n for n, p in named if not p.requires_grad)
        # Read at every step: listed once (loading a state copies into these same tensors).
        self._named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self._params = [p for _, p in self._named]
        fp16 = model.training.precision == "fp16"
        self.loss_scale = LossScale(model.training.loss_scale) if fp16 else None
        self.version = version  # -1: initial weights, no step applied yet
        # Module state_dict key -> its name in the whole model (checkpoint files use these).
        self.names = state_names(index, self.module, model.param_names(index, self.module))
        kept = [n for k, n in self.names.items() if k not in self.frozen]
        if len(set(kept)) != len(kept):
            twice = sorted({n for n in kept if kept.count(n) > 1})
            raise ModelError(
                f"layer {index} ({type(self.module).__name__}): several of its tensors are named "
                f"{', '.join(twice)} in the model: give each its own name (Layers.names)"
            )

    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters: the ones with gradients, synced and updated."""
        return self._params

    def named_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self._named

    @property
    def scale(self) -> float:
        return 1.0 if self.loss_scale is None else self.loss_scale.scale

    def seed(self, global_batch: int) -> float:
        """The backward seed of a step's loss sum over `global_batch` samples (commit.seed)."""
        return seed(None if self.loss_scale is None else self.loss_scale.scale, global_batch)

    def apply_update(
        self, global_batch: int, step: int, factor: float = 1.0, overflow: bool = False
    ) -> None:
        """Gradients hold the SUM over the global batch: divide once by B and multiply by
        `factor` (unscale and clip, chameleond.worker._commit), then the optimizer and the
        scheduler step (`step_optimizer`). An fp16 `overflow` skips the optimizer's step
        (GradScaler's rule); the scheduler steps all the same, as a one-process loop steps it
        every iteration."""
        if not overflow:
            scale_gradients(self.gradients(), global_batch, factor)
        self.step_optimizer(step, overflow)

    def gradients(self) -> list[torch.Tensor]:
        """The trainable parameters' gradients; zeros for a parameter that got none."""
        grads = []
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        return grads

    def step_optimizer(self, step: int, overflow: bool = False) -> None:
        """The optimizer's step over gradients already divided and scaled (unless `overflow`),
        the scheduler's, and the gradients cleared: the layer now reflects `step`."""
        if not overflow:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_scale is not None:
            self.loss_scale.update(overflow)
        self.version = step

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # Migration and checkpoints: the state as one byte buffer, or as named tensors ----------

    def state_dict(self) -> dict[str, Any]:
        module = {k: v for k, v in self.module.state_dict().items() if k not in self.frozen}
        return {
            "module": module,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.loss_scale is None else self.loss_scale.state_dict(),
        }

    def state_buffer(self) -> torch.Tensor:
        """The state serialized (torch.save) into a flat uint8 tensor on the CPU."""
        out = io.BytesIO()
        torch.save(self.state_dict(), out)
        return torch.frombuffer(bytearray(out.getbuffer()), dtype=torch.uint8)

    def state_tensors(self) -> LayerTensors:
        """The state for a checkpoint file, copied to the CPU now: the module's state_dict but
        frozen parameters under the entries' model names (`names`), the optimizer's per-parameter
        tensors under "optimizer.{parameter's model name}.{state key}", and the rest."""
        tensors: dict[str, torch.Tensor] = {}
        module: dict[str, str] = {}
        rest_module: dict[str, Any] = {}
        for key, value in self.module.state_dict().items():
            if key in self.frozen:
                continue
            if isinstance(value, torch.Tensor):
                module[key] = self.names[key]
                tensors[module[key]] = _host_copy(value)
            else:
                rest_module[key] = value
        saved = self.optimizer.state_dict()
        names = self._optimizer_names(saved["param_groups"])
        optimizer: list[tuple[int, dict[str, str]]] = []
        other: list[list[Any]] = []
        for i, values in saved["state"].items():
            base = names.get(i, f"{self.index}.#{i}")  # a parameter not in the module
            files, plain = {}, {}
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    files[key] = f"optimizer.{base}.{key}"
                    tensors[files[key]] = _host_copy(value)
                else:
                    plain[key] = value
            optimizer.append((i, files))
            if plain:
                other.append([i, plain])
        rest = {
            "version": self.version,
            "module": rest_module,
            "param_groups": saved["param_groups"],
            "optimizer_state": other,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.loss_scale is None else self.loss_scale.state_dict(),
        }
        return LayerTensors(tensors, module, optimizer, rest)

    def _optimizer_names(self, groups: list[dict[str, Any]]) -> dict[int, str]:
        """The optimizer state_dict's parameter indices -> the parameters' model names."""
        local: dict[int, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            local.setdefault(id(p), name)
        out = {}
        for saved, live in zip(groups, self.optimizer.param_groups, strict=True):
            for i, p in zip(saved["params"], live["params"], strict=True):
                if id(p) in local:
                    out[i] = self.names[local[id(p)]]
        return out

    def load_state_tensors(self, saved: LayerTensors, version: int) -> None:
        """Replace the state by one `state_tensors` gave (read back from a checkpoint file), as
        `load_buffer` does; ValueError naming the layer when it does not fit."""
        try:
            self._load_state(saved.state_dict())
        except (RuntimeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"layer {self.index}: unusable checkpoint state ({e})") from e
        self.version = version

    def check_movable(self) -> None:
        """ModelError naming the layer and the types, when its state holds objects other than
        tensors and plain Python values (a user's class in the optimizer's or the scheduler's
        state_dict): a migration or a restore loads states with `weights_only=True`, which
        refuses them. Checked at start-up, after the profile's real optimizer step, so the user
        learns it before training rather than at the first migration."""
        out = io.BytesIO()
        torch.save(self.state_dict(), out)
        out.seek(0)
        _refuse_unsafe(self.index, self.module, out)

    def load_buffer(self, buf: torch.Tensor, version: int) -> None:
        """Replace the state by a `state_buffer` (from a peer or a checkpoint file). ModelError
        (a user error, not a fault to retry) when it holds types `weights_only` refuses."""
        raw = buf.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes()
        try:
            state = torch.load(io.BytesIO(raw), map_location=self.device, weights_only=True)
            self._load_state(state)
        except (
            RuntimeError,
            KeyError,
            TypeError,
            ValueError,
            EOFError,
            pickle.UnpicklingError,
        ) as e:
            if isinstance(e, pickle.UnpicklingError):
                _refuse_unsafe(self.index, self.module, io.BytesIO(raw))
            raise ValueError(f"layer {self.index}: unusable state buffer ({e})") from e
        self.version = version

    def _load_state(self, state: dict[str, Any]) -> None:
        """Load a `state_dict` into the module, the optimizer, the scheduler and the scaler."""
        found = self.module.load_state_dict(state["module"], strict=False)
        missing = set(found.missing_keys) - self.frozen
        if missing or found.unexpected_keys:
            raise KeyError(
                f"module state: missing {sorted(missing)}, unexpected "
                f"{sorted(found.unexpected_keys)}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.loss_scale is not None and state.get("scaler") is not None:
            self.loss_scale.load_state_dict(state["scaler"])


def _refuse_unsafe(index: int, module: torch.nn.Module, saved: io.BytesIO) -> None:
    """Raise ModelError naming the types in a saved state that `weights_only` loading refuses."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(saved)
    except (RuntimeError, ValueError, pickle.UnpicklingError):  # not a readable state at all
        return
    if unsafe:
        raise ModelError(
            f"layer {index} ({type(module).__name__}): its state holds {', '.join(unsafe)}, "
            "which moving or restoring a layer cannot load (torch.load(weights_only=True) "
            "takes tensors and plain Python values only): keep such objects out of the "
            "optimizer's and the scheduler's state_dict, or register them with "
            "torch.serialization.add_safe_globals in the training script"
        )


def scale_gradients(grads: list[torch.Tensor], global_batch: int, factor: float) -> None:
    """Multiply gradient sums by `factor / global_batch` (their mean, unscaled and clipped): one
    pass over them, in one multi-tensor launch for all of them, not one per parameter (nor per
    layer). On an accelerator the update runs after the commit vote's wait, where every launch
    is the device's idle time. For a power-of-two batch the bits are those of dividing by it,
    then multiplying by `factor`."""
    if grads:
        torch._foreach_mul_(grads, factor / global_batch)
