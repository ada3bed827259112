"""The simulated run's clock: what the job does, segment by segment, between trace events.

A policy answers each event with a list of phases (kind, seconds, samples per second, state); the
last one usually lasts until the next event. Phases are played in order until the next event cuts
them; what a cut phase had not finished is dropped. A phase's `state` (the plan it runs, what the
workers hold) becomes the policy's state when the phase starts, so a transition cut short leaves
the previous state in place.

Kinds (`Kind`): `training` (useful samples), `transition` (switching plans: nothing trained),
`restart` (checkpoint load, job relaunch), `lost` (training again the steps since the last
checkpoint), `down` (no plan can run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    """What the job does during a phase (the keys of a result's `breakdown_seconds`)."""

    TRAINING = "training"
    TRANSITION = "transition"
    RESTART = "restart"
    LOST = "lost"
    DOWN = "down"


KINDS = tuple(Kind)


@dataclass(frozen=True)
class Phase:
    kind: Kind
    seconds: float  # math.inf: until the next event
    throughput: float  # useful samples per second (0 outside training)
    state: Any = None  # the policy's state from this phase on (None: unchanged)


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    kind: Kind
    throughput: float


class Timeline:
    """Phases played against the clock, with the checkpoint cadence of the run's training."""

    def __init__(self, state: Any, checkpoint_seconds: float = math.inf) -> None:
        self.clock = 0.0
        self.state = state
        self.segments: list[Segment] = []
        self.pending: list[Phase] = []
        # Training seconds since the newest checkpoint; a checkpoint completes every
        # `checkpoint_seconds` of training.
        self.checkpoint_seconds = checkpoint_seconds
        self.since_checkpoint = 0.0
        self.samples = 0.0  # useful samples trained so far
        self.samples_at_checkpoint = 0.0

    def follow(self, phases: list[Phase]) -> None:
        """From now on, play these phases (whatever was pending is dropped)."""
        self.pending = list(phases)

    def play(self, until: float) -> None:
        """Advance the clock to `until`, playing pending phases."""
        while self.clock < until and self.pending:
            ph = self.pending[0]
            if ph.state is not None:
                self.state = ph.state
                self.pending[0] = Phase(ph.kind, ph.seconds, ph.throughput)
            end = min(until, self.clock + ph.seconds)
            self._record(end, ph)
            if end < self.clock + ph.seconds:
                rest = ph.seconds - (end - self.clock)
                self.pending[0] = Phase(ph.kind, rest, ph.throughput)
                self.clock = end
                break
            self.pending.pop(0)
            self.clock = end
        self.clock = max(self.clock, until)
        # A phase whose start is exactly now takes effect now (its state is the current one).
        while self.pending and self.pending[0].state is not None and self.pending[0].seconds == 0:
            self.state = self.pending.pop(0).state

    def _record(self, end: float, ph: Phase) -> None:
        dt = end - self.clock
        if dt <= 0:
            return
        if (
            self.segments
            and self.segments[-1].kind == ph.kind
            and self.segments[-1].end == (self.clock)
            and self.segments[-1].throughput == ph.throughput
        ):
            last = self.segments[-1]
            self.segments[-1] = Segment(last.start, end, last.kind, last.throughput)
        else:
            self.segments.append(Segment(self.clock, end, ph.kind, ph.throughput))
        if ph.kind == Kind.TRAINING:
            self.samples += dt * ph.throughput
            total = self.since_checkpoint + dt
            if total >= self.checkpoint_seconds:
                k = math.floor(total / self.checkpoint_seconds)
                self.since_checkpoint = total - k * self.checkpoint_seconds
                self.samples_at_checkpoint = self.samples - self.since_checkpoint * ph.throughput
            else:
                self.since_checkpoint = total

    def lost_samples(self) -> float:
        """Samples trained since the newest checkpoint: lost if the job rolls back to it."""
        return max(0.0, self.samples - self.samples_at_checkpoint)

    def roll_back(self) -> None:
        """The job goes back to its newest checkpoint (the samples since are trained again)."""
        self.since_checkpoint = 0.0
        self.samples_at_checkpoint = self.samples
