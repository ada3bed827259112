"""The events of a job's stream, one frozen dataclass per type: the wire in both directions.

Each class is the one definition of its event (docs/protocol.md): `from_fields` reads a stream
entry's decoded fields into it, checking every bound on the way (`EventError` says why not), and
`to_fields` writes it as the flat string fields the worker sends. Whatever holds one of these holds
a valid event and reads its fields by name. `type` is the wire name (the entry's `type` field, the
metric label). The set of events is declared once, as the union `Event`; `EVENT_CLASSES` holds its
members, and the protocol's tables are made from it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self, TypeAlias, cast, get_args

from chameleond.wire import (
    MAX_ATTEMPT,
    MAX_BYTES,
    MAX_FIGURE,
    MAX_LOSS,
    MAX_SAMPLES,
    MAX_SECONDS,
    MAX_TOKENS,
    EventError,
    Fields,
    count,
    fixed,
    loose_float,
    loose_int,
    read_flag,
    read_float,
    read_ident,
    read_int,
    read_layers,
    read_positive,
    read_text,
)


class AckPhase(StrEnum):
    READY = "ready"  # built the generation's process groups and finished migration
    STOPPED = "stopped"  # stopped: fenced, finished its steps, or left
    UNRESTORABLE = "unrestorable"  # cannot load its layers from the restore's checkpoint


def _note() -> Any:
    """A field the daemon does not act on (a report's `at`, its `reporter`): read loosely (a value
    that is not well-formed is absent), written when set, and no part of the event's equality."""
    return field(default=None, compare=False)


def _entry(kind: str, worker: str, fields: Mapping[str, str | None]) -> dict[str, str]:
    """A stream entry: `type`, `worker`, then the fields that are sent (None: not sent)."""
    return {"type": kind, "worker": worker, **{k: v for k, v in fields.items() if v is not None}}


def _num(v: float | None, places: int | None = None) -> str | None:
    """A number's text: with `places` decimals, else in full (a float's shortest repr, an int's
    digits); None: not sent."""
    if v is None:
        return None
    return str(v) if places is None else fixed(v, places)


@dataclass(frozen=True)
class Fault:
    """A worker (or a node, named like a worker) is out. `reporter` (the worker that saw it),
    `at` (its clock then) and `source` (`detector` when the daemon's failure detector suspected
    it) are for people and benchmarks: the daemon does not act on them."""

    type: ClassVar[str] = "fault"
    worker: str
    cause: str = ""  # free text; "" when the reporter gave none
    generation: int | None = None  # the generation the reporter saw it fail in, when known
    reporter: str | None = _note()
    at: float | None = _note()
    source: str | None = _note()

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        if "worker" not in f and "node" not in f:
            raise EventError("a fault needs 'worker' or 'node'")
        worker = read_ident(f, "worker") if "worker" in f else read_ident(f, "node")
        generation = read_int(f, "generation", minimum=1) if "generation" in f else None
        cause, reporter, at = read_text(f, "cause"), f.get("reporter"), loose_float(f, "at")
        return cls(worker, cause, generation, reporter, at, f.get("source"))

    def to_fields(self) -> dict[str, str]:
        return _entry(self.type, self.worker, {
            "cause": self.cause, "reporter": self.reporter, "generation": _num(self.generation),
            "at": _num(self.at, 3), "source": self.source,
        })  # fmt: skip


@dataclass(frozen=True)
class Rejoin:
    """A worker outside the current plan is available again."""

    type: ClassVar[str] = "rejoin"
    worker: str

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        return cls(read_ident(f, "worker"))

    def to_fields(self) -> dict[str, str]:
        return _entry(self.type, self.worker, {})


@dataclass(frozen=True)
class Register:
    """A worker announces itself. `pid`, `address` and `corpus` (the digest of its data) are for
    people: the daemon does not act on them."""

    type: ClassVar[str] = "register"
    worker: str
    host: str
    memory_bytes: int
    device: str = "cpu"
    pid: int | None = _note()
    address: str | None = _note()
    corpus: str | None = _note()

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        worker, host = read_ident(f, "worker"), read_ident(f, "host")
        memory = read_int(f, "memory_bytes", minimum=1, maximum=MAX_BYTES)
        device = read_ident(f, "device") if f.get("device") else "cpu"
        pid, address, corpus = loose_int(f, "pid"), f.get("address"), f.get("corpus")
        return cls(worker, host, memory, device, pid, address, corpus)

    def to_fields(self) -> dict[str, str]:
        return _entry(self.type, self.worker, {
            "host": self.host, "device": self.device, "memory_bytes": str(self.memory_bytes),
            "pid": _num(self.pid), "address": self.address, "corpus": self.corpus,
        })  # fmt: skip


