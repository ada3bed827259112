"""The events of a job's stream, one frozen dataclass per type (docs/protocol.md).

`chameleond.protocol.parse_event` builds them from a stream entry's raw fields, checking every
bound on the way; whatever holds one of these holds a valid event, and reads its fields by name.
`type` is the wire name (the entry's `type` field, the metric label).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, TypeAlias


class AckPhase(StrEnum):
    READY = "ready"  # built the generation's process groups and finished migration
    STOPPED = "stopped"  # stopped: fenced, finished its steps, or left
    UNRESTORABLE = "unrestorable"  # cannot load its layers from the restore's checkpoint


@dataclass(frozen=True)
class Fault:
    """A worker (or a node, named like a worker) is out."""

    type: ClassVar[str] = "fault"
    worker: str
    cause: str = ""  # free text; "" when the reporter gave none
    generation: int | None = None  # the generation the reporter saw it fail in, when known


@dataclass(frozen=True)
class Rejoin:
    """A worker outside the current plan is available again."""

    type: ClassVar[str] = "rejoin"
    worker: str


@dataclass(frozen=True)
class Register:
    """A worker announces itself."""

    type: ClassVar[str] = "register"
    worker: str
    host: str
    memory_bytes: int
    device: str = "cpu"


@dataclass(frozen=True)
class Heartbeat:
    type: ClassVar[str] = "heartbeat"
    worker: str


@dataclass(frozen=True, eq=False)
class Profile:
    """Measured per-layer costs (and, from a CPU worker, its host's capacity)."""

    type: ClassVar[str] = "profile"
    worker: str
    data: Mapping[str, Any]  # a JSON object with a `layers` list (jobstate/jobspec.parse_profile)


@dataclass(frozen=True)
class Step:
    """A worker committed a step of a generation. Its seconds are the worker's own; what it trained
    (samples, loss and the figures after it) is the whole step's, the same on every worker of the
    plan. The figures after `vote_seconds` are optional on the wire (older workers send none)."""

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


@dataclass(frozen=True)
class Ack:
    """A worker's answer to a plan generation. `attempt`: how many times it built the
    generation; `reason` (stopped): finished or left; `step`, `cause` (unrestorable): the
    checkpoint it cannot load, and why; `build_seconds`, `migration_seconds` (ready, when sent):
    how long it took to get ready, and the migration's part of that."""

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
    size_bytes: float | None = None
    bubble_seconds: float | None = None
    stall_seconds: float | None = None


Event: TypeAlias = Fault | Rejoin | Register | Heartbeat | Profile | Step | Ack | Checkpoint
EVENT_CLASSES: tuple[type[Event], ...] = (
    Fault, Rejoin, Register, Heartbeat, Profile, Step, Ack, Checkpoint,
)  # fmt: skip
