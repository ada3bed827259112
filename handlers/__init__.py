"""One handler per event type behind a small registry.

A handler takes the job, one validated event, its stream entry id and the time it was read, changes
the job, and says what happened (`Outcome`): the metric label, and whether the entry may be
acknowledged with this batch or only when the decision it feeds is committed. Handlers are
idempotent: a redelivered entry changes nothing the first delivery did not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chameleond.protocol import Event, EventError

if TYPE_CHECKING:
    from chameleond.daemon.job import Job


@dataclass(frozen=True)
class Outcome:
    label: str  # handled | duplicate (the chameleon_events_total outcome)
    owed: bool = False  # True: acknowledged by the commit of the decision it feeds

    @property
    def duplicate(self) -> bool:
        return self.label == "duplicate"


HANDLED = Outcome("handled")
DUPLICATE = Outcome("duplicate")
HANDLED_OWED = Outcome("handled", owed=True)
DUPLICATE_OWED = Outcome("duplicate", owed=True)

Handler = Callable[["Job", Event, str, float], Outcome]
HANDLERS: dict[str, Handler] = {}


def handles(kind: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        if kind in HANDLERS:
            raise RuntimeError(f"two handlers for {kind!r}")
        HANDLERS[kind] = fn
        return fn

    return register


def dispatch(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    """Run the event's handler. Raises EventError when the event is well-formed but unusable."""
    handler = HANDLERS.get(event.type)
    if handler is None:
        raise EventError(f"no handler for type {event.type!r}")
    return handler(job, event, entry_id, now)


def reported_generation(job: Job, event: Event) -> int:
    """The generation a worker's `step`, `ack` or `checkpoint` names, checked against the job.
    A worker the job does not know, or a generation the daemon never published, is an error
    (dead-lettered with the reason): counted as real, either would bend the throughput meter,
    the attempt gauge or the checkpoints."""
    if not job.knows(event.worker):
        raise EventError(f"{event.type} from {event.worker!r}, not a worker of job {job.name!r}")
    generation = int(event.get("generation"))  # validated by parse_event
    if generation > job.machine.generation:
        raise EventError(
            f"{event.type} of generation {generation}: the job has published only up to "
            f"{job.machine.generation}"
        )
    return generation


# Importing the modules registers their handlers.
from handlers import (  # noqa: E402
    ack,
    checkpoint,
    fault,
    heartbeat,
    profile,
    register,
    rejoin,
    step,
)

__all__ = [
    "DUPLICATE",
    "HANDLED",
    "HANDLERS",
    "Outcome",
    "ack",
    "checkpoint",
    "dispatch",
    "fault",
    "handles",
    "heartbeat",
    "profile",
    "register",
    "rejoin",
    "reported_generation",
    "step",
]
