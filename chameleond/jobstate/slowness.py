"""Fail-slow detection: a worker alive but slow (a throttled device, a degraded link, a noisy
neighbour), found from the workers' own training profiles. Plain data in, plain data out; the
time is passed in.

A worker's compute is the forward and backward seconds per micro-batch over the layers its newest
training profile reports (docs/worker.md, "Profile"); its peers are the workers whose newest
training profiles cover the same layer indices (the same stage in the other pipelines). Its speed
is the median of its peers' compute over its own: 1 for a worker as fast as its peers, 0.5 for
one that takes twice as long. A worker without peers (one pipeline) has no speed: nothing to
compare it with, so no detection.

A worker's observed speed is the median of the speeds its own profiles showed over its window: the
last WINDOW_SECONDS, and at least its newest MIN_SAMPLES (a job of long steps profiles seldom),
observed once it has MIN_SAMPLES. One profile's speed swings with whatever the machine did during
its few steps; the window's median with what the worker is. A worker is slow
once that stays below 1/MARGIN for HOLD_SECONDS (every observation in between below), and
recovered once it stays above 1/RECOVER_MARGIN for HOLD_SECONDS. A slow worker whose speed stays
MARGIN away from the speed last decided on (faster or slower) for HOLD_SECONDS is a change of
speed: decided on again, at the new speed. A worker that speeds up partly is one, and so is one
whose plan gave part of its work away: on a shared CPU its own measure then reads lower than its
speed (a worker left fewer micro-batches shares the cores with busier peers for all of them;
measured: 0.88 for a worker back at full speed), so its recovery shows first as a change of
speed, whose plan gives the work back, then as a recovery. The window, the margins and the hold
sit above the noise of a healthy run (docs/daemon.md, "Slow workers").
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from chameleond.core.spec import LayerProfile
from chameleond.protocol import profile_every_steps

# A healthy 6-worker CPU job (2 pipelines of 3 stages) sharing a 2-core machine, 1,630 training
# profiles over 150 s: one profile's speed as low as 0.47 (0.61 at the 1st percentile), the 20 s
# median of a worker's own as low as 0.84. A worker paused to half speed on the same machine (its
# peers take the cores it leaves) showed 20 s medians of 0.77 (0.83 at most): slow under
# 1/1.25 = 0.8, recovered over 1/1.1 = 0.91 (docs/daemon.md, "Slow workers").
MARGIN = 1.25
RECOVER_MARGIN = 1.1
HOLD_SECONDS = 5.0
WINDOW_SECONDS = 20.0
MIN_SAMPLES = 8
EPISODE_PRIOR_SECONDS = 600.0  # an episode's expected duration before the job has seen one
EPISODES_KEPT = 1000


@dataclass(frozen=True)
class Measure:
    """A worker's newest training profile, reduced: the layers it ran and their compute."""

    generation: int
    layers: frozenset[int]
    compute_seconds: float  # forward + backward per micro-batch, over `layers`


@dataclass(frozen=True)
class Transition:
    """A worker became slow (`slow`) or recovered: what a decision answers."""

    worker: str
    slow: bool
    speed: float
    seconds: float  # slow: how long the speed held below; recovered: the episode's duration
    was: float | None = None  # a slow worker's change of speed: the speed decided on before

    @property
    def cause(self) -> str:
        if self.was is not None:
            return f"{self.worker} slow: speed {self.speed:.2f} (was {self.was:.2f})"
        if self.slow:
            return f"{self.worker} slow: speed {self.speed:.2f} for {self.seconds:.0f} s"
        return f"{self.worker} recovered"


