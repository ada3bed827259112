"""The worker library: embed chameleond's fault-tolerant pipeline x data parallel training in a
training script (docs/worker-api.md).

    from chameleond.worker import Training, run

    sys.exit(run(Training(model=..., loss=..., dataset=..., optimizer=..., global_batch=...,
                          micro_batch=...)))

`run` is the command line (flags, logging, signals, exit codes); `train(training,
WorkerConfig(...))` is the same training as a library call: it returns a `TrainingResult` or
raises a `WorkerError`.

Needs torch (`pip install 'chameleond[worker]'`); nothing in the daemon imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from chameleond.extras import require

require("worker", "chameleon-worker")

from chameleond.worker._backend import DeviceChoice, parse_device  # noqa: E402
from chameleond.worker._config import WorkerConfig  # noqa: E402
from chameleond.worker._library import train  # noqa: E402
from chameleond.worker._sampler import permutation  # noqa: E402
from chameleond.worker._saver import CheckpointMode  # noqa: E402
from chameleond.worker.api import (  # noqa: E402
    BackendUnavailable,
    Batch,
    ConfigError,
    DataError,
    Dataset,
    DeviceFailed,
    Ending,
    Evaluation,
    Factory,
    Job,
    JobSpecError,
    Layers,
    Loss,
    MapDataset,
    Model,
    ModelError,
    NamedParameters,
    OptimizerFactory,
    Precision,
    RedisUnavailable,
    SchedulerFactory,
    StepInfo,
    StreamDataset,
    Tie,
    Training,
    TrainingOf,
    TrainingResult,
    WorkerError,
    default_collate,
    default_inputs,
    default_tokens,
    split,
)


def run(training: Training | TrainingOf, argv: Sequence[str] | None = None) -> int:
    """Train as one worker of a chameleond job until fenced, finished or stopped; the exit code.

    The worker's identity and the job come from `argv` (default: the command line, the flags of
    `chameleon-worker`), else from the environment: CHAMELEON_REDIS_URL, CHAMELEON_JOB,
    CHAMELEON_WORKER_ID, or a launcher's RANK / SLURM_PROCID (worker id `w{RANK}`) and LOCAL_RANK
    (device cuda:LOCAL_RANK when CUDA is present). Typical use: `sys.exit(run(Training(...)))`;
    `train` is the same training without the command line.
    """
    from chameleond.worker._main import launch  # the command-line worker, itself a user of this API

    return launch(training, argv)


__all__ = [
    "BackendUnavailable",
    "Batch",
    "CheckpointMode",
    "ConfigError",
    "DataError",
    "Dataset",
    "DeviceChoice",
    "DeviceFailed",
    "Ending",
    "Evaluation",
    "Factory",
    "Job",
    "JobSpecError",
    "Layers",
    "Loss",
    "MapDataset",
    "Model",
    "ModelError",
    "NamedParameters",
    "OptimizerFactory",
    "Precision",
    "RedisUnavailable",
    "SchedulerFactory",
    "StepInfo",
    "StreamDataset",
    "Tie",
    "Training",
    "TrainingOf",
    "TrainingResult",
    "WorkerConfig",
    "WorkerError",
    "default_collate",
    "default_inputs",
    "default_tokens",
    "parse_device",
    "permutation",
    "run",
    "split",
    "train",
]
