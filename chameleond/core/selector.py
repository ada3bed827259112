"""The selector: a candidate's score (PAPER.md section 3) and the online estimate of D.

score = (B / t_step) * ((D - t_transition) / (D + p R)) is the average throughput over one
fault-to-fault window of length D: nothing is trained during the transition, then B samples every
t_step. p R is beyond the paper: with probability p the next fault takes the only copy of some
layer's state (p = the share of the plan's workers that are a layer's only holder), and training
resumes only after a restart from checkpoint, R = `restart_seconds` later; that expected pause
belongs to the window. With every layer held twice, p = 0 and the score is the paper's. The
estimator of D and its choices are documented in docs/restorer.md ("The D estimator").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Faults this close to the previous counted fault are one event (one host losing all its devices,
# one switch taking down a rack): they cost one decision and one transition, not several.
BURST_SECONDS = 1.0


def _finite(name: str, value: float, *, positive: bool = False) -> float:
    v = float(value)
    if math.isnan(v) or math.isinf(v) or (positive and v <= 0) or v < 0:
        need = "> 0" if positive else ">= 0"
        raise ValueError(f"{name}: must be a finite number {need}, got {value!r}")
    return v


def score(
    global_batch: int,
    step_seconds: float,
    transition_seconds: float,
    mtbf_seconds: float,
    at_risk: float = 0.0,
    restart_seconds: float = 0.0,
) -> float:
    """Samples per second averaged over the expected window D to the next fault, and the
    restart that fault forces with probability `at_risk` (module docstring).

    0 when D <= t_transition: the plan would not finish switching before the next fault.
    D may be infinite (no fault expected): the score is then the steady throughput B / t_step.
    """
    if global_batch <= 0:
        raise ValueError(f"global_batch: must be > 0, got {global_batch!r}")
    t_step = _finite("step_seconds", step_seconds, positive=True)
    t_tr = _finite("transition_seconds", transition_seconds)
    d = float(mtbf_seconds)
    if math.isnan(d) or d <= 0:
        raise ValueError(f"mtbf_seconds: must be > 0, got {mtbf_seconds!r}")
    if d <= t_tr:
        return 0.0
    if math.isinf(d):
        return global_batch / t_step
    p = _finite("at_risk", at_risk)
    if p > 1:
        raise ValueError(f"at_risk: must be a probability, got {at_risk!r}")
    pause = p * _finite("restart_seconds", restart_seconds)
    return (global_batch / t_step) * ((d - t_tr) / (d + pause))


def break_even_seconds(
    step_a: float, transition_a: float, step_b: float, transition_b: float
) -> float | None:
    """The D at which candidates a and b score the same (B cancels), or None if they never do.

    Above it the candidate with the faster step wins; below it the one with the shorter transition.
    From (1 - t_a/D)/s_a = (1 - t_b/D)/s_b: D = (t_a/s_a - t_b/s_b) / (1/s_a - 1/s_b).
    """
    sa = _finite("step_a", step_a, positive=True)
    sb = _finite("step_b", step_b, positive=True)
    ta = _finite("transition_a", transition_a)
    tb = _finite("transition_b", transition_b)
    rate_gap = 1.0 / sa - 1.0 / sb
    if rate_gap == 0.0:
        return None
    d = (ta / sa - tb / sb) / rate_gap
    # Only a crossing above both transitions is real: below max(t_a, t_b) one score is clamped at 0.
    return d if d > max(ta, tb) else None


def fault_events(fault_times: Sequence[float], burst_seconds: float = BURST_SECONDS) -> list[float]:
    """Fault times with bursts folded: a fault within `burst_seconds` of the previous counted one
    belongs to the same event. Sorted; NaN and infinite times are rejected."""
    window = _finite("burst_seconds", burst_seconds)
    events: list[float] = []
    for t in sorted(_finite_time(t) for t in fault_times):
        if not events or t - events[-1] > window:
            events.append(t)
    return events


def _finite_time(t: float) -> float:
    v = float(t)
    if math.isnan(v) or math.isinf(v):
        raise ValueError(f"fault_times: {t!r} is not a time")
    return v


def estimate_mtbf(
    fault_times: Sequence[float],
    now: float,
    started: float,
    prior_seconds: float,
    prior_weight: float = 1.0,
    burst_seconds: float = BURST_SECONDS,
) -> float:
    """Expected time to the next fault, from this job's fault history and a prior.

    Faults are modelled as a Poisson process with unknown rate; the prior on the rate is
    Gamma(shape=w, rate=w * prior_seconds), i.e. "w faults seen in w * prior_seconds". After n
    fault events over the exposure T = now - started the posterior is Gamma(w + n, w*prior + T),
    and the estimate is the reciprocal of its mean rate:

        D = (w * prior_seconds + T) / (w + n)

    With no faults D grows with T (a quiet job earns a longer D); with many, it tends to T / n.
    Faults before `started` are outside the exposure window and are ignored; a fault stamped after
    `now` (clock skew) extends the window to it.
    """
    start = _finite_time(started)
    end = _finite_time(now)
    if end < start:
        raise ValueError(f"now ({now!r}) is before started ({started!r})")
    prior = _finite("prior_seconds", prior_seconds, positive=True)
    weight = _finite("prior_weight", prior_weight, positive=True)
    events = [t for t in fault_events(fault_times, burst_seconds) if t >= start]
    if events:
        end = max(end, events[-1])
    return (weight * prior + (end - start)) / (weight + len(events))
