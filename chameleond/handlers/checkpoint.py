"""`checkpoint`: a worker wrote the layers it owns at a committed step to the job's checkpoint
directory. A step whose files together cover every layer is a checkpoint the daemon can restore
when backup-free recovery is impossible (decide(checkpoint_step=...), policy `restore`). A file
of a step after a restore's, written before that restore's generation, is stale: its worker
deletes it (chameleond.worker._checkpoint.restore)."""

from __future__ import annotations

from chameleond.events import Checkpoint
from chameleond.handlers.outcome import DUPLICATE, HANDLED, Outcome, reported_generation
from chameleond.jobstate.change import SNAPSHOT
from chameleond.jobstate.job import Job
from chameleond.protocol import EventError


def handle_checkpoint(job: Job, event: Checkpoint, entry_id: str, now: float) -> Outcome:
    generation = reported_generation(job, event)
    layers = list(event.layers)
    n = len(job.spec.layers)
    if max(layers) >= n:
        raise EventError(f"checkpoint of layer {max(layers)}: the job has layers 0-{n - 1}")
    if not job.checkpoints.add(event.step, layers, generation):
        return DUPLICATE
    return HANDLED.having(SNAPSHOT)
