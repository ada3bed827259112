"""The safetensors file format, as checkpoints write and read it (chameleond.worker._checkpoint).

A file is an 8-byte little-endian header length, a JSON header (padded with spaces to a multiple
of 8 bytes), then the tensors' raw bytes, little-endian and contiguous, in the header's order:
{name: {"dtype", "shape", "data_offsets": [begin, end]}} with offsets into the data section, and
an optional "__metadata__" of string values. Here the header is built before any byte of data is
written (`header`), the data goes out in pieces of about a MiB (`pieces`), and a file is read
back tensor by tensor (`read_header`, `read_tensors`) without the `safetensors` package, which
the worker does not need (any safetensors reader opens the files).

Values that are not tensors go into the metadata as JSON (`to_json`, `from_json`): tuples are
tagged so that they come back as tuples, and a value that would not come back equal (a dict
with integer keys, an object JSON cannot hold) gives None, for the caller to store otherwise.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chameleond.worker._layer import CHUNK_BYTES

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
BY_NAME = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # a longer header is not one this library wrote
TUPLE = "__tuple__"


@dataclass(frozen=True)
class Header:
    """A file's header: its metadata, and name -> (dtype, shape, begin, end) in the data."""

    metadata: dict[str, str]
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]
    data_start: int  # where the data section begins in the file

    @property
    def size(self) -> int:
        """The whole file's bytes, as the header describes it."""
        return self.data_start + max((e[3] for e in self.entries.values()), default=0)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The length and the JSON header of a file of `tensors`, in their order. ValueError naming
    a tensor of a dtype safetensors has no name for."""
    out: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        out[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(out, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def pieces(tensors: Iterable[torch.Tensor], size: int = CHUNK_BYTES) -> list[torch.Tensor]:
    """The data section of a file of `tensors` as flat uint8 pieces of `size` bytes (the last
    one shorter): small tensors joined, large ones cut."""
    out: list[torch.Tensor] = []
    group: list[torch.Tensor] = []
    filled = 0
    for t in tensors:
        data = as_bytes(t)
        while data.numel():
            take = data[: size - filled]
            group.append(take)
            filled += take.numel()
            data = data[take.numel() :]
            if filled >= size:
                out.append(group[0] if len(group) == 1 else torch.cat(group))
                group, filled = [], 0
    if group:
        out.append(group[0] if len(group) == 1 else torch.cat(group))
    return out


def read_header(path: Path) -> Header:
    """`path`'s header. OSError when it cannot be read; ValueError naming what is wrong when it
    is not a complete safetensors file (a file cut short included)."""
    with path.open("rb") as f:
        start = f.read(8)
        if len(start) < 8:
            raise ValueError("not a checkpoint (too short)")
        (n,) = struct.unpack("<Q", start)
        if n > MAX_HEADER:
            raise ValueError(f"not a checkpoint (a header of {n} bytes)")
        text = f.read(n)
        total = f.seek(0, 2)
    try:
        raw = json.loads(text)
        metadata = raw.pop("__metadata__", None) or {}
        entries = {}
        for name, t in raw.items():
            begin, end = (int(o) for o in t["data_offsets"])
            shape = tuple(int(d) for d in t["shape"])
            entries[name] = (BY_NAME[t["dtype"]], shape, begin, end)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed header ({e!r})") from None
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("malformed header (metadata values must be strings)")
    found = Header(dict(metadata), entries, 8 + n)
    if total != found.size:
        raise ValueError(f"{total} bytes, its header says {found.size}")
    return found


def read_tensors(
    path: Path, head: Header, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors `names` (default: all) of the file `head` was read from."""
    out = {}
    with path.open("rb") as f:
        for name in head.entries if names is None else names:
            dtype, shape, begin, end = head.entries[name]
            f.seek(head.data_start + begin)
            raw = bytearray(end - begin)
            if f.readinto(raw) != len(raw):
                raise ValueError(f"tensor {name}: the file ends inside it")
            data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0)
            out[name] = data.to(torch.uint8).view(dtype).reshape(shape)
    return out


def to_json(value: Any) -> str | None:
    """`value` as JSON text that `from_json` turns back into an equal value of the same types;
    None when there is none."""
    try:
        text = json.dumps(_tag(value), allow_nan=True)
    except (TypeError, ValueError):
        return None
    return text if repr(from_json(text)) == repr(value) else None


def from_json(text: str) -> Any:
    return json.loads(text, object_hook=_untag)


def _tag(value: Any) -> Any:
    if isinstance(value, tuple):
        return {TUPLE: [_tag(v) for v in value]}
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, dict):
        return {k: _tag(v) for k, v in value.items()}
    return value


def _untag(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and TUPLE in obj:
        return tuple(obj[TUPLE])
    return obj