@dataclass(frozen=True)
class Heartbeat:
    """A worker is alive. `at`: its clock when it sent the beat; `refused`: how many plans or
    specs it refused as unsigned or forged (sent when any, docs/security.md)."""

    type: ClassVar[str] = "heartbeat"
    worker: str
    at: float | None = _note()
    refused: int = field(default=0, compare=False)

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        return cls(read_ident(f, "worker"), loose_float(f, "at"), loose_int(f, "refused") or 0)

    def to_fields(self) -> dict[str, str]:
        refused = _num(self.refused) if self.refused else None
        return _entry(self.type, self.worker, {"at": _num(self.at, 3), "refused": refused})


@dataclass(frozen=True, eq=False)
class Profile:
    """Measured per-layer costs (and, from a CPU worker, its host's capacity)."""

    type: ClassVar[str] = "profile"
    worker: str
    data: Mapping[str, Any]  # a JSON object with a `layers` list (jobstate/jobspec.parse_profile)

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        worker = read_ident(f, "worker")
        try:
            data = json.loads(f.get("data", ""))
        except (ValueError, RecursionError) as e:  # JSONDecodeError, a 5000-digit int, nesting
            raise EventError(f"field 'data' is not JSON: {str(e)[:200]}") from None
        if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
            raise EventError("field 'data' must be a JSON object with a 'layers' list")
        return cls(worker, data)

    def to_fields(self) -> dict[str, str]:
        return _entry(self.type, self.worker, {"data": json.dumps(dict(self.data))})


@dataclass(frozen=True)
class Step:
    """A worker committed a step of a generation. Its seconds are the worker's own; what it trained
    (samples, loss and the figures after it) is the whole step's, the same on every worker of the
    plan. The figures after `vote_seconds` are optional on the wire (older workers send none);
    `at`, the worker's clock when it sent the report, the daemon does not act on."""

    type: ClassVar[str] = "step"
    worker: str
    generation: int
    step: int
    samples: int  # trained: the job's global batch, or fewer under a drop plan
    seconds: float
    loss: float
    vote_seconds: float | None = None
    grad_norm: float | None = None  # the global gradient norm before clipping; None: not sent
    learning_rate: float | None = None  # wire `lr`
    tokens: int | None = None  # trained in the step
    skipped_samples: int = 0  # wire `skipped`: samples of the global batch a drop plan left out
    overflow: bool = False  # fp16: inf/nan gradients, so the update was skipped
    loss_scale: float | None = None  # fp16's dynamic loss scale the step ran with
    eval_loss: float | None = None  # a held-out evaluation ran after this step: its mean loss
    at: float | None = _note()

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        worker = read_ident(f, "worker")
        overflow = read_flag(f, "overflow")
        return cls(
            worker,
            generation=read_int(f, "generation", minimum=1),
            step=read_int(f, "step"),
            samples=read_int(f, "samples", maximum=MAX_SAMPLES),
            seconds=read_float(f, "seconds"),
            loss=read_float(f, "loss", maximum=MAX_LOSS),
            vote_seconds=read_float(f, "vote_seconds") if "vote_seconds" in f else None,
            grad_norm=_grad_norm(f, overflow),
            learning_rate=read_float(f, "lr", maximum=MAX_FIGURE) if "lr" in f else None,
            tokens=read_int(f, "tokens", maximum=MAX_TOKENS) if "tokens" in f else None,
            skipped_samples=read_int(f, "skipped", maximum=MAX_SAMPLES) if "skipped" in f else 0,
            overflow=overflow,
            loss_scale=read_positive(f, "loss_scale", MAX_FIGURE) if "loss_scale" in f else None,
            eval_loss=read_float(f, "eval_loss", maximum=MAX_LOSS) if "eval_loss" in f else None,
            at=loose_float(f, "at"),
        )

    def to_fields(self) -> dict[str, str]:
        """`overflow` goes with `loss_scale` (an fp16 step's), or alone when it is 1."""
        fp16 = self.overflow or self.loss_scale is not None
        return _entry(self.type, self.worker, {
            "generation": _num(self.generation), "step": _num(self.step),
            "samples": _num(self.samples), "seconds": _num(self.seconds, 6),
            "vote_seconds": _num(self.vote_seconds, 6), "loss": _num(self.loss),
            "lr": _num(self.learning_rate), "tokens": _num(self.tokens),
            "skipped": _num(self.skipped_samples), "at": _num(self.at, 3),
            "grad_norm": _num(self.grad_norm), "eval_loss": _num(self.eval_loss),
            "overflow": str(int(self.overflow)) if fp16 else None,
            "loss_scale": _num(self.loss_scale),
        })  # fmt: skip


def _grad_norm(f: Fields, overflow: bool) -> float | None:
    """`grad_norm`, when sent. A step that overflowed had inf/nan gradients, so their norm is
    inf or nan: accepted then, as no norm (None), rather than dead-lettering a committed step."""
    if "grad_norm" not in f:
        return None
    if overflow and f["grad_norm"].strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
        return None
    return read_float(f, "grad_norm", maximum=MAX_FIGURE)


