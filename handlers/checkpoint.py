"""`checkpoint`: a worker wrote the layers it owns at a committed step to the job's checkpoint
directory. A step whose files together cover every layer is a checkpoint the daemon can restore
when backup-free recovery is impossible (decide(checkpoint_step=...), policy `restore`). A file
of a step after a restore's, written before that restore's generation, is stale: its worker
deletes it (workers.checkpoint.restore)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chameleond.protocol import Event, EventError, checkpoint_layers
from handlers import DUPLICATE, HANDLED, Outcome, handles, reported_generation

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@handles("checkpoint")
def handle_checkpoint(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    generation = reported_generation(job, event)
    layers = checkpoint_layers(event.get("layers"))  # validated by parse_event
    n = len(job.spec.layers)
    if max(layers) >= n:
        raise EventError(f"checkpoint of layer {max(layers)}: the job has layers 0-{n - 1}")
    step = int(event.get("step"))
    if not job.checkpoints.add(step, layers, generation):
        return DUPLICATE
    job.dirty = True
    return HANDLED
