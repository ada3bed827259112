"""The one table from event type to handler (handlers/): the daemon's, checked complete against
the protocol's event types (tests/test_handlers.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from chameleond.events import (
    Ack,
    Checkpoint,
    Event,
    Fault,
    Heartbeat,
    Profile,
    Register,
    Rejoin,
    Step,
)
from chameleond.jobstate.job import Job
from chameleond.protocol import EventError
from handlers.ack import handle_ack
from handlers.checkpoint import handle_checkpoint
from handlers.fault import handle_fault
from handlers.heartbeat import handle_heartbeat
from handlers.outcome import Outcome
from handlers.profile import handle_profile
from handlers.register import handle_register
from handlers.rejoin import handle_rejoin
from handlers.step import handle_step

# Each handler takes its own event type; `dispatch` only ever pairs them by that type.
Handler = Callable[[Job, Any, str, float], Outcome]

HANDLERS: Mapping[type[Event], Handler] = {
    Fault: handle_fault,
    Rejoin: handle_rejoin,
    Register: handle_register,
    Heartbeat: handle_heartbeat,
    Profile: handle_profile,
    Step: handle_step,
    Ack: handle_ack,
    Checkpoint: handle_checkpoint,
}


def dispatch(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    """Run the event's handler. Raises EventError when the event is well-formed but unusable."""
    handler = HANDLERS.get(type(event))
    if handler is None:
        raise EventError(f"no handler for type {event.type!r}")
    return handler(job, event, entry_id, now)
