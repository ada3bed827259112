"""The planner's layer figures from the workers' newest profiles, kept as running sums.

Per layer, the mean over the workers whose newest profile measured it, each worker's seconds at a
healthy worker's pace (jobstate/jobspec.py `measured_layers` is the definition). Profiles arrive
constantly and decisions are rare, so a new profile costs the layers it covers, not the job's
workers times its layers: the sums are exact (fixed-point integers), so taking a worker's old
profile out and putting its new one in never drifts from the sum made from scratch.

The planner takes those means through `SteadyLayers`: a layer's figure stays what it was until
its mean has moved by more than STEADY_TOLERANCE from it. Every profile moves the means a little;
the search's tables are computed from the figures (core.search `job_tables`), and figures that
held still keep them filled for the next fault's decision (daemon/decisions.py `_prepare`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from chameleond.core.spec import LayerProfile

# Every finite float times 2**1074 is an integer (the smallest subnormal is 2**-1074).
_SCALE_BITS = 1074


def _fixed(x: float) -> int:
    num, den = float(x).as_integer_ratio()
    return num << (_SCALE_BITS - den.bit_length() + 1)


@dataclass
class _LayerSum:
    """The sums of a layer's figures over the profiles counted: seconds (forward, backward,
    update) as fixed-point integers, bytes (param, optimizer, activation, output)."""

    count: int = 0
    seconds: list[int] = field(default_factory=lambda: [0] * 3)
    nbytes: list[int] = field(default_factory=lambda: [0] * 4)

    def add(self, p: LayerProfile, speed: float, sign: int) -> None:
        """Count `p` in (sign 1) or out (-1); a worker at `speed` measured 1/speed times a
        healthy worker's seconds, so they count times `speed`. (Spelt out field by field: a
        start-up profile of 82 layers from each of 8,192 workers comes through here.)"""
        self.count += sign
        s, b = self.seconds, self.nbytes
        s[0] += sign * _fixed(p.forward_seconds * speed)
        s[1] += sign * _fixed(p.backward_seconds * speed)
        s[2] += sign * _fixed(p.update_seconds * speed)
        b[0] += sign * p.param_bytes
        b[1] += sign * p.optimizer_bytes
        b[2] += sign * p.activation_bytes
        b[3] += sign * p.output_bytes

    def mean(self, name: str) -> LayerProfile:
        n = self.count
        forward, backward, update = (s / (n << _SCALE_BITS) for s in self.seconds)
        param, optimizer, activation, output = (round(b / n) for b in self.nbytes)
        return LayerProfile(name, forward, backward, param, optimizer, activation, output,
                            update_seconds=update)  # fmt: skip


class MeasuredLayers:
    """Each worker's profile and speed as last counted, and the per-layer sums over them."""

    def __init__(self) -> None:
        self._counted: dict[str, tuple[Mapping[int, LayerProfile], float]] = {}
        self._sums: dict[int, _LayerSum] = {}
        self._means: dict[int, LayerProfile] = {}  # the layers whose sums did not move since

    def layers(
        self,
        base: Sequence[LayerProfile],
        profiles: Mapping[str, Mapping[int, LayerProfile]],
        speeds: Mapping[str, float],
    ) -> tuple[LayerProfile, ...]:
        """`measured_layers(base, profiles, speeds)`: the workers' profiles (a profile is
        counted again only when it is another object than the one counted) at their speeds
        (1.0 when not named)."""
        counted = self._counted
        for w in [w for w in counted if w not in profiles]:
            self._count(w, None, 1.0)
        for w, p in profiles.items():
            speed = speeds.get(w, 1.0)
            was = counted.get(w)
            if was is None or was[0] is not p or was[1] != speed:
                self._count(w, p, speed)
        out = []
        for i, layer in enumerate(base):
            s = self._sums.get(i)
            if s is None or not s.count:
                out.append(layer)
                continue
            mean = self._means.get(i)
            if mean is None or mean.name != layer.name:
                mean = self._means[i] = s.mean(layer.name)
            out.append(mean)
        return tuple(out)

    def measured(self) -> set[int]:
        """The layers some counted profile measured."""
        return {i for i, s in self._sums.items() if s.count}

    def _count(self, worker: str, profile: Mapping[int, LayerProfile] | None, speed: float) -> None:
        was = self._counted.pop(worker, None)
        if was is not None:
            for i, p in was[0].items():
                self._sums[i].add(p, was[1], -1)
                self._means.pop(i, None)
        if profile is not None:
            for i, p in profile.items():
                self._sums.setdefault(i, _LayerSum()).add(p, speed, 1)
                self._means.pop(i, None)
            self._counted[worker] = (profile, speed)


# A layer's planner figure moves once its measured mean is this far from it (relative).
STEADY_TOLERANCE = 0.01


class SteadyLayers:
    """The planner's layer figures: each the measured mean as it was when last taken, kept while
    the mean's seconds are within STEADY_TOLERANCE of it and its bytes no more than it and
    within that of it (the planner never under-states a layer's memory)."""

    def __init__(self) -> None:
        self._kept: tuple[LayerProfile, ...] = ()

    def of(self, means: tuple[LayerProfile, ...]) -> tuple[LayerProfile, ...]:
        """The figures to plan with for `means`: the tuple returned last (the same object) when
        every layer is still within tolerance of it."""
        kept = self._kept
        if len(kept) != len(means):
            self._kept = means
            return means
        out = tuple(k if k is m or _within(k, m) else m for k, m in zip(kept, means, strict=True))
        if any(o is not k for o, k in zip(out, kept, strict=True)):
            self._kept = out
        return self._kept


def _within(kept: LayerProfile, mean: LayerProfile) -> bool:
    tol = STEADY_TOLERANCE
    seconds = (
        (kept.forward_seconds, mean.forward_seconds),
        (kept.backward_seconds, mean.backward_seconds),
        (kept.update_seconds, mean.update_seconds),
    )
    nbytes = (
        (kept.param_bytes, mean.param_bytes),
        (kept.optimizer_bytes, mean.optimizer_bytes),
        (kept.activation_bytes, mean.activation_bytes),
        (kept.output_bytes, mean.output_bytes),
    )
    return (
        kept.name == mean.name
        and all(abs(k - m) <= tol * k for k, m in seconds)
        and all(m <= k <= m * (1 + tol) for k, m in nbytes)
    )
