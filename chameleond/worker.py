"""The worker library: embed chameleond's fault-tolerant pipeline x data parallel training in a
training script (docs/worker-api.md).

    from chameleond.worker import Training, run

    sys.exit(run(Training(model=..., loss=..., dataset=..., optimizer=..., global_batch=...,
                          micro_batch=...)))

Needs torch (`pip install 'chameleond[worker]'`); nothing in the daemon imports this module.
"""

from __future__ import annotations

from workers.api import (
    Batch,
    DataError,
    Dataset,
    Factory,
    Job,
    Layers,
    Loss,
    Model,
    ModelError,
    OptimizerFactory,
    SchedulerFactory,
    Tie,
    Training,
    TrainingOf,
    default_collate,
    default_inputs,
    split,
)
from workers.main import run

__all__ = [
    "Batch",
    "DataError",
    "Dataset",
    "Factory",
    "Job",
    "Layers",
    "Loss",
    "Model",
    "ModelError",
    "OptimizerFactory",
    "SchedulerFactory",
    "Tie",
    "Training",
    "TrainingOf",
    "default_collate",
    "default_inputs",
    "run",
    "split",
]
