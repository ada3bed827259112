"""The records of a job's decisions stream (`chameleon:{job}:decisions`), one frozen dataclass per
kind: the wire in both directions.

The daemon writes them in its atomic commits (daemon/broadcast.py): a `DecisionRecord` for each
plan it published or decided not to publish (the candidates and the D they were scored over), a
`TransitionRecord` for each move of the policy state machine. The status page, `chameleonctl
status`, the local cluster's monitor and report read them back with `read_record`. Only the daemon
writes this stream, so reading is loose: a value that is not well-formed reads as absent, and an
entry of an unknown kind reads as None.

A Redis stream entry id is the millisecond at which Redis stored the entry (`entry_seconds`):
times read from ids trust no process's clock but Redis's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, ClassVar, Self

from chameleond.core.machine import Transition
from chameleond.wire import Fields, fixed, loose_float, loose_int

Entry = tuple[str, Mapping[str, str]]  # (stream entry id, fields)


class RecordKind(StrEnum):
    DECISION = "decision"
    TRANSITION = "transition"


def entry_seconds(entry_id: str) -> float:
    """Unix seconds of a stream entry id `<ms>-<seq>`."""
    ms, _, _ = entry_id.partition("-")
    return int(ms) / 1000.0


def _json(f: Fields, key: str) -> Any:
    try:
        return json.loads(f[key]) if key in f else None
    except json.JSONDecodeError:
        return None


def _ids(f: Fields, key: str) -> tuple[str, ...] | None:
    v = _json(f, key)
    return tuple(str(x) for x in v) if isinstance(v, list) else None


def _seconds(v: float | None) -> str | None:
    return None if v is None else fixed(v, 6)


@dataclass(frozen=True)
class DecisionRecord:
    """What the daemon decided for one generation: the plan it published (`selected` names its
    policy) or none (`selected` empty: the current plan kept, or `unrecoverable` says why no plan
    exists), why (`cause`), the candidates it scored and the D (`mtbf_seconds`) they were scored
    over, and the workers it answered."""

    kind: ClassVar[RecordKind] = RecordKind.DECISION
    generation: int  # the published plan's, else the generation in force
    selected: str  # the policy of the published plan; "" when none was published
    cause: str
    at: float  # the daemon's clock when it decided
    unrecoverable: str = ""  # why no plan exists, when none does
    mtbf_seconds: float | None = None
    failed: tuple[str, ...] = ()  # every worker out: this decision's faults and earlier ones
    faults: tuple[str, ...] = ()  # the new faults this decision answers
    joined: tuple[str, ...] = ()  # the workers offered back: new joins and those on standby
    unrestorable: tuple[str, ...] = ()  # workers that could not load the restore it replaces
    candidates: tuple[Mapping[str, Any], ...] = ()  # decision_to_dict's candidates
    search_seconds: float | None = None
    decision_seconds: float | None = None  # from the first fault it answers to the decision
    step_seconds: float | None = None  # the published plan's estimated step time
    detail: Mapping[str, str] = field(default_factory=dict)  # the faults' raw errors, by worker
    note: str = ""
    stored_at: float | None = field(default=None, compare=False)  # its entry's id, when read

    @property
    def received_at(self) -> float | None:
        """When the daemon received the first fault this decision answers."""
        return None if self.decision_seconds is None else self.at - self.decision_seconds

    @property
    def estimate(self) -> float | None:
        """The selected plan's estimated step time: the record's, else its candidate's."""
        if self.step_seconds is not None:
            return self.step_seconds
        for c in self.candidates:
            if self.selected and c.get("policy") == self.selected:
                v = c.get("step_seconds")
                return float(v) if isinstance(v, int | float) else None
        return None

    def to_fields(self) -> dict[str, str]:
        out: dict[str, str | None] = {
            "kind": self.kind, "generation": str(self.generation), "selected": self.selected,
            "cause": self.cause, "unrecoverable": self.unrecoverable,
            "mtbf_seconds": None if self.mtbf_seconds is None else fixed(self.mtbf_seconds, 3),
            "failed": json.dumps(list(self.failed)), "faults": json.dumps(list(self.faults)),
            "joined": json.dumps(list(self.joined)),
            "unrestorable": json.dumps(list(self.unrestorable)),
            "candidates": json.dumps(list(self.candidates)),
            "search_seconds": _seconds(self.search_seconds),
            "decision_seconds": _seconds(self.decision_seconds),
            "detail": json.dumps(dict(sorted(self.detail.items()))) if self.detail else None,
            "note": self.note or None, "step_seconds": _seconds(self.step_seconds),
            "at": fixed(self.at, 6),
        }  # fmt: skip
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        candidates = _json(f, "candidates")
        detail = _json(f, "detail")
        failed, faults = _ids(f, "failed") or (), _ids(f, "faults")
        return cls(
            generation=loose_int(f, "generation") or 0,
            selected=f.get("selected", ""),
            cause=f.get("cause", ""),
            at=loose_float(f, "at") or 0.0,
            unrecoverable=f.get("unrecoverable", ""),
            mtbf_seconds=loose_float(f, "mtbf_seconds"),
            failed=failed,
            faults=failed if faults is None else faults,
            joined=_ids(f, "joined") or (),
            unrestorable=_ids(f, "unrestorable") or (),
            candidates=tuple(c for c in candidates if isinstance(c, dict))
            if isinstance(candidates, list)
            else (),
            search_seconds=loose_float(f, "search_seconds"),
            decision_seconds=loose_float(f, "decision_seconds"),
            step_seconds=loose_float(f, "step_seconds"),
            detail={str(k): str(v) for k, v in detail.items()} if isinstance(detail, dict) else {},
            note=f.get("note", ""),
        )


@dataclass(frozen=True)
class TransitionRecord:
    """One move of the policy state machine (core/machine.py), e.g. training -> deciding."""

    kind: ClassVar[RecordKind] = RecordKind.TRANSITION
    source: str
    target: str
    generation: int
    cause: str
    at: float  # the daemon's clock
    stored_at: float | None = field(default=None, compare=False)  # its entry's id, when read

    @classmethod
    def of(cls, t: Transition) -> Self:
        return cls(t.source.value, t.target.value, t.generation, t.cause, t.at)

    def to_fields(self) -> dict[str, str]:
        return {
            "kind": self.kind, "from": self.source, "to": self.target,
            "generation": str(self.generation), "cause": self.cause, "at": fixed(self.at, 6),
        }  # fmt: skip

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        return cls(
            source=f.get("from", ""),
            target=f.get("to", ""),
            generation=loose_int(f, "generation") or 0,
            cause=f.get("cause", ""),
            at=loose_float(f, "at") or 0.0,
        )


Record = DecisionRecord | TransitionRecord
_KINDS: dict[str, type[DecisionRecord] | type[TransitionRecord]] = {
    RecordKind.DECISION: DecisionRecord,
    RecordKind.TRANSITION: TransitionRecord,
}


def read_record(entry_id: str, fields: Fields) -> Record | None:
    """One entry of the decisions stream, with the time Redis stored it; None for an unknown
    kind."""
    kind = _KINDS.get(fields.get("kind", ""))
    if kind is None:
        return None
    return replace(kind.from_fields(fields), stored_at=entry_seconds(entry_id))


def read_decisions(entries: Sequence[Entry]) -> list[DecisionRecord]:
    """The decision records among `entries`, in their order."""
    return [r for i, f in entries if isinstance(r := read_record(i, f), DecisionRecord)]
