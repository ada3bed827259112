"""The selector: a candidate's score (PAPER.md section 3) and the online estimate of D.

score = (B / t_step) * ((D - t_transition) / (D + p R)) is the average throughput over one
fault-to-fault window of length D: nothing is trained during the transition, then B samples every
t_step. p R is beyond the paper: with probability p the next fault takes the only copy of some
layer's state (p = the share of the plan's workers that are a layer's only holder), and training
resumes only after a restart from checkpoint, R = `restart_seconds` later; that expected pause
belongs to the window. With every layer held twice, p = 0 and the score is the paper's. The
estimator of D and its choices are documented in docs/restorer.md ("The D estimator").

The window ends at the next fault or at the next return of a worker that is out (`window_seconds`):
either way the job plans again, and a layout chosen for fewer workers is given up for one that
takes the returning worker back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Faults this close to the previous counted fault are one event (one host losing all its devices,
# one switch taking down a rack): they cost one decision and one transition, not several.
BURST_SECONDS = 1.0
# A return is expected only from at least this many repair events that lasted longer than the
# worker has been out: one or two tail repairs say little about when the next one ends.
RETURN_SUPPORT = 3


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


def repair_events(
    repairs: Sequence[tuple[float, float]], burst_seconds: float = BURST_SECONDS
) -> list[float]:
    """How long each repair event lasted, from (went out, seconds out) per worker that came back:
    workers that went out within `burst_seconds` of the first of them (a host's devices) are one
    event, as their faults are (fault_events), lasting their mean time out. Sorted by when the
    event began."""
    window = _finite("burst_seconds", burst_seconds)
    events: list[tuple[float, list[float]]] = []
    for start, seconds in sorted(
        (_finite_time(a), _finite("repair_seconds", b)) for a, b in repairs
    ):
        if events and start - events[-1][0] <= window:
            events[-1][1].append(seconds)
        else:
            events.append((start, [seconds]))
    return [sum(d) / len(d) for _, d in events]


def window_seconds(
    mtbf_seconds: float, repair_seconds: Sequence[float], down_for: Sequence[float]
) -> float:
    """D for the score: the expected time to the next fault or the next return, whichever first.

    `mtbf_seconds`: the expected time to the next fault (estimate_mtbf); `repair_seconds`: how
    long this job's repairs lasted, one per event (repair_events); `down_for`: how long each
    worker now out has been. A worker out for a seconds is expected back after the mean of
    (r - a) over the repairs r longer than a (the job's own repairs, no assumed distribution; a
    worker out longer than every repair seen is not expected back). With r the soonest such
    return and faults a Poisson process of mean D, the window is E[min(T_fault, r)] =
    D (1 - e^(-r/D)).
    """
    d = float(mtbf_seconds)
    if math.isnan(d) or d <= 0:
        raise ValueError(f"mtbf_seconds: must be > 0, got {mtbf_seconds!r}")
    repairs = [_finite("repair_seconds", r) for r in repair_seconds]
    soonest = math.inf
    for a in (_finite("down_for", x) for x in down_for):
        rest = [r - a for r in repairs if r > a]
        if len(rest) >= RETURN_SUPPORT:
            soonest = min(soonest, sum(rest) / len(rest))
    if math.isinf(soonest):
        return d
    if math.isinf(d):
        return soonest
    return d * -math.expm1(-soonest / d)


def window_at(
    now: float,
    mtbf_seconds: float,
    repairs: Sequence[tuple[float, float]],
    went_out: Sequence[float],
) -> float:
    """`window_seconds` at `now`, from (went out, seconds out) per worker that came back and when
    each worker now out went out: what the daemon's Job and the simulator both keep."""
    out = [max(0.0, now - t) for t in went_out]
    return window_seconds(mtbf_seconds, repair_events(repairs), out)