@dataclass(frozen=True)
class Ack:
    """A worker's answer to a plan generation. `attempt`: how many times it built the
    generation; `reason` (stopped): finished or left; `step`, `cause` (unrestorable): the
    checkpoint it cannot load, and why; `build_seconds`, `migration_seconds` (ready, when sent):
    how long it took to get ready, and the migration's part of that. `world_seconds` (the
    rendezvous's part) and `moves` (the layers migrated) are for people and benchmarks."""

    type: ClassVar[str] = "ack"
    worker: str
    generation: int
    phase: AckPhase
    attempt: int = 1
    reason: str = ""
    step: int = 0
    cause: str = ""
    build_seconds: float | None = None
    migration_seconds: float | None = None
    world_seconds: float | None = _note()
    moves: int | None = _note()

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        worker = read_ident(f, "worker")
        generation = read_int(f, "generation", minimum=1)
        if f.get("phase") not in tuple(AckPhase):
            raise EventError(f"field 'phase' must be one of {', '.join(AckPhase)}")
        phase = AckPhase(f["phase"])
        attempt = read_int(f, "attempt", minimum=1, maximum=MAX_ATTEMPT) if "attempt" in f else 1
        step, cause = 0, ""
        if phase is AckPhase.UNRESTORABLE:
            step, cause = read_int(f, "step"), read_text(f, "cause")
        build = read_float(f, "build_seconds") if "build_seconds" in f else None
        migration = read_float(f, "migration_seconds") if "migration_seconds" in f else None
        return cls(
            worker, generation, phase, attempt, reason=f.get("reason", ""), step=step, cause=cause,
            build_seconds=build, migration_seconds=migration,
            world_seconds=loose_float(f, "world_seconds"), moves=loose_int(f, "moves"),
        )  # fmt: skip

    def to_fields(self) -> dict[str, str]:
        """`attempt` with `ready`; `step` and `cause` with `unrestorable`; `reason` when given."""
        ready, lost = self.phase is AckPhase.READY, self.phase is AckPhase.UNRESTORABLE
        return _entry(self.type, self.worker, {
            "generation": _num(self.generation), "phase": self.phase.value,
            "attempt": _num(self.attempt) if ready else None, "reason": self.reason or None,
            "step": _num(self.step) if lost else None, "cause": self.cause if lost else None,
            "build_seconds": _num(self.build_seconds, 4),
            "world_seconds": _num(self.world_seconds, 4),
            "migration_seconds": _num(self.migration_seconds, 4), "moves": _num(self.moves),
        })  # fmt: skip

    def rebuild_seconds(self) -> float | None:
        """The build of the generation's process groups, rendezvous included: the ready ack's
        time to get ready less its migration. None when the ack does not say."""
        if self.build_seconds is None:
            return None
        return max(0.0, self.build_seconds - (self.migration_seconds or 0.0))


@dataclass(frozen=True)
class Checkpoint:
    """A worker wrote the layers it owns at a committed step, and what that cost it."""

    type: ClassVar[str] = "checkpoint"
    worker: str
    generation: int
    step: int
    layers: tuple[int, ...]
    size_bytes: float | None = None  # wire `bytes`
    bubble_seconds: float | None = None
    stall_seconds: float | None = None

    @classmethod
    def from_fields(cls, f: Fields) -> Self:
        worker = read_ident(f, "worker")
        step = read_int(f, "step")
        generation = read_int(f, "generation", minimum=1)
        layers = read_layers(f.get("layers", ""))

        def cost(key: str, maximum: float = MAX_SECONDS) -> float | None:
            return read_float(f, key, maximum=maximum) if key in f else None

        return cls(
            worker, generation, step, layers, size_bytes=cost("bytes", float(MAX_BYTES)),
            bubble_seconds=cost("bubble_seconds"), stall_seconds=cost("stall_seconds"),
        )  # fmt: skip

    def to_fields(self) -> dict[str, str]:
        size = None if self.size_bytes is None else count(self.size_bytes)
        return _entry(self.type, self.worker, {
            "step": _num(self.step), "generation": _num(self.generation),
            "layers": ",".join(map(str, self.layers)), "bytes": size,
            "bubble_seconds": _num(self.bubble_seconds, 6),
            "stall_seconds": _num(self.stall_seconds, 6),
        })  # fmt: skip


# The event set, declared once: the protocol's parsers and type names, the metric labels and the
# daemon's handler table (checked complete in tests/test_handlers.py) all follow it.
Event: TypeAlias = Fault | Rejoin | Register | Heartbeat | Profile | Step | Ack | Checkpoint
EVENT_CLASSES = cast("tuple[type[Event], ...]", get_args(Event))
# The events the daemon hears a worker in (chameleond/handlers: heartbeat, step, ack): a worker
# that sent one within its heartbeat period needs not heartbeat as well.
HEARD: tuple[type[Event], ...] = (Heartbeat, Step, Ack)
