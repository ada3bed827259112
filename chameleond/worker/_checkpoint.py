"""Per-worker checkpoint files: the fallback when backup-free recovery is impossible, and the
baseline it is measured against.

With `--checkpoint-dir DIR --checkpoint-every N`, a worker writes the layers it owns (module,
optimizer and scheduler state, the byte buffers a migration sends: LayerState.state_buffer) after
every N-th committed step to `DIR/{worker}-{step}.safetensors`, keeping its two newest. How the
write is scheduled (in pipeline bubbles, or stopping training) is chameleond.worker._saver's
business; this module is the files.

The format is safetensors (an 8-byte little-endian header length, a JSON header, the raw bytes): one
uint8 tensor `layer.{i}` per layer, and the step, the worker and the model's fingerprint
(Trainable.fingerprint: its layers' parameter names and shapes) in the header's `__metadata__`. It
can be written a piece at a time (`FileWriter`), and any safetensors reader opens it. A file gets
its final name only once complete (written to `.tmp`, synced to disk, then renamed, and the rename
synced), so neither a killed process nor a crashed host leaves a partial checkpoint under a final
name.

A kill can interrupt one round of checkpoints, leaving workers at different steps, and a worker that
died long ago left only files of old steps; so a worker started with the same directory loads its
layers of the newest step whose readable files, together, hold every layer of the model (`load`; the
directory must be shared by the job's workers, as on one machine or a shared filesystem). Its layers
come back at that step and the generation's reconciliation (chameleond.worker._migrate) treats them
like any other copy; a worker without a file of that step loads nothing and receives its layers by
migration. No sample is repeated or skipped: the next step follows the step the job resumes from.

After each checkpoint the worker reports a `checkpoint` event (the step, the layers written). When
a fault leaves some layer with no copy in any worker's memory, the daemon publishes a `restore`
plan for the newest step whose files cover every layer (PAPER.md section 9): each worker of it
replaces what it holds by its layers of that step, read from whichever worker's file has them
(`restore`), and the job trains again from the next step. Without it such a fault ends the job.
A worker that finds some of its layers in no readable file of that step says so (`Unrestorable`,
reported as an `ack` with phase `unrestorable`), and the daemon restores an older step instead.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from chameleond.worker._layer import LayerState
from chameleond.worker._migrate import StateLost
from chameleond.worker._state import WorkerState
from chameleond.worker._trainable import Trainable

log = logging.getLogger("chameleon.worker")

KEEP = 2
SUFFIX = ".safetensors"


def checkpoint_path(directory: Path, worker: str, step: int) -> Path:
    return directory / f"{worker}-{step:09d}{SUFFIX}"


def written(directory: Path) -> dict[str, set[int]]:
    """worker -> steps with a complete checkpoint file in `directory`."""
    out: dict[str, set[int]] = {}
    for path in directory.glob(f"*-*{SUFFIX}"):
        worker, _, step = path.name.removesuffix(SUFFIX).rpartition("-")
        if step.isdigit():
            out.setdefault(worker, set()).add(int(step))
    return out


class FileWriter:
    """One checkpoint file, written piece by piece in the layers' order, then `commit`ted."""

    def __init__(
        self, directory: Path, worker: str, step: int, model: str, numel: Mapping[int, int]
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.worker, self.step = directory, worker, step
        self.path = checkpoint_path(directory, worker, step)
        self._tmp = self.path.with_suffix(".tmp")
        header: dict[str, Any] = {
            "__metadata__": {"step": str(step), "worker": worker, "model": model}
        }
        offset = 0
        for i, n in numel.items():
            header[f"layer.{i}"] = {
                "dtype": "U8",
                "shape": [n],
                "data_offsets": [offset, offset + n],
            }
            offset += n
        self.nbytes = offset  # the tensors' bytes (what a `checkpoint` event reports)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        self._data_start = 8 + len(text)
        self.size = self._data_start + offset  # the whole file: length, header, tensors
        self._end = 0  # where the next piece goes, by default (bytes after the header)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - open across a step's bubbles
        self._file.write(struct.pack("<Q", len(text)) + text)

    def write(self, piece: torch.Tensor, at: int | None = None) -> None:
        """A piece of the data, a flat uint8 tensor (copied to the host if elsewhere), at byte
        `at` of the data (default: after the previous piece). Writing a piece at its own offset
        again is harmless: one interrupted part way (a stop signal) is simply written again."""
        data = piece.detach().to("cpu", torch.uint8).contiguous()
        raw = data.numpy().data.cast("B")
        start = self._end if at is None else at
        if self._file.tell() != self._data_start + start:
            self._file.seek(self._data_start + start)
        self._file.write(raw)
        self._end = start + raw.nbytes

    def commit(self) -> Path:
        """Give the file its final name; delete this worker's files but the newest KEEP."""
        self._file.flush()
        # On disk before the rename: after a host crash the final name never shows a file whose
        # data was still in the page cache.
        os.fsync(self._file.fileno())
        self._file.close()
        size = os.path.getsize(self._tmp)
        if size != self.size:
            raise OSError(f"checkpoint {self._tmp} has {size} bytes, its header says {self.size}")
        os.replace(self._tmp, self.path)
        _sync_directory(self.directory)  # the rename itself survives a host crash
        for old in sorted(written(self.directory).get(self.worker, set()))[:-KEEP]:
            checkpoint_path(self.directory, self.worker, old).unlink(missing_ok=True)
        return self.path

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        # Some filesystems cannot sync a directory; the file itself is complete and renamed.
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def open_layers(
    directory: Path, worker: str, state: WorkerState, layers: Sequence[int]
) -> tuple[FileWriter, list[torch.Tensor]]:
    """The file of `layers` at the committed step, and the pieces to write to it, in order."""
    parts = {i: state.layer(i).state_parts() for i in layers}
    numel = {i: sum(p.numel() for p in ps) for i, ps in parts.items()}
    out = FileWriter(directory, worker, state.committed_step, state.model.fingerprint, numel)
    return out, [p for ps in parts.values() for p in ps]


def save(directory: Path, worker: str, state: WorkerState, owned: tuple[int, ...]) -> Path:
    """Write the layers `owned` at the committed step, all at once."""
    out, pieces = open_layers(directory, worker, state, owned)
    for piece in pieces:
        out.write(piece)
    return out.commit()


def read(path: Path) -> tuple[int, str, dict[int, torch.Tensor]]:
    """(step, model fingerprint, layer -> state buffer) of one file. Raises OSError or
    ValueError for a file that is not a complete checkpoint."""
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path}: not a checkpoint (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + n])
        meta = header.pop("__metadata__")
        step, model = int(meta["step"]), str(meta["model"])
        layers = {}
        for name, t in header.items():
            begin, end = (8 + n + o for o in t["data_offsets"])
            if t["dtype"] != "U8" or end > len(data) or name[:6] != "layer.":
                raise ValueError(f"tensor {name} is not a byte layer inside the file")
            layers[int(name[6:])] = torch.frombuffer(bytearray(data[begin:end]), dtype=torch.uint8)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: malformed checkpoint header ({e!r})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return step, model, layers


