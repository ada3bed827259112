"""`WorkerConfig`: which worker of which job a process is, and how it trains (`chameleon-worker`'s
flags, as `train` takes them), and the checks that tell a usable one apart."""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from chameleond.auth import Keyring
from chameleond.protocol import MAX_ID_LEN, url_error
from chameleond.worker._backend import DeviceChoice, parse_device
from chameleond.worker._saver import MODES, CheckpointMode

CPU = parse_device("cpu")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker of a job: `train`'s settings. `device` is a `DeviceChoice`
    (`parse_device("cuda:0")`; default the CPU)."""

    redis_url: str
    job: str
    worker_id: str
    device: DeviceChoice = CPU
    bind_address: str = "127.0.0.1"  # the collective backend listens on it and advertises it
    group_timeout: timedelta = timedelta(seconds=10)  # a collective's wait on a peer
    spec_timeout_seconds: float = 300.0  # how long to wait for the daemon to write the job's spec
    incarnation: str = ""  # this process among all processes of worker_id ("": a fresh one)
    max_steps: int = 0  # stop after committing step max_steps - 1; 0: train until fenced
    checkpoint_dir: Path | None = None  # shared by the job's workers, read at start
    checkpoint_every: int = 0  # steps between checkpoints; 0: none
    checkpoint_mode: CheckpointMode = (
        CheckpointMode.BUBBLE
    )  # in pipeline bubbles, or stop and write
    checkpoint_keep: int = 2  # each worker's newest files kept; older ones are deleted
    keyring: Keyring | None = None  # signs events, verifies plans and the spec (None: insecure)


def config_error(cfg: WorkerConfig) -> str | None:
    """Why `cfg` cannot be trained with, naming the field; None when it can. The checks that need
    the machine (the bind address, the checkpoint directory) included."""
    for name, value in (("worker_id", cfg.worker_id), ("job", cfg.job)):
        if not valid_id(value):
            return f"{name} {value!r}: expected a printable id without spaces"
    if not cfg.redis_url:
        return "redis_url: empty"
    if (why := url_error(cfg.redis_url)) is not None:
        return f"redis_url {why}"
    if timeout_of(cfg.group_timeout.total_seconds()) is None:
        return f"group_timeout {cfg.group_timeout}: expected more than 0 seconds"
    if cfg.max_steps < 0:
        return "max_steps must be >= 0"
    if cfg.checkpoint_every < 0 or (cfg.checkpoint_every and cfg.checkpoint_dir is None):
        return "checkpoint_every must be >= 0 and needs checkpoint_dir"
    if (
        isinstance(cfg.checkpoint_keep, bool)
        or not isinstance(cfg.checkpoint_keep, int)
        or cfg.checkpoint_keep < 1
    ):
        return f"checkpoint_keep {cfg.checkpoint_keep!r}: expected an integer >= 1"
    if cfg.checkpoint_mode not in MODES:
        return f"checkpoint_mode {cfg.checkpoint_mode!r}: expected one of {MODES}"
    if (why := bind_error(cfg.bind_address, cfg.device)) is not None:
        return f"bind_address {cfg.bind_address!r}: {why}"
    if cfg.checkpoint_dir is not None and (why := checkpoint_dir_error(cfg.checkpoint_dir)):
        return f"checkpoint_dir {cfg.checkpoint_dir}: {why}"
    return None


def valid_id(text: str) -> bool:
    return 0 < len(text) <= MAX_ID_LEN and text.isprintable() and not any(c.isspace() for c in text)


def timeout_of(seconds: float) -> timedelta | None:
    """`seconds` as a timedelta; None for nan, inf, <= 0 or more than a timedelta holds."""
    if not (math.isfinite(seconds) and seconds > 0):
        return None
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        return None


def checkpoint_dir_error(directory: Path) -> str | None:
    """Why checkpoints cannot be written to `directory` (created if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a regular file there, or in its path; no permission
        return f"not a usable directory ({e.strerror or e})"
    try:
        # Writing is the only reliable test (os.access ignores read-only mounts and ACLs).
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"not writable ({e.strerror or e})"
    return None


def bind_error(address: str, device: DeviceChoice) -> str | None:
    """Why the collective backend cannot listen on `address`, or None. gloo binds it for every
    group of every generation: an address of no local interface would fail each generation's
    build, and the worker would rebuild it forever."""
    if device.backend != "gloo":
        return None  # NCCL and HCCL pick their own interfaces
    try:
        dist.ProcessGroupGloo.create_device(hostname=address)
    except (RuntimeError, ValueError) as e:
        return f"not an address of this host ({e})"
    return None
