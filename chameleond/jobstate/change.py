"""What a transition of the job's state changed, for the daemon to make durable.

Handlers and the job's transitions return a `Change` instead of marking the job dirty; the daemon
adds up the changes of a batch (or a decision) and its next commit carries what they name: the
snapshot, the transition records for the decisions stream, the recoveries for the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from chameleond.core.machine import Recovery, Transition
from chameleond.records import Record, TransitionRecord


@dataclass(frozen=True)
class Change:
    snapshot: bool = False  # the job's durable state changed: the next commit carries a snapshot
    records: tuple[Record, ...] = ()  # transitions for the decisions stream, in order
    recoveries: tuple[Recovery, ...] = ()  # completed recoveries, for the metrics
    # Measurements (profiles) moved the snapshot: a later snapshot carries them, at the latest
    # with the next progress (every persist interval). The workers send them again and again, so
    # a restart that lost the newest has them back within a reporting period.
    measured: bool = False

    def __or__(self, other: Change) -> Change:
        if not other:  # the common case, once per event: nothing new to make
            return self
        if not self:
            return other
        return Change(
            self.snapshot or other.snapshot,
            self.records + other.records,
            self.recoveries + other.recoveries,
            self.measured or other.measured,
        )

    def __bool__(self) -> bool:
        return self.snapshot or bool(self.records) or bool(self.recoveries) or self.measured


UNCHANGED = Change()
SNAPSHOT = Change(snapshot=True)
MEASURED = Change(measured=True)


def snapshot_if(changed: bool) -> Change:
    return SNAPSHOT if changed else UNCHANGED


def recorded(ts: Iterable[Transition]) -> Change:
    """The policy machine moved: its snapshot changed, and each transition is recorded."""
    records: tuple[Record, ...] = tuple(TransitionRecord.of(t) for t in ts)
    return Change(snapshot=True, records=records) if records else UNCHANGED
