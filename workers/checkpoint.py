"""Per-worker checkpoints: the baseline that backup-free recovery is measured against.

With `--checkpoint-dir DIR --checkpoint-every N`, a worker writes the layers it owns (parameters
and AdamW state, the same flat buffers a migration sends) after every N-th committed step,
atomically, to `DIR/{worker}-{step}.pt`, keeping its two newest. A kill can interrupt one round of
checkpoints, leaving workers at different steps; so a worker started with the same directory loads
the newest step that every worker in the directory has written (the directory must be shared by
the job's workers, as on one machine or a shared filesystem). Its layers come back at that step and
the generation's reconciliation (workers.migrate) treats them like any other copy. No sample is
repeated or skipped: the next step follows the step the job resumes from.

After each checkpoint the worker reports a `checkpoint` event (the step, the layers written). When
a fault leaves some layer with no copy in any worker's memory, the daemon publishes a `restore`
plan for the newest step whose files cover every layer (PAPER.md section 9): each worker of it
replaces what it holds by its layers of that step, read from whichever worker's file has them
(`restore`), and the job trains again from the next step. Without it such a fault ends the job.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from workers.migrate import StateLost
from workers.model import LayerState
from workers.state import WorkerState

log = logging.getLogger("chameleon.worker")


KEEP = 2


def checkpoint_path(directory: Path, worker: str, step: int) -> Path:
    return directory / f"{worker}-{step:09d}.pt"


def written(directory: Path) -> dict[str, set[int]]:
    """worker -> steps with a complete checkpoint file in `directory`."""
    out: dict[str, set[int]] = {}
    for path in directory.glob("*-*.pt"):
        worker, _, step = path.stem.rpartition("-")
        if step.isdigit():
            out.setdefault(worker, set()).add(int(step))
    return out


def save(directory: Path, worker: str, state: WorkerState, owned: tuple[int, ...]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, worker, state.committed_step)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "step": state.committed_step,
            "arch": asdict(state.arch),
            "layers": {i: state.layer(i).state_buffer().cpu() for i in owned},
        },
        tmp,
    )
    os.replace(tmp, path)  # a crash mid-write leaves no partial checkpoint under a final name
    for old in sorted(written(directory).get(worker, set()))[:-KEEP]:
        checkpoint_path(directory, worker, old).unlink(missing_ok=True)
    return path


def restore(directory: Path, state: WorkerState, step: int, layers: tuple[int, ...]) -> None:
    """Replace everything `state` holds by `layers` at `step`, from any worker's file of that step,
    and delete the files of later steps. Raises StateLost when some layer is in no readable file
    of the step."""
    found: dict[int, torch.Tensor] = {}
    for path in sorted(directory.glob(f"*-{step:09d}.pt")):
        if set(layers) <= found.keys():
            break
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError) as e:
            log.warning("ignoring unreadable checkpoint %s: %s", path, e)
            continue
        if data.get("arch") != asdict(state.arch):
            continue
        for i, buf in data["layers"].items():
            if int(i) in layers:
                found.setdefault(int(i), buf)
    missing = sorted(set(layers) - found.keys())
    if missing:
        raise StateLost(f"no checkpoint file of step {step} in {directory} has layers {missing}")
    state.discard_step()
    state.layers = {}
    for i, buf in found.items():
        layer = LayerState(state.arch, i, state.device)
        layer.load_buffer(buf.to(state.device), step)
        state.layers[i] = layer
    state.committed_step = step
    log.info("restored layers %s from the checkpoint of step %d", sorted(found), step)
    # Later files describe a past the job now trains again: a later restore or restart must not
    # read them (every worker of the plan deletes them; the others are gone).
    for worker, steps in written(directory).items():
        for later in steps:
            if later > step:
                checkpoint_path(directory, worker, later).unlink(missing_ok=True)


def load(directory: Path, worker: str, state: WorkerState) -> int | None:
    """Fill `state` from the newest step every worker checkpointed; that step, or None."""
    steps = written(directory) if directory.is_dir() else {}
    if worker not in steps:
        return None
    common = set.intersection(*steps.values())
    if not common:
        log.warning("checkpoints in %s share no step: starting without one", directory)
        return None
    step = max(common)
    path = checkpoint_path(directory, worker, step)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:
        log.warning("ignoring unreadable checkpoint %s: %s", path, e)
        return None
    if data.get("arch") != asdict(state.arch):
        log.warning("ignoring checkpoint %s: written for another model %s", path, data.get("arch"))
        return None
    for i, buf in data["layers"].items():
        layer = LayerState(state.arch, int(i), state.device)
        layer.load_buffer(buf.to(state.device), step)
        state.layers[int(i)] = layer
    state.committed_step = step
    log.info("loaded checkpoint %s: step %d, layers %s", path, step, sorted(state.layers))
    return step
