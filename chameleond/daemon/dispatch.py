"""The one table from event type to handler (chameleond/handlers/): the daemon's, checked to cover
exactly the event set, `chameleond.events.Event` (tests/test_handlers.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

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
from chameleond.handlers.ack import handle_ack
from chameleond.handlers.checkpoint import handle_checkpoint
from chameleond.handlers.fault import handle_fault
from chameleond.handlers.heartbeat import handle_heartbeat
from chameleond.handlers.outcome import Outcome
from chameleond.handlers.profile import handle_profile
from chameleond.handlers.register import handle_register
from chameleond.handlers.rejoin import handle_rejoin
from chameleond.handlers.step import handle_step
from chameleond.jobstate.job import Job
from chameleond.protocol import EventError

# Each handler takes its own event type; `dispatch` only ever pairs them by that type.
Handler = Callable[[Job, Any, str, float], Outcome]
E = TypeVar("E", bound=Event)


def _pair(
    kind: type[E], handler: Callable[[Job, E, str, float], Outcome]
) -> tuple[type[Event], Handler]:
    """One row of the table; the type checker holds the handler to the event type it names."""
    return cast("type[Event]", kind), handler


HANDLERS: Mapping[type[Event], Handler] = dict(
    [
        _pair(Fault, handle_fault),
        _pair(Rejoin, handle_rejoin),
        _pair(Register, handle_register),
        _pair(Heartbeat, handle_heartbeat),
        _pair(Profile, handle_profile),
        _pair(Step, handle_step),
        _pair(Ack, handle_ack),
        _pair(Checkpoint, handle_checkpoint),
    ]
)


def dispatch(job: Job, event: Event, entry_id: str, now: float) -> Outcome:
    """Run the event's handler. Raises EventError when the event is well-formed but unusable."""
    handler = HANDLERS.get(type(event))
    if handler is None:
        raise EventError(f"no handler for type {event.type!r}")
    return handler(job, event, entry_id, now)
