"""The records a job keeps: per worker, per held registration, the step meter, the follow-up.
Plain data with their JSON form (the job's snapshot, chameleond/jobstate/job.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chameleond.core.plan import Plan, plan_from_dict, plan_to_dict
from chameleond.core.spec import LayerProfile
from chameleond.jobstate.jobspec import profile_from_json, profile_to_json

WORKER_STATES = ("waiting", "active", "failed", "fenced", "stopped", "finished", "left")
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
    ended: str = ""  # "finished" or "left": this process stopped cleanly; never declared failed
    # Soft state: the last time this worker was heard from while declared failed (0: never). Only
    # that makes a failed worker `fenced` (alive); a heartbeat from before it was declared, or the
    # restart of the daemon, does not.
    heard_while_failed: float = 0.0
    down_since: float = 0.0  # when its current fault was counted (0: not out); see Job.window

    def to_json(self) -> dict[str, Any]:
        """The durable part (the soft state, heartbeats, starts again on a restart)."""
        return {
            "host": self.host,
            "device": self.device,
            "memory_bytes": self.memory_bytes,
            "registered": self.registered,
            "stopped_generation": self.stopped_generation,
            "since_generation": self.since_generation,
            "ended": self.ended,
            "down_since": self.down_since,
            "profile": profile_to_json(self.profile),
        }

    def load(self, d: Mapping[str, Any]) -> None:
        self.host, self.device = str(d["host"]), str(d["device"])
        self.memory_bytes, self.registered = int(d["memory_bytes"]), bool(d["registered"])
        self.stopped_generation = int(d["stopped_generation"])
        self.since_generation = int(d.get("since_generation", 0))
        self.ended = str(d.get("ended", ""))
        self.down_since = float(d.get("down_since", 0.0))
        self.profile = profile_from_json(d["profile"])


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
    it (or a later step shows up); its time is the slowest worker's."""

    generation: int = 0
    step: int = -1
    samples: int = 0
    seconds: float = 0.0
    reporters: int = 0
    finished: bool = False
    samples_per_second: float = 0.0
    last_loss: float = float("nan")

    def report(
        self, generation: int, step: int, samples: int, seconds: float, loss: float, expected: int
    ) -> bool:
        """Returns False for a report of a step that is already finished (stale or duplicate)."""
        if (generation, step) < (self.generation, self.step) or (
            (generation, step) == (self.generation, self.step) and self.finished
        ):
            return False
        if (generation, step) > (self.generation, self.step):
            self._finish()
            self.generation, self.step, self.samples, self.seconds = generation, step, samples, 0.0
            self.reporters, self.finished = 0, False
        self.seconds = max(self.seconds, seconds)
        self.reporters += 1
        self.last_loss = loss
        if self.reporters >= expected:
            self._finish()
        return True

    def _finish(self) -> None:
        if self.reporters and self.seconds > 0 and not self.finished:
            rate = self.samples / self.seconds
            if math.isfinite(rate):  # a step of a few picoseconds is no measurement
                self.samples_per_second = rate
        self.finished = True


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
