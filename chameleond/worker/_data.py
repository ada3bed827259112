"""The training data: a byte-level corpus every machine already has, and deterministic sample ids.

The corpus is the Python standard library's own `.py` sources (directories walked in sorted order,
site-packages excluded, the first `max_bytes`), so no download is needed and every worker running
the same Python version sees the same bytes; `digest` names the corpus so a mismatch between
machines is visible in the register event. Sample i is the window of seq_len + 1 bytes at a fixed
pseudo-random offset; step s trains sample ids [s*B, (s+1)*B), and global micro-batch g of that step
covers [s*B + g*mbs, s*B + (g+1)*mbs), B the job's global batch. Pipelines and micro-batches only
partition these ids, so no sample is repeated whatever the plan (a drop plan leaves some of a
step's micro-batches untrained: chameleond.worker._samples).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path

import torch

from chameleond.worker.api import DataError

DEFAULT_MAX_BYTES = 2 * 1024 * 1024
# Odd multiplier: consecutive sample ids land far apart in the corpus.
_STRIDE = 2_654_435_761
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CorpusError(DataError):
    """The standard library sources are missing or too small to train on."""


def stdlib_sources(root: Path | None = None) -> Iterator[Path]:
    """The standard library's .py files in a fixed order: directories walked in sorted order, files
    sorted within each; lazy, so reading stops as soon as enough bytes are in."""
    base = str(root or sysconfig.get_paths()["stdlib"])
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


class Corpus:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> None:
        chunks: list[bytes] = []
        total = 0
        for path in stdlib_sources(root):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        self.data = b"".join(chunks)[:max_bytes]
        if len(self.data) < 4096:
            where = root or sysconfig.get_paths()["stdlib"]
            raise CorpusError(f"standard library sources under {where} give {len(self.data)} bytes")
        self._tensor = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()[:16]

    def sample(self, sample_id: int, seq_len: int) -> torch.Tensor:
        """seq_len + 1 bytes (inputs and shifted targets) as int64."""
        span = len(self.data) - seq_len - 1
        off = (sample_id * _STRIDE) % span
        return self._tensor[off : off + seq_len + 1].long()

    def micro_batch(
        self, step: int, micro_batch: int, global_batch: int, micro_batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (micro_batch_size, seq_len), of global micro-batch
        `micro_batch`."""
        first = step * global_batch + micro_batch * micro_batch_size
        rows = torch.stack([self.sample(first + i, seq_len) for i in range(micro_batch_size)])
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
