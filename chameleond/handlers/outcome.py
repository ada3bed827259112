"""What a handler says happened, and the check every worker report shares."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from chameleond.events import Ack, Checkpoint, Step
from chameleond.jobstate.change import UNCHANGED, Change
from chameleond.jobstate.job import Job
from chameleond.protocol import EventError


class EventOutcome(StrEnum):
    """The `outcome` label of chameleon_events_total: what became of one event. A handler says
    handled or duplicate; an event the protocol rejects is counted invalid (dead-lettered)."""

    HANDLED = "handled"
    INVALID = "invalid"
    DUPLICATE = "duplicate"


@dataclass(frozen=True)
class Outcome:
    label: EventOutcome  # HANDLED | DUPLICATE
    owed: bool = False  # True: acknowledged by the commit of the decision it feeds
    change: Change = UNCHANGED  # what the daemon must make durable (snapshot, records)

    @property
    def duplicate(self) -> bool:
        return self.label is EventOutcome.DUPLICATE

    def having(self, change: Change) -> Outcome:
        """This outcome, with `change` on top of what it changed already."""
        return replace(self, change=self.change | change) if change else self


HANDLED = Outcome(EventOutcome.HANDLED)
DUPLICATE = Outcome(EventOutcome.DUPLICATE)
HANDLED_OWED = Outcome(EventOutcome.HANDLED, owed=True)
DUPLICATE_OWED = Outcome(EventOutcome.DUPLICATE, owed=True)


def reported_generation(job: Job, event: Step | Ack | Checkpoint) -> int:
    """The generation a worker's `step`, `ack` or `checkpoint` names, checked against the job.
    A worker the job does not know, or a generation the daemon never published, is an error
    (dead-lettered with the reason): counted as real, either would bend the throughput meter,
    the attempt gauge or the checkpoints."""
    if not job.knows(event.worker):
        raise EventError(f"{event.type} from {event.worker!r}, not a worker of job {job.name!r}")
    if event.generation > job.machine.generation:
        raise EventError(
            f"{event.type} of generation {event.generation}: the job has published only up to "
            f"{job.machine.generation}"
        )
    return event.generation
