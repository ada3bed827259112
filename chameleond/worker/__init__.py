"""The worker library: embed chameleond's fault-tolerant pipeline x data parallel training in a
training script (docs/worker-api.md).

    from chameleond.worker import Training, run

    sys.exit(run(Training(model=..., loss=..., dataset=..., optimizer=..., global_batch=...,
                          micro_batch=...)))

Needs torch (`pip install 'chameleond[worker]'`); nothing in the daemon imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from chameleond.extras import require

require("worker", "chameleon-worker")

from chameleond.worker.api import (  # noqa: E402
    Batch,
    DataError,
    Dataset,
    Evaluation,
    Factory,
    Job,
    Layers,
    Loss,
    MapDataset,
    Model,
    ModelError,
    NamedParameters,
    OptimizerFactory,
    Precision,
    SchedulerFactory,
    StepInfo,
    StreamDataset,
    Tie,
    Training,
    TrainingOf,
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
    (device cuda:LOCAL_RANK when CUDA is present). Typical use: `sys.exit(run(Training(...)))`.
    """
    from chameleond.worker.main import launch  # the command-line worker, itself a user of this API

    return launch(training, argv)


__all__ = [
    "Batch",
    "DataError",
    "Dataset",
    "Evaluation",
    "Factory",
    "Job",
    "Layers",
    "Loss",
    "MapDataset",
    "Model",
    "ModelError",
    "NamedParameters",
    "OptimizerFactory",
    "Precision",
    "SchedulerFactory",
    "StepInfo",
    "StreamDataset",
    "Tie",
    "Training",
    "TrainingOf",
    "default_collate",
    "default_inputs",
    "default_tokens",
    "run",
    "split",
]
