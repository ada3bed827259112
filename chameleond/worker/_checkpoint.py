"""Per-worker checkpoint files: the fallback when backup-free recovery is impossible, and the
baseline it is measured against.

With `--checkpoint-dir DIR --checkpoint-every N`, a worker writes the layers it owns (module,
optimizer, scheduler and loss-scaler state) after every N-th committed step to
`DIR/{worker}-{step}.safetensors`, keeping its `--checkpoint-keep` newest (default 2); when
training ends (finished or stopped) it writes its last committed step too, unless that file exists
(chameleond.worker._runtime). How a write is scheduled (in pipeline bubbles, or stopping training)
is chameleond.worker._saver's business; this module is the files.

The format is safetensors (chameleond.worker._safetensors): `safetensors.torch.load_file(path)`
gives the model's own tensors under their names in the whole model's state_dict, with their
dtypes and shapes:

    {model name}                          every module state_dict entry of each layer held, but
                                          frozen parameters (LayerState.names: parameters'
                                          Trainable.param_names, buffers by their siblings' prefix,
                                          else "{layer}.{name in the layer}")
    optimizer.{param model name}.{key}    the optimizer's per-parameter tensors (step, exp_avg,
                                          exp_avg_sq, momentum_buffer, ...)
    state.{layer}                         only when a layer's non-tensor state is not JSON: it,
                                          torch.save'd, as uint8 (loaded with weights_only=True)

and the header's `__metadata__` (strings) holds `format`, `step`, `worker`, `model` (the
fingerprint: Trainable.fingerprint), `n_layers`, `layers` (a JSON list), every entry of
Trainable.meta (chameleond.worker.hf: `hf_class`, `hf_config`), and per layer `layer.{i}`, a JSON
object: `module` ({name in the layer: tensor name}), `optimizer` ([[param index, {state key:
tensor name}], ...]) and `rest` (JSON text of the layer's version, the optimizer's param_groups
and non-tensor per-parameter state, the scheduler's and the loss scaler's state_dict; tuples
tagged {"__tuple__": [...]}), or no `rest` when `state.{layer}` holds it. Loading rebuilds each
layer's state exactly as LayerState.load_buffer does from a migration's buffer (bit for bit).
`chameleonctl export --hf` (chameleond.cli.export) turns a step's files into a Hugging Face
model directory.

The header (names, dtypes, shapes, offsets) is fixed when a checkpoint begins, its tensors copied
to the host then; the data is then written a piece of about a MiB at a time (`FileWriter`). A file
gets its final name only once complete (written to `.tmp`, synced to disk, then renamed, and the
rename synced), so neither a killed process nor a crashed host leaves a partial checkpoint under a
final name.

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
import io
import json
import logging
import os
import pickle
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from chameleond.worker import _safetensors as fmt
from chameleond.worker._layer import LayerState, LayerTensors
from chameleond.worker._migrate import StateLost
from chameleond.worker._state import WorkerState
from chameleond.worker._trainable import Trainable

log = logging.getLogger("chameleon.worker")
FORMAT = "chameleond-checkpoint/2"  # the metadata's "format"

KEEP = 2  # files per worker kept by default (WorkerConfig.checkpoint_keep)
SUFFIX = ".safetensors"
OPTIMIZER = "optimizer."  # the prefix of optimizer tensors' names
STATE = "state."  # "state.{layer}": a layer's non-tensor state JSON cannot hold (torch.save)


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
    """One checkpoint file of `tensors` (CPU, contiguous), written piece by piece, then
    `commit`ted."""

    def __init__(
        self,
        directory: Path,
        worker: str,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str],
        keep: int = KEEP,
    ) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint_keep must be >= 1, got {keep}")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.worker, self.step, self.keep = directory, worker, step, keep
        self.path = checkpoint_path(directory, worker, step)
        self._tmp = self.path.with_suffix(".tmp")
        head = fmt.header(tensors, metadata)
        # the tensors' bytes (what a `checkpoint` event reports)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._data_start = len(head)
        self.size = self._data_start + self.nbytes  # the whole file: length, header, tensors
        self._end = 0  # where the next piece goes, by default (bytes after the header)
        self._file: IO[bytes] = open(self._tmp, "wb")  # noqa: SIM115 - open across bubbles
        self._file.write(head)

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
        """Give the file its final name; delete this worker's files but the newest `keep`."""
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
        for old in sorted(written(self.directory).get(self.worker, set()))[: -self.keep]:
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


