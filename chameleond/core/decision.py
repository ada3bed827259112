"""A `Decision` (what core/decide.py returns), how it is acted on, and its JSON form.

`select` picks among the candidates. The daemon (chameleond/daemon/decisions.py) and the simulator
(chameleond/sim/policies.py) act on a decision by the same two rules: a join the planner does not
take keeps the current plan (`join_not_taken`), and a reroute is followed by the prepared dynamic
plan once it pays (`prepared_switch`; core/decide.py, rule 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chameleond.core.candidates import Candidate
from chameleond.core.plan import Plan
from chameleond.core.policy import Policy


@dataclass(frozen=True)
class Decision:
    selected: Policy | None  # REROUTE | DYNAMIC | DROP | RESTORE | KEEP | EXCLUDE | None
    plan: Plan | None
    candidates: tuple[Candidate, ...]  # (reroute, dynamic, drop): CANDIDATES' order
    unrecoverable: str | None
    mtbf_seconds: float
    search_seconds: float
    plans_considered: int
    generation: int
    cause: str = ""
    follow_up: Plan | None = None  # dynamic plan to switch to once prepared (decide.py, rule 1)
    follow_up_after_seconds: float | None = None  # remaining window above which switching pays
    note: str = ""  # e.g. why a forced policy was not taken
    window_seconds: float | None = None  # the window a fault's candidates, or a regrow, used
    # A slow-worker decision (core.slowdecide): per candidate, its score minus keep's (samples/s)
    gains: tuple[float, ...] = ()


# On equal scores the candidate that moves the fewest bytes: reroute and drop move nothing (drop
# also trains fewer samples, so it ties reroute only where both are worth the same), dynamic last.
_TIE_ORDER = (Policy.REROUTE, Policy.DROP, Policy.DYNAMIC)


def select(
    candidates: Sequence[Candidate],
    force: Policy | None = None,
    order: Sequence[Policy] = _TIE_ORDER,
) -> tuple[Policy | None, str]:
    """The policy to run (None: none is feasible) and a note when a forced policy was not.

    The higher score wins; on ties the earlier in `order` (by default reroute, then drop, then
    dynamic: _TIE_ORDER).
    """
    by_policy = {c.policy: c for c in candidates}
    forced = by_policy.get(force) if force is not None else None
    if forced is not None and forced.feasible:
        return forced.policy, ""
    note = ""
    if force is not None:
        why = forced.reason if forced is not None else "not a candidate"
        note = f"forced {force} is infeasible ({why}); selector decided"
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return None, note
    best = max(feasible, key=lambda c: (c.score, -order.index(c.policy)))
    return best.policy, note


def same_layout(a: Plan, b: Plan) -> bool:
    """The same pipelines, routing and fenced workers: the workers would run `b` as they run `a`."""
    return a.pipelines == b.pipelines and a.routing == b.routing and a.excluded == b.excluded


def join_not_taken(current: Plan, plan: Plan, *, joins_only: bool) -> bool:
    """Whether `plan`, the answer to a decision, leaves `current` running: the decision answers
    joins only (no fault, no failed restore) and its plan keeps the current layout, so the joined
    workers stay spares (a new generation would rebuild every communicator for nothing)."""
    return joins_only and same_layout(plan, current)


def prepared_switch(decision: Decision | None, force: Policy | None) -> tuple[Plan, float] | None:
    """The dynamic plan to switch to once the selected reroute plan trains, and the remaining
    window above which the switch pays (`Decision.follow_up_after_seconds`); None when the
    planner offered none or a policy is forced."""
    if decision is None or decision.follow_up is None or force is not None:
        return None
    return decision.follow_up, decision.follow_up_after_seconds or 0.0


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def candidate_to_dict(c: Candidate) -> dict[str, Any]:
    return {
        "policy": c.policy,
        "feasible": c.feasible,
        "reason": c.reason,
        "step_seconds": _finite(c.step_seconds),
        "transition_seconds": _finite(c.transition_seconds),
        "score": c.score,
        "at_risk": c.at_risk,
        "peak_memory_bytes": c.peak_memory_bytes,
        "generation": c.plan.generation if c.plan is not None else None,
        "global_batch": c.plan.global_batch if c.plan is not None else None,
    }


def decision_to_dict(d: Decision) -> dict[str, Any]:
    """JSON-able summary: every candidate without its plan (plan generations only)."""
    follow = None
    if d.follow_up is not None:
        e = d.follow_up.estimates
        follow = {
            "generation": d.follow_up.generation,
            "step_seconds": e.step_seconds,
            "transition_seconds": e.transition_seconds,
            "after_seconds": d.follow_up_after_seconds,
        }
    return {
        "selected": d.selected,
        "generation": d.generation,
        "plan_generation": d.plan.generation if d.plan is not None else None,
        "cause": d.cause,
        "unrecoverable": d.unrecoverable,
        "mtbf_seconds": _finite(d.mtbf_seconds),
        "window_seconds": None if d.window_seconds is None else _finite(d.window_seconds),
        "search_seconds": d.search_seconds,
        "plans_considered": d.plans_considered,
        "candidates": [
            {**candidate_to_dict(c), "gain": g} if d.gains else candidate_to_dict(c)
            for c, g in zip(d.candidates, d.gains or [0.0] * len(d.candidates), strict=True)
        ],
        "follow_up": follow,
        "note": d.note,
    }