@dataclass
class WorkerSlowness:
    """One worker's state: slow or not, since when, its speed as observed (the window's median)
    and as last decided on, the run of observations on the other side of its threshold (None:
    the last one was not), and the speeds its own profiles showed over the window (soft: they
    come again)."""

    slow: bool = False
    since: float = 0.0  # when its current episode began (the first slow observation)
    speed: float = 1.0  # the newest observed
    crossing_since: float | None = None
    decided: float = 1.0  # the speed of its last transition
    samples: list[tuple[float, float]] = field(default_factory=list, compare=False)

    def observe(self, worker: str, speed: float, now: float) -> Transition | None:
        """A speed its own profile showed: the window, the hold and the hysteresis."""
        self.samples.append((now, speed))
        while len(self.samples) > MIN_SAMPLES and self.samples[0][0] < now - WINDOW_SECONDS:
            self.samples.pop(0)
        if len(self.samples) < MIN_SAMPLES:
            return None
        self.speed = median(s for _, s in self.samples)
        if not self.slow:
            crossing = self.speed < 1 / MARGIN
        elif self.speed > 1 / RECOVER_MARGIN:
            crossing = True
        else:  # still slow: a change of speed, either way
            crossing = not 1 / MARGIN < self.speed / self.decided < MARGIN
        if not crossing:
            self.crossing_since = None
            return None
        if self.crossing_since is None:
            self.crossing_since = now
            if not self.slow:
                self.since = now
        held = now - self.crossing_since
        if held < HOLD_SECONDS:
            return None
        self.crossing_since = None
        if self.slow and self.speed <= 1 / RECOVER_MARGIN:
            was, self.decided = self.decided, self.speed
            return Transition(worker, True, self.speed, now - self.since, was=was)
        self.slow = not self.slow
        self.decided = self.speed if self.slow else 1.0
        return Transition(worker, self.slow, self.speed, held if self.slow else now - self.since)

    def to_json(self) -> dict[str, Any]:
        return {"slow": self.slow, "since": self.since, "speed": self.speed,
                "crossing_since": self.crossing_since, "decided": self.decided}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WorkerSlowness:
        crossing = d.get("crossing_since")
        speed = float(d["speed"])
        # A snapshot from before `decided` was kept: the speed observed stands for it.
        decided = float(d.get("decided", speed if d["slow"] else 1.0))
        return cls(bool(d["slow"]), float(d["since"]), speed,
                   None if crossing is None else float(crossing), decided)  # fmt: skip


@dataclass
class Slowness:
    """The job's detector: the workers' newest measures, their state, the completed episodes
    ((start, seconds), the job's own history for `expected_seconds`)."""

    measures: dict[str, Measure] = field(default_factory=dict)
    workers: dict[str, WorkerSlowness] = field(default_factory=dict)
    episodes: list[tuple[float, float]] = field(default_factory=list)
    detected: int = 0  # soft: transitions since this daemon started (metrics)
    recovered: int = 0
    # Derived from `measures` and the members last observed: the members' computes by the layers
    # they ran.
    _members: frozenset[str] | None = field(default=None, init=False, repr=False, compare=False)
    _groups: dict[frozenset[int], PeerGroup] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def speeds(self) -> dict[str, float]:
        """Every slow worker's speed (the others are 1.0): what the planner is told."""
        return {w: s.speed for w, s in sorted((w, s) for w, s in self.workers.items() if s.slow)}

    def observe(
        self, worker: str, measure: Measure, members: Collection[str], now: float
    ) -> list[Transition]:
        """A training profile from `worker`: its speed against its peers' newest, a sample of
        its window at `now`. Returns the transition it makes (slow, recovered), if any."""
        old = self.measures.get(worker)
        self.measures[worker] = measure
        if self._members is not members:
            held = frozenset(members)
            if held != self._members:  # other members: their groups from the measures
                self._groups = {}
                for w, m in self.measures.items():
                    if w in held:
                        self._groups.setdefault(m.layers, PeerGroup()).set(w, m.compute_seconds)
            # Held from now on, changed or not, so that the next profile sees at a glance that
            # the members are the same (comparing 8,192 names per profile took 40% of a daemon).
            self._members = held
        if old is not None and old.layers in self._groups:
            self._groups[old.layers].discard(worker)
        if worker in members:
            self._groups.setdefault(measure.layers, PeerGroup()).set(
                worker, measure.compute_seconds
            )
        peers = self._groups.get(measure.layers)
        speed = peers.speed(worker) if peers is not None else None
        if speed is None:
            return []
        t = self.workers.setdefault(worker, WorkerSlowness()).observe(worker, speed, now)
        return [] if t is None else [self._moved(t, now)]

    def _moved(self, t: Transition, now: float) -> Transition:
        if t.was is not None:
            return t  # the same episode, decided on again
        self.detected += t.slow
        self.recovered += not t.slow
        if not t.slow:
            episode = (now - t.seconds, t.seconds)
            self.episodes = [*self.episodes, episode][-EPISODES_KEPT:]
        return t

    def forget(self, worker: str) -> bool:
        """A worker that died is an ordinary fault: out of the speeds. Whether it was slow."""
        measure = self.measures.pop(worker, None)
        if measure is not None:
            self._members = None  # the groups are built again
        state = self.workers.pop(worker, None)
        return state is not None and state.slow

    def expected_seconds(self, prior: float = EPISODE_PRIOR_SECONDS) -> float:
        return expected_episode_seconds([s for _, s in self.episodes], prior)

    def to_json(self) -> dict[str, Any]:
        """The durable part: the states and the episodes (the measures come again with the next
        profiles)."""
        return {"workers": {w: s.to_json() for w, s in self.workers.items()},
                "episodes": [list(e) for e in self.episodes]}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Slowness:
        workers = {str(w): WorkerSlowness.from_json(s) for w, s in d.get("workers", {}).items()}
        episodes = [(float(a), float(b)) for a, b in d.get("episodes", [])]
        return cls(workers=workers, episodes=episodes)


