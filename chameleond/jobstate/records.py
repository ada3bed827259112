"""The records a job keeps: per worker, per held registration, the step meter, the follow-up.
Plain data with their JSON form (the job's snapshot, chameleond/jobstate/job.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chameleond.core.plan import Plan, plan_from_dict, plan_to_dict
from chameleond.core.spec import LayerProfile, LinkSpec
from chameleond.events import Step
from chameleond.jobstate.jobspec import profile_from_json
from chameleond.jobstate.links import links_from_json, links_to_json


class WorkerState(StrEnum):
    """What a worker is to the job (the status page's `state`, chameleon_workers' label)."""

    WAITING = "waiting"  # registered outside the plan: a spare, or back and offered to a decision
    ACTIVE = "active"  # runs the current plan
    FAILED = "failed"  # declared failed or fenced by the plan, not heard from since
    FENCED = "fenced"  # declared failed, yet heard from recently: alive, kept out of the plans
    STOPPED = "stopped"  # out of the plans and said it stopped
    FINISHED = "finished"  # stopped cleanly: trained its steps
    LEFT = "left"  # stopped cleanly: left the job


class Liveness(StrEnum):
    """What the daemon knows of a worker's process, on evidence (Job.liveness)."""

    STOPPED = "stopped"  # it said so: finished, left or fenced
    DEAD = "dead"  # declared failed, nothing heard since
    HEARTBEATING = "heartbeating"  # heard within the heartbeat timeout
    SILENT = "silent"  # not heard within it


WORKER_STATES = tuple(WorkerState)
# Registrations of workers the spec does not list wait for the worker's profile (docs/daemon.md,
# Failure detection): at most this many at once, each for at most the registration TTL.
UNCONFIRMED_MAX = 64


@dataclass
class WorkerRecord:
    id: str
    host: str = ""
    device: str = ""
    memory_bytes: int = 0
    registered: bool = False
    stopped_generation: int = 0
    since_generation: int = 0  # the first generation this worker's current process can be in
    last_heartbeat: float = 0.0  # soft state: wall-clock time of the last heartbeat seen
    profile: dict[int, LayerProfile] = field(default_factory=dict)
    links: dict[str, LinkSpec] = field(default_factory=dict)  # peer -> its newest measured link
    ended: WorkerState | None = None  # FINISHED or LEFT: this process stopped cleanly; never
    # declared failed (None: it has not)
    # Soft state: the last time this worker was heard from while declared failed (0: never). Only
    # that makes a failed worker `fenced` (alive); a heartbeat from before it was declared, or the
    # restart of the daemon, does not.
    heard_while_failed: float = 0.0
    down_since: float = 0.0  # when its current fault was counted (0: not out); see Job.window

    def to_json(self) -> dict[str, Any]:
        """The durable part (the soft state, heartbeats and the profile, starts again on a
        restart: the job keeps the layer figures its profiles made, Job.measured_means)."""
        return {
            "host": self.host,
            "device": self.device,
            "memory_bytes": self.memory_bytes,
            "registered": self.registered,
            "stopped_generation": self.stopped_generation,
            "since_generation": self.since_generation,
            "ended": self.ended or "",
            "down_since": self.down_since,
            "links": links_to_json(self.links),
        }

    def load(self, d: Mapping[str, Any]) -> None:
        self.host, self.device = str(d["host"]), str(d["device"])
        self.memory_bytes, self.registered = int(d["memory_bytes"]), bool(d["registered"])
        self.stopped_generation = int(d["stopped_generation"])
        self.since_generation = int(d.get("since_generation", 0))
        ended = str(d.get("ended", ""))
        self.ended = WorkerState(ended) if ended else None
        self.down_since = float(d.get("down_since", 0.0))
        # A snapshot from before the job kept its layer figures holds each worker's profile.
        self.profile = profile_from_json(d.get("profile", []))
        self.links = links_from_json(d.get("links", {}))


@dataclass(frozen=True)
class Registration:
    """A `register` from a worker the spec does not list, waiting for the worker's profile."""

    host: str
    memory_bytes: int
    device: str
    at: float  # when it was (last) received

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "memory_bytes": self.memory_bytes, "device": self.device,
                "at": self.at}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Registration:
        return cls(str(d["host"]), int(d["memory_bytes"]), str(d["device"]), float(d["at"]))