def contents(
    state: WorkerState, layers: Sequence[int], worker: str
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[list[torch.Tensor]]]:
    """The tensors and the metadata of a file of `layers` at the committed step (copied to the
    CPU now), and the tensors again, by layer. ValueError naming a tensor two layers both
    name."""
    model = state.model
    tensors: dict[str, torch.Tensor] = {}
    metadata = {
        **model.meta,
        "format": FORMAT,
        "step": str(state.committed_step),
        "worker": worker,
        "model": model.fingerprint,
        "n_layers": str(model.n_layers),
        "layers": json.dumps(list(layers)),
    }
    by_layer: list[list[torch.Tensor]] = []
    for i in layers:
        saved = state.layer(i).state_tensors()
        by_layer.append(list(saved.tensors.values()))
        for name, t in saved.tensors.items():
            if name in tensors or name.startswith(STATE):
                raise ValueError(f"layer {i}: tensor {name} is named twice in the checkpoint")
            tensors[name] = t
        layout: dict[str, Any] = {"module": saved.module, "optimizer": saved.optimizer}
        rest = fmt.to_json(saved.rest)
        if rest is None:  # not JSON: torch.save, read back with weights_only=True
            out = io.BytesIO()
            torch.save(saved.rest, out)
            tensors[f"{STATE}{i}"] = torch.frombuffer(bytearray(out.getbuffer()), dtype=torch.uint8)
            by_layer[-1].append(tensors[f"{STATE}{i}"])
        else:
            layout["rest"] = rest
        metadata[f"layer.{i}"] = json.dumps(layout)
    return tensors, metadata, by_layer


def open_layers(
    directory: Path, worker: str, state: WorkerState, layers: Sequence[int], keep: int = KEEP
) -> tuple[FileWriter, list[torch.Tensor]]:
    """The file of `layers` at the committed step, and the pieces of its data to write to it, in
    order (the layers' state copied to the CPU now): each layer's bytes in pieces of a MiB, the
    last one of a layer shorter."""
    tensors, metadata, by_layer = contents(state, layers, worker)
    out = FileWriter(directory, worker, state.committed_step, tensors, metadata, keep)
    return out, [piece for held in by_layer for piece in fmt.pieces(held)]


def save(
    directory: Path, worker: str, state: WorkerState, owned: Sequence[int], keep: int = KEEP
) -> Path:
    """Write the layers `owned` at the committed step, all at once."""
    out, pieces = open_layers(directory, worker, state, owned, keep)
    for piece in pieces:
        out.write(piece)
    return out.commit()


@dataclass(frozen=True)
class Saved:
    """What one checkpoint file holds."""

    step: int
    model: str  # the fingerprint of the model it was written for
    metadata: dict[str, str]
    layers: dict[int, LayerTensors]


@dataclass(frozen=True)
class Listing:
    """A checkpoint file's header: its step, model, layers and where each layer's state is."""

    path: Path
    step: int
    model: str
    n_layers: int
    header: fmt.Header
    layouts: dict[int, dict[str, Any]]