def measure_of(data: Mapping[str, Any], profile: Mapping[int, LayerProfile]) -> Measure | None:
    """A `profile` event's measure: only a training report (`"source": "training"`, naming the
    plan it ran) counts; a start-up profile times each layer alone, not the stage at work."""
    generation = data.get("generation")
    if data.get("source") != "training" or not profile:
        return None
    if isinstance(generation, bool) or not isinstance(generation, int):
        return None
    compute = sum(p.forward_seconds + p.backward_seconds for p in profile.values())
    # A CPU worker's layer seconds are its thread's CPU time: a worker paused or starved of its
    # cores spends no more of it. Its ops' wall time per CPU second says how long they took.
    stretch = data.get("wall_per_cpu", 1.0)
    if isinstance(stretch, bool) or not isinstance(stretch, int | float):
        stretch = 1.0
    compute *= stretch if math.isfinite(stretch) and 1e-3 <= stretch <= 1e6 else 1.0
    return Measure(generation, frozenset(profile), compute) if compute > 0 else None


def peer_speeds(measures: Mapping[str, Measure]) -> dict[str, float]:
    """Each worker's speed against its peers (same layers); a worker without peers has none."""
    by_layers: dict[frozenset[int], dict[str, float]] = {}
    for w, m in measures.items():
        by_layers.setdefault(m.layers, {})[w] = m.compute_seconds
    speeds = {w: own_speed(group, w) for group in by_layers.values() for w in group}
    return {w: speed for w, speed in speeds.items() if speed is not None}


def own_speed(group: Mapping[str, float], worker: str) -> float | None:
    """`worker`'s speed in its group of peers: the median of the others' compute over its own;
    None without peers."""
    compute = group.get(worker)
    others = [c for w, c in group.items() if w != worker]
    return None if compute is None or not others else median(others) / compute


@dataclass
class PeerGroup:
    """The computes of the workers that run the same layers, also kept sorted: `own_speed` of one
    of them without going through the others (a group is a stage's peers: 512 at 8,192 workers,
    each reporting every few steps)."""

    computes: dict[str, float] = field(default_factory=dict)
    _sorted: list[float] = field(default_factory=list, repr=False)

    def set(self, worker: str, compute: float) -> None:
        self.discard(worker)
        self.computes[worker] = compute
        bisect.insort(self._sorted, compute)

    def discard(self, worker: str) -> None:
        old = self.computes.pop(worker, None)
        if old is not None:
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def speed(self, worker: str) -> float | None:
        """`own_speed(self.computes, worker)`: the others are the sorted computes less one copy
        of the worker's own."""
        compute = self.computes.get(worker)
        others = len(self._sorted) - 1
        if compute is None or others == 0:
            return None
        own = bisect.bisect_left(self._sorted, compute)

        def other(i: int) -> float:
            return self._sorted[i if i < own else i + 1]

        half = others // 2
        middle = other(half) if others % 2 else (other(half - 1) + other(half)) / 2
        return middle / compute


def detect_seconds(step_seconds: float, members: int) -> float:
    """How long after its onset a change of speed is decided on, for a plan of `members` at
    `step_seconds` steps: the profile that first shows it (its window is profile_every_steps
    steps, filled by the slow ones), half the worker's window (its median moves once most of it
    is slow), the hold, and the profile of its own that confirms it."""
    profiles = profile_every_steps(members, step_seconds) * step_seconds
    window = max(WINDOW_SECONDS, MIN_SAMPLES * profiles)
    return window / 2 + HOLD_SECONDS + 2 * profiles


def expected_episode_seconds(durations: Iterable[float], prior: float) -> float:
    """How long a slowness episode is expected to last: the mean of the job's completed ones,
    the prior before any."""
    seen = list(durations)
    return sum(seen) / len(seen) if seen else prior