def _readable(path: Path, model: Trainable) -> dict[int, torch.Tensor] | None:
    """The layers of `path`, or None (logged) when it cannot be read or is of another model."""
    try:
        _, written_for, layers = read(path)
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable checkpoint %s: %s", path, e)
        return None
    if written_for != model.fingerprint:
        log.warning("ignoring checkpoint %s: written for another model %s", path, written_for)
        return None
    return layers


def _decode(
    model: Trainable, device: torch.device, layers: Mapping[int, torch.Tensor], step: int
) -> dict[int, LayerState]:
    """The layers of `layers`' buffers at `step`; ValueError for a buffer that does not load."""
    out = {}
    for i, buf in layers.items():
        out[i] = LayerState(model, i, device)
        out[i].load_buffer(buf, step)
    return out


def _gather(
    directory: Path, model: Trainable, step: int, layers: Collection[int]
) -> dict[int, torch.Tensor]:
    """Those of `layers` that some readable file of `step` holds, each from the first such file
    (by name)."""
    wanted = set(layers)
    found: dict[int, torch.Tensor] = {}
    for path in sorted(directory.glob(f"*-{step:09d}{SUFFIX}")):
        if wanted <= found.keys():
            break
        for i, buf in (_readable(path, model) or {}).items():
            if i in wanted:
                found.setdefault(i, buf)
    return found


def covering_step(directory: Path, model: Trainable) -> int | None:
    """The newest step whose readable files together hold every layer of the model, or None."""
    every = range(model.n_layers)
    steps = {s for per_worker in written(directory).values() for s in per_worker}
    for step in sorted(steps, reverse=True):
        if len(_gather(directory, model, step, every)) == model.n_layers:
            return step
    return None


class Unrestorable(StateLost):
    """This worker cannot load its layers of a restore plan's checkpoint step."""

    def __init__(self, step: int, why: str) -> None:
        super().__init__(why)
        self.step = step


def restore(directory: Path, state: WorkerState, step: int, layers: tuple[int, ...]) -> None:
    """Replace everything `state` holds by `layers` at `step`, from any worker's file of that step,
    and delete the files of later steps. Raises Unrestorable, with nothing changed, when some
    layer is in no readable file of the step."""
    found = _gather(directory, state.model, step, layers)
    missing = sorted(set(layers) - found.keys())
    if missing:
        why = f"no readable file of step {step} in {directory} has layers {_ranges(missing)}"
        raise Unrestorable(step, why)
    try:
        loaded = _decode(state.model, state.device, found, step)
    except ValueError as e:
        raise Unrestorable(step, f"a file of step {step} in {directory}: {e}") from e
    state.discard_step()
    state.layers = loaded
    state.committed_step = step
    log.info("restored layers %s from the checkpoint of step %d", sorted(found), step)
    # Later files describe a past the job now trains again: a later restore or restart must not
    # read them (every worker of the plan deletes them; the others are gone).
    for worker, steps in written(directory).items():
        for later in steps:
            if later > step:
                checkpoint_path(directory, worker, later).unlink(missing_ok=True)


def _ranges(layers: Sequence[int]) -> str:
    """Sorted layer ids as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    parts: list[list[int]] = []
    for i in layers:
        if parts and i == parts[-1][1] + 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def load(directory: Path, worker: str, state: WorkerState) -> int | None:
    """Fill `state` with this worker's layers of the newest step whose files cover every layer;
    that step, or None (nothing loaded)."""
    if not directory.is_dir() or not written(directory):
        return None
    # Not the newest step every worker wrote: a worker that died long ago kept only its oldest
    # files, and the survivors' later ones hold its layers too.
    step = covering_step(directory, state.model)
    if step is None:
        log.warning("no step's checkpoints in %s hold every layer: starting without one", directory)
        return None
    path = checkpoint_path(directory, worker, step)
    if not path.exists():
        log.info("no checkpoint of this worker at step %d: its layers come by migration", step)
        return None
    layers = _readable(path, state.model)
    if layers is None:
        return None
    try:
        state.layers.update(_decode(state.model, state.device, layers, step))
    except ValueError as e:
        log.warning("ignoring checkpoint %s: %s", path, e)
        return None
    state.committed_step = step
    log.info("loaded checkpoint %s: step %d, layers %s", path, step, sorted(layers))
    return step