def list_file(path: Path) -> Listing:
    """`path`'s header. OSError or ValueError (naming the file) for a file that is not a
    complete checkpoint."""
    try:
        head = fmt.read_header(path)
        meta = head.metadata
        layers = [int(i) for i in json.loads(meta["layers"])]
        layouts = {i: json.loads(meta[f"layer.{i}"]) for i in layers}
        return Listing(
            path, int(meta["step"]), str(meta["model"]), int(meta["n_layers"]), head, layouts
        )
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a checkpoint of this format ({e!r})") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read(path: Path, layers: Collection[int] | None = None) -> Saved:
    """The layers `layers` (default: all) of one file. OSError or ValueError (naming the file)
    for a file that is not a complete checkpoint."""
    found = list_file(path)
    wanted = found.layouts if layers is None else [i for i in found.layouts if i in layers]
    out = {}
    try:
        for i in wanted:
            layout = found.layouts[i]
            names = [*layout["module"].values()]
            names += [n for _, files in layout["optimizer"] for n in files.values()]
            if "rest" not in layout:
                names.append(f"{STATE}{i}")
            tensors = fmt.read_tensors(path, found.header, names)
            if "rest" in layout:
                rest = fmt.from_json(layout["rest"])
            else:
                raw = tensors.pop(f"{STATE}{i}").numpy().tobytes()
                rest = torch.load(io.BytesIO(raw), weights_only=True)
            optimizer = [(int(k), dict(files)) for k, files in layout["optimizer"]]
            out[i] = LayerTensors(tensors, dict(layout["module"]), optimizer, rest)
    except (KeyError, TypeError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise ValueError(f"{path}: malformed checkpoint ({e!r})") from None
    return Saved(found.step, found.model, found.header.metadata, out)


def _listed(path: Path, model: Trainable) -> Listing | None:
    """`path`'s header, or None (logged) when it cannot be read or is of another model."""
    try:
        found = list_file(path)
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable checkpoint %s: %s", path, e)
        return None
    if found.model != model.fingerprint:
        log.warning("ignoring checkpoint %s: written for another model %s", path, found.model)
        return None
    return found


def _decode(
    model: Trainable, device: torch.device, files: Mapping[Path, Collection[int]], step: int
) -> dict[int, LayerState]:
    """The layers `files` hold at `step`, read; OSError or ValueError for one that does not
    load."""
    out = {}
    for path, layers in files.items():
        for i, saved in read(path, layers).layers.items():
            out[i] = LayerState(model, i, device)
            out[i].load_state_tensors(saved, step)
    return out


def _gather(
    directory: Path, model: Trainable, step: int, layers: Collection[int]
) -> dict[Path, list[int]]:
    """Those of `layers` that some readable file of `step` holds, by the first such file (by
    name)."""
    wanted = set(layers)
    found: dict[int, Path] = {}
    for path in sorted(directory.glob(f"*-{step:09d}{SUFFIX}")):
        if wanted <= found.keys():
            break
        listed = _listed(path, model)
        for i in [] if listed is None else listed.layouts:
            if i in wanted:
                found.setdefault(i, path)
    out: dict[Path, list[int]] = {}
    for i, path in sorted(found.items()):
        out.setdefault(path, []).append(i)
    return out


def covering_step(directory: Path, model: Trainable) -> int | None:
    """The newest step whose readable files together hold every layer of the model, or None."""
    every = range(model.n_layers)
    steps = {s for per_worker in written(directory).values() for s in per_worker}
    for step in sorted(steps, reverse=True):
        found = _gather(directory, model, step, every)
        if sum(len(v) for v in found.values()) == model.n_layers:
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
    missing = sorted(set(layers) - {i for held in found.values() for i in held})
    if missing:
        why = f"no readable file of step {step} in {directory} has layers {_ranges(missing)}"
        raise Unrestorable(step, why)
    try:
        loaded = _decode(state.model, state.device, found, step)
    except (OSError, ValueError) as e:
        raise Unrestorable(step, f"a file of step {step} in {directory}: {e}") from e
    state.discard_step()
    state.layers = loaded
    state.committed_step = step
    log.info("restored layers %s from the checkpoint of step %d", sorted(loaded), step)
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
    listed = _listed(path, state.model)
    if listed is None:
        return None
    try:
        loaded = _decode(state.model, state.device, {path: list(listed.layouts)}, step)
    except (OSError, ValueError) as e:
        log.warning("ignoring checkpoint %s: %s", path, e)
        return None
    state.layers.update(loaded)
    state.committed_step = step
    log.info("loaded checkpoint %s: step %d, layers %s", path, step, sorted(loaded))
    return step
