"""Hugging Face causal LMs whose layers live on the meta device: each worker materialises only the
layers it holds (`chameleond.worker.hf` re-exports these functions; docs/worker-api.md).

`pretrained_causal_lm(path)` starts from a `save_pretrained` directory. It reads config.json,
builds the class named in `config.architectures` on the meta device (shapes and dtypes, no
storage), cuts it with `split_causal_lm`, and returns `Layers` whose `materialize(i, module)`
reads layer i's tensors, and only those, from the directory's safetensors files (one
`model.safetensors`, or the shards listed by `model.safetensors.index.json`), by the layer's
model names (`Layers.names`). A tied copy whose name the files lack (GPT-2's `lm_head.weight`,
saved once as `transformer.wte.weight`) reads its tie's source tensor. Non-persistent buffers,
which no file holds (a rotary module's `inv_freq`), are computed again: a fresh module of the
same class is built on the CPU from the config and its buffers copied.

`weights_digest` names the weights without reading them all: a sha256 over config.json and, for
each safetensors file, its name, size, header (every tensor's name, dtype, shape and place) and
SAMPLES evenly spaced blocks of SAMPLE_BYTES of its data (a file smaller than that is hashed
whole). Another checkpoint of the same architecture (another fine-tune, another revision) differs
in its samples; a change confined to bytes between two samples goes unseen.

`causal_lm_from_config(config, seed)` starts from random weights: layer i is initialised by the
model's own `_init_weights` on its submodules (children before parents, as `transformers` does)
under a seed of its own, `seed * 1000003 + i`. Its values therefore differ from a model built
whole with the same seed (whose RNG runs through every layer in turn); a one-process loop that
must start equal to the split training starts from a `save_pretrained` directory instead.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from chameleond.worker import _safetensors as fmt
from chameleond.worker._hf_split import split_causal_lm
from chameleond.worker.api import Layers, ModelError, Tie

SAMPLES = 64  # blocks of each safetensors file's data in the weights digest
SAMPLE_BYTES = 4096
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def pretrained_causal_lm(
    path: str | Path, *, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> Layers:
    """The causal LM saved in directory `path` (`save_pretrained`) as meta layers, each read from
    the directory when a worker builds it (see the module doc). ModelError names a directory
    without config.json or safetensors weights, and a tensor the files lack."""
    directory = Path(path)
    config = _config(directory)
    model = _meta_model(config, attn_implementation, dtype)
    layers = _split(model)
    files = weight_files(directory)
    where = {name: f for f in files for name in _header(f) if name != "__metadata__"}
    reader = _Reader(directory, where, layers, _buffer_names(model, layers.modules), config)
    return replace(
        layers,
        materialize=reader,
        weights_digest=weights_digest(directory, files),
        meta=_meta(model),
    )


def causal_lm_from_config(
    config: Any,
    seed: int,
    *,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> Layers:
    """A causal LM of `config` with random weights, as meta layers each initialised when a worker
    builds it (see the module doc: its values are not those of the model built whole)."""
    model = _meta_model(config, attn_implementation, dtype)
    layers = _split(model)
    return replace(layers, materialize=_Init(model, layers, seed), meta=_meta(model))


def _split(model: nn.Module) -> Layers:
    # Imported here: chameleond.worker.hf re-exports this module's functions.

    return split_causal_lm(model)


def weights_digest(directory: Path, files: list[Path]) -> str:
    """config.json and each file's name, size, header and sampled data (the module doc)."""
    h = hashlib.sha256(b"config.json\0")
    h.update((directory / "config.json").read_bytes())
    for f in sorted(files):
        size = f.stat().st_size
        with f.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            h.update(f"\0{f.name}\0{size}\0".encode())
            h.update(stream.read(length))
            start = 8 + length
            data = size - start
            if data <= SAMPLES * SAMPLE_BYTES:
                h.update(stream.read())
                continue
            for k in range(SAMPLES):
                stream.seek(start + k * (data - SAMPLE_BYTES) // (SAMPLES - 1))
                h.update(stream.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a save_pretrained directory: the shards its index lists, or its
    single model.safetensors."""
    index = directory / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    raise ModelError(
        f"{directory} has neither {SINGLE} nor {INDEX}: save the model with "
        "save_pretrained(..., safe_serialization=True)"
    )


def _header(f: Path) -> dict[str, Any]:
    try:
        with f.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            header: dict[str, Any] = json.loads(stream.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ModelError(f"cannot read the safetensors header of {f}: {e}") from e
    return header


def _config(directory: Path) -> Any:
    if not (directory / "config.json").is_file():
        raise ModelError(f"{directory} has no config.json: not a save_pretrained directory")
    return transformers.AutoConfig.from_pretrained(directory, local_files_only=True)


def _meta_model(config: Any, attn_implementation: str, dtype: torch.dtype) -> nn.Module:
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ModelError(
            f"config.architectures {names!r} names no class of transformers "
            f"{transformers.__version__}"
        )
    with torch.device("meta"):
        model: nn.Module = cls._from_config(
            config, attn_implementation=attn_implementation, dtype=dtype
        )
    return model


def _meta(model: nn.Module) -> dict[str, str]:
    config = getattr(model, "config", None)
    assert config is not None
    return {"hf_class": type(model).__name__, "hf_config": config.to_json_string()}


def _buffer_names(model: nn.Module, modules: Any) -> list[dict[str, str]]:
    """Per layer, {buffer name inside the layer: its name in the model}, for the model's buffers
    that the layer holds."""
    owner = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
    return [
        {local: owner[id(b)] for local, b in m.named_buffers() if id(b) in owner} for m in modules
    ]


def _partners(ties: Any, names: Any) -> dict[tuple[int, str], str]:
    """(layer, local name) of each end of a tie -> the model name of its other end."""
    out: dict[tuple[int, str], str] = {}
    for tie in ties:
        assert isinstance(tie, Tie)
        for this, other in ((tie.first, tie.second), (tie.second, tie.first)):
            layer_names = names[other[0]] if other[0] < len(names) else {}
            out[this] = layer_names.get(other[1], f"{other[0]}.{other[1]}")
    return out


def _non_persistent(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, sub in module.named_modules():
        if sub._non_persistent_buffers_set & set(sub._buffers):
            yield name, sub


def _rebuild_buffers(index: int, module: nn.Module, config: Any) -> None:
    """Computes layer `index`'s non-persistent buffers again, from a fresh module of each owner's
    class built on the CPU from the config."""
    for name, sub in _non_persistent(module):
        try:
            with torch.device("cpu"):
                fresh = type(sub)(config=getattr(sub, "config", config))
        except TypeError as e:
            raise ModelError(
                f"layer {index}: {type(sub).__name__} {name!r} has non-persistent buffers "
                f"{sorted(sub._non_persistent_buffers_set)} and cannot be rebuilt from the "
                f"config ({e})"
            ) from e
        for buffer in sub._non_persistent_buffers_set & set(sub._buffers):
            target, value = sub._buffers[buffer], fresh._buffers.get(buffer)
            if target is not None and value is not None:
                with torch.no_grad():
                    target.copy_(value)


class _Reader:
    """`Layers.materialize` of a pretrained directory: layer i's tensors from its files."""

    def __init__(
        self,
        directory: Path,
        where: Mapping[str, Path],
        layers: Layers,
        buffer_names: list[dict[str, str]],
        config: Any,
    ) -> None:
        self.directory = directory
        self.where = dict(where)  # tensor name -> the file holding it
        self.names = list(layers.names)
        self.buffer_names = buffer_names
        self.partners = _partners(layers.ties, layers.names)
        self.config = config

    def __call__(self, index: int, module: nn.Module) -> None:
        wanted: dict[str, tuple[str, torch.Tensor]] = {}  # source tensor -> (local, target)
        names = self.names[index] if index < len(self.names) else {}
        for local, p in module.named_parameters(remove_duplicate=False):
            name = names.get(local, f"{index}.{local}")
            source = name if name in self.where else self.partners.get((index, local), name)
            wanted.setdefault(source, (local, p))
        non_persistent = {
            f"{n}.{b}" if n else b
            for n, s in _non_persistent(module)
            for b in s._non_persistent_buffers_set
        }
        for local, b in module.named_buffers(remove_duplicate=False):
            if local not in non_persistent:
                wanted.setdefault(self.buffer_names[index].get(local, local), (local, b))
        missing = [s for s in wanted if s not in self.where]
        if missing:
            raise ModelError(
                f"layer {index}: {self.directory} holds no tensor {missing[0]!r} (layer "
                f"{index}'s {wanted[missing[0]][0]!r}): is it a save_pretrained directory of "
                "this model class?"
            )
        by_file: dict[Path, list[str]] = {}
        for source in wanted:
            by_file.setdefault(self.where[source], []).append(source)
        for f, sources in sorted(by_file.items()):
            try:
                head = fmt.read_header(f)
                with f.open("rb") as stream:
                    for source in sources:
                        self._read(index, stream, head, source, wanted[source])
            except (OSError, ValueError) as e:
                raise ModelError(f"layer {index}: cannot read {f}: {e}") from e
        _rebuild_buffers(index, module, self.config)

    def _read(
        self,
        index: int,
        stream: io.BufferedReader,
        head: fmt.Header,
        source: str,
        target: tuple[str, torch.Tensor],
    ) -> None:
        """Tensor `source` of the open file read into `target`'s storage: only its bytes, with no
        copy of the file mapped or held (a host too small for the model reads its layers)."""
        local, tensor = target
        dtype, shape, begin, end = head.entries[source]
        if torch.Size(shape) != tensor.shape:
            raise ModelError(
                f"layer {index}: {self.directory}'s tensor {source!r} has shape "
                f"{tuple(shape)}, the model's {local!r} {tuple(tensor.shape)}"
            )
        stream.seek(head.data_start + begin)
        with torch.no_grad():
            if dtype == tensor.dtype and tensor.is_contiguous():
                into = tensor.detach().view(torch.uint8).reshape(-1).numpy().data
                if end - begin != into.nbytes or stream.readinto(into) != into.nbytes:
                    raise ValueError(f"tensor {source!r}: the file ends inside it")
                return
            raw = bytearray(end - begin)
            if stream.readinto(raw) != len(raw):
                raise ValueError(f"tensor {source!r}: the file ends inside it")
            tensor.copy_(torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape))


class _Init:
    """`Layers.materialize` from random weights: the model's own `_init_weights`, per layer."""

    def __init__(self, model: nn.Module, layers: Layers, seed: int) -> None:
        self.model = model  # on the meta device: its `_init_weights` and config
        self.modules = list(layers.modules)
        self.ties = list(layers.ties)
        self.seed = seed

    def __call__(self, index: int, module: nn.Module) -> None:
        self._init(index, module)
        for tie in self.ties:  # a tie's copy starts equal to its source, in an earlier layer
            if tie.second[0] == index:
                source = copy.deepcopy(self.modules[tie.first[0]])
                source.to_empty(device="cpu")
                self._init(tie.first[0], source)
                with torch.no_grad():
                    module.get_parameter(tie.second[1]).copy_(source.get_parameter(tie.first[1]))

    def _init(self, index: int, module: nn.Module) -> None:
        init_weights = getattr(self.model, "_init_weights")  # noqa: B009
        config = getattr(self.model, "config", None)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.seed * 1000003 + index)
            for sub in _children_first(module):
                for t in [sub, *sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
                    if getattr(t, "_is_hf_initialized", False):
                        delattr(t, "_is_hf_initialized")
                init_weights(sub)
            _rebuild_buffers(index, module, config)


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module
