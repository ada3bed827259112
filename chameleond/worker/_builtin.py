"""The built-in job, `chameleon-worker`'s default: the small transformer of chameleond.worker._model
on the byte corpus of chameleond.worker._data, per-layer AdamW. One user of the worker library like
any other: it gives a `Training` and nothing in the runtime knows it.

Its architecture comes from the job spec's [model.arch] table, so the training is built once the
spec is known (`training_of`, a `TrainingOf`).
"""

from __future__ import annotations

import functools

import torch

from chameleond.core.spec import SpecError
from chameleond.worker._data import Corpus
from chameleond.worker._model import Arch, ArchError, build_module, sample_losses
from chameleond.worker.api import Factory, Job, Training

SAMPLES = 1 << 62  # sample ids are offsets into the corpus: as many as a step counter reaches


class CorpusSamples:
    """The corpus as a map-style dataset: sample i is seq_len + 1 bytes (inputs, then targets
    shifted by one), at a fixed pseudo-random offset (chameleond.worker._data)."""

    def __init__(self, corpus: Corpus, seq_len: int) -> None:
        self.corpus, self.seq_len = corpus, seq_len

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.corpus.sample(index, self.seq_len)


def collate(samples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(samples)


def inputs(rows: torch.Tensor) -> torch.Tensor:
    return rows[:, :-1].contiguous()


def loss(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return sample_losses(logits, rows[:, 1:].contiguous())


def adamw(lr: float, named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(named, lr=lr)


def training(
    arch: Arch, global_batch: int, micro_batch: int, corpus: Corpus | None = None
) -> Training:
    return Training(
        model=Factory(arch.n_layers, functools.partial(build_module, arch)),
        loss=loss,
        dataset=CorpusSamples(corpus or Corpus(), arch.seq_len),
        optimizer=functools.partial(adamw, arch.lr),
        global_batch=global_batch,
        micro_batch=micro_batch,
        collate=collate,
        inputs=inputs,
        name="transformer",
    )


def training_of(job: Job) -> Training:
    """The built-in training for the spec's [model.arch] and [training] sizes; SpecError when
    [model.arch] is unusable."""
    try:
        arch = Arch.from_mapping(job.arch)
    except ArchError as e:
        raise SpecError(str(e)) from e
    return training(arch, job.global_batch, job.micro_batch)