@dataclass
class StepMeter:
    """Measured throughput in O(1) memory: a step is done when every worker of the plan reported
    it (or a later step shows up); its time is the slowest worker's. What the step trained (its
    samples, tokens, loss, gradient norm, ...) is the same in every worker's report: it is taken,
    and counted, once, from the step's first report."""

    generation: int = 0
    step: int = -1
    samples: int = 0
    tokens: int | None = None  # None: the step's report named no tokens (an older worker)
    seconds: float = 0.0
    reporters: int = 0
    finished: bool = False
    samples_per_second: float = 0.0  # of the last finished step
    tokens_per_second: float | None = None  # of the last finished step that named its tokens
    last: Step | None = None  # the first report of the newest step
    eval_loss: float | None = None  # the newest held-out evaluation's loss, and its step
    eval_step: int = -1
    # Totals since the daemon started (counters: a restart starts them again).
    trained_samples: int = 0
    trained_tokens: int = 0
    skipped_samples: int = 0
    overflow_steps: int = 0

    def report(self, event: Step, expected: int) -> bool:
        """Returns False for a report of a step that is already finished (stale or duplicate)."""
        key = (event.generation, event.step)
        if key < (self.generation, self.step) or (
            key == (self.generation, self.step) and self.finished
        ):
            return False
        if key > (self.generation, self.step):
            self._finish()
            self.generation, self.step = key
            self.samples, self.tokens, self.seconds = event.samples, event.tokens, 0.0
            self.reporters, self.finished = 0, False
            self._count(event)
        if event.eval_loss is not None:
            self.eval_loss, self.eval_step = event.eval_loss, event.step
        self.seconds = max(self.seconds, event.seconds)
        self.reporters += 1
        if self.reporters >= expected:
            self._finish()
        return True

    @property
    def last_loss(self) -> float | None:
        return None if self.last is None else self.last.loss

    def _count(self, event: Step) -> None:
        """The step's first report: what it trained counts once."""
        self.last = event
        self.trained_samples += event.samples
        self.trained_tokens += event.tokens or 0
        self.skipped_samples += event.skipped_samples
        self.overflow_steps += event.overflow

    def _finish(self) -> None:
        if self.reporters and self.seconds > 0 and not self.finished:
            rate = self.samples / self.seconds
            if math.isfinite(rate):  # a step of a few picoseconds is no measurement
                self.samples_per_second = rate
                if self.tokens is not None:
                    self.tokens_per_second = self.tokens / self.seconds
        self.finished = True


@dataclass
class RebuildMeter:
    """The communicator rebuild the workers measured, per backend: of the newest generation they
    acknowledged ready with figures, the slowest member's build of its process groups (`ack`
    ready: build_seconds less migration_seconds; the rendezvous with every member included). Its
    members' acks come one by one: until the last is in, it is the slowest of those received."""

    newest: dict[str, tuple[int, float]] = field(default_factory=dict)  # backend -> (gen, s)

    def observe(self, backend: str, generation: int, seconds: float) -> bool:
        """One member's figure; True when the backend's figure changed."""
        known = self.newest.get(backend)
        if known is not None and generation < known[0]:
            return False  # an older generation's: the newer one stands
        if known is not None and generation == known[0]:
            seconds = max(seconds, known[1])
        if known == (generation, seconds):
            return False
        self.newest[backend] = (generation, seconds)
        return True

    def seconds(self, backend: str) -> float | None:
        known = self.newest.get(backend)
        return None if known is None else known[1]

    def to_json(self) -> dict[str, list[float]]:
        return {b: [g, s] for b, (g, s) in sorted(self.newest.items())}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RebuildMeter:
        return cls({str(b): (int(g), float(s)) for b, (g, s) in d.items()})


@dataclass(frozen=True)
class FollowUp:
    """The dynamic plan prepared beside a reroute (`Decision.follow_up`), published as the next
    generation once the reroute plan of `after_generation` runs. Persisted in the snapshot: the
    commit that publishes the reroute stores it and the commit that publishes the switch (or any
    other plan) drops it, so a restart neither loses nor repeats the switch."""

    after_generation: int
    plan: Plan
    after_seconds: float  # the switch pays when more than this remains of the window D

    def to_json(self) -> dict[str, Any]:
        return {
            "after_generation": self.after_generation,
            "after_seconds": self.after_seconds,
            "plan": plan_to_dict(self.plan),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FollowUp:
        return cls(int(d["after_generation"]), plan_from_dict(d["plan"]), float(d["after_seconds"]))
