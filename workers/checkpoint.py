"""Per-worker checkpoints: the baseline that backup-free recovery is measured against.

With `--checkpoint-dir DIR --checkpoint-every N`, a worker writes the layers it owns (parameters
and AdamW state, the same flat buffers a migration sends) after every N-th committed step,
atomically, to `DIR/{worker}.pt`. A worker started with the same directory loads its file: its
layers come back at the checkpoint's step, and the generation's reconciliation (workers.migrate)
treats them like any other copy: the job resumes after the newest committed step any worker holds,
and copies behind it are replaced from current holders. No sample is repeated or skipped: the next
step follows the step the job resumes from.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from workers.model import LayerState
from workers.state import WorkerState

log = logging.getLogger("chameleon.worker")


def checkpoint_path(directory: Path, worker: str) -> Path:
    return directory / f"{worker}.pt"


def save(directory: Path, worker: str, state: WorkerState, owned: tuple[int, ...]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, worker)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "step": state.committed_step,
            "arch": asdict(state.arch),
            "layers": {i: state.layer(i).state_buffer().cpu() for i in owned},
        },
        tmp,
    )
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact
    return path


def load(directory: Path, worker: str, state: WorkerState) -> int | None:
    """Fill `state` from the worker's checkpoint; the step it holds, or None when there is none."""
    path = checkpoint_path(directory, worker)
    if not path.exists():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:
        log.warning("ignoring unreadable checkpoint %s: %s", path, e)
        return None
    if data.get("arch") != asdict(state.arch):
        log.warning("ignoring checkpoint %s: written for another model %s", path, data.get("arch"))
        return None
    step = int(data["step"])
    for i, buf in data["layers"].items():
        layer = LayerState(state.arch, int(i), state.device)
        layer.load_buffer(buf.to(state.device), step)
        state.layers[int(i)] = layer
    state.committed_step = step
    log.info("loaded checkpoint %s: step %d, layers %s", path, step, sorted(state.layers))
    return step
