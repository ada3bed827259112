"""`decide_slow()`: a slow worker is a change in the inputs of the same decision.

Fail-slow (a device throttling, a degraded link, a noisy neighbour) makes the whole synchronous
job run at its slowest worker's pace. The daemon measures each worker's speed (its compute time
against its same-stage peers'); this module weighs, with the spec whose workers carry those
speeds (core.estimator divides each op's compute by its executor's speed), four candidates:

* keep: the current plan as it is, at the slow pace; no transition.
* weighted reroute (a `reroute` plan): the current layout with a share of each slow slot's
  micro-batches executed by its same-range peers (core.slowroute); transition = rebuild only.
* re-partition (a `dynamic` plan): the fastest of Algorithm 1 over every worker the plan runs
  (the search assumes equal devices), that layout re-split by the workers' speeds, and the
  current layout re-split alike (core.speedsplit: a slow worker's stage gets fewer layers, its
  pipeline fewer micro-batches; the layers that change owner move as a migration).
* exclude: the decision core.decide makes as if the slow workers had failed (its plan: reroute,
  dynamic or drop), with its transition.

Each is scored by core.selector over `duration_seconds`, the expected duration of the slowness
(the caller estimates it from the job's history), with the samples its plan trains per step; a
decision on recoveries alone (no worker slow any more) over `mtbf_seconds`, the window to the
next fault, as a rejoin is: what it gives back lasts that long, not an episode. The
higher score wins; ties go to keep, then the weighted reroute, re-partition, exclude. A worker back
to speed 1.0 is a recovery: the weighted reroute then gives its share back (every slot of the
current layout executed by its owner), at a rebuild. The plan of keep is the current plan at
`generation`, so `decision.same_layout(plan, current)` tells the caller nothing changes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace

from chameleond.core import restorer, selector
from chameleond.core.candidates import (
    Candidate,
    candidate_of,
    dynamic_candidate,
    infeasible,
    priced_plan,
    routed_candidate,
    worker_order,
)
from chameleond.core.decide import DecisionError, decide
from chameleond.core.decision import Decision, select
from chameleond.core.estimator import Estimator
from chameleond.core.holdings import Held, of_plan
from chameleond.core.layout import own_routing
from chameleond.core.plan import Pipeline, Plan
from chameleond.core.policy import SLOW_CANDIDATES, Policy
from chameleond.core.reroute import RoutingTable
from chameleond.core.slowroute import weighted_reroute
from chameleond.core.spec import MAX_SPEED, JobSpec
from chameleond.core.speedsplit import speed_split


def decide_slow(
    spec: JobSpec,
    current: Plan,
    speeds: Mapping[str, float],
    *,
    duration_seconds: float,
    generation: int,
    mtbf_seconds: float,
    holdings: Held | None = None,
    cause: str = "",
) -> Decision:
    """Keep, weighted reroute, re-partition and exclude for `speeds` (worker -> factor; < 1 is
    slow, 1.0 a recovery), scored over `duration_seconds`; `spec` without the speeds.
    `mtbf_seconds` (D) is what the exclude candidate's decision uses; `holdings` as for decide."""
    order = worker_order(spec)
    unknown = sorted(set(speeds) - set(order))
    if unknown:
        raise DecisionError(f"unknown worker(s): {', '.join(unknown)}")
    for w, v in speeds.items():
        if not (isinstance(v, int | float) and 0 < v <= MAX_SPEED):
            raise DecisionError(f"speed of {w}: must be in (0, {MAX_SPEED:g}], got {v!r}")
    if not (duration_seconds > 0 and mtbf_seconds > 0):
        raise DecisionError(
            f"duration_seconds and mtbf_seconds: must be > 0, got {duration_seconds!r}, "
            f"{mtbf_seconds!r}"
        )
    if generation <= current.generation:
        raise DecisionError(
            f"generation {generation} does not follow the current plan's {current.generation}"
        )
    slow_spec = spec.with_speeds(speeds)
    est = Estimator(slow_spec)
    fenced = set(current.excluded)
    every = of_plan(current) if holdings is None else holdings
    held = {w: list(ivs) for w, ivs in every.items() if w not in fenced}
    # Recoveries only (nobody slow any more): what the decision restores lasts to the next fault,
    # not an episode.
    slowed = any(w.speed < 1.0 for w in slow_spec.workers)
    window = float(duration_seconds) if slowed else float(mtbf_seconds)

    keep = _keep(slow_spec, est, current, generation, window, cause)
    weighted = _weighted(slow_spec, est, current, fenced, held, generation, window, cause)
    owners = {st.worker for pipe in current.pipelines for st in pipe.stages}
    survivors = sorted(owners - fenced, key=order.__getitem__)
    searched, _, search_seconds, considered = dynamic_candidate(
        slow_spec, est, current, survivors, held, generation, window, cause, fenced
    )
    bases = [(current.pipelines, current.routing, current.excluded, 0.0)]
    if searched.plan is not None:
        p = searched.plan
        bases.append((p.pipelines, p.routing, p.excluded, search_seconds))
    resplit = [
        _repartitioned(slow_spec, est, pipes, routing, excluded, set(speeds), held, generation,
                 window, cause, searching)
        for pipes, routing, excluded, searching in bases
    ]  # fmt: skip
    dyn = max((searched, *resplit), key=lambda c: (c.feasible, c.score))
    slow = sorted((w.id for w in slow_spec.workers if w.speed < 1.0 and w.id in survivors),
                  key=order.__getitem__)  # fmt: skip
    excl = _exclude(slow_spec, current, slow, holdings, generation, window, mtbf_seconds, cause)
    cands = (keep, weighted, dyn, excl)
    selected, _ = select(cands, order=SLOW_CANDIDATES)
    gains = tuple(c.score - keep.score for c in cands)
    if selected is None:
        reason = "no feasible plan: " + "; ".join(f"{c.policy}: {c.reason}" for c in cands)
        return Decision(None, None, cands, reason, mtbf_seconds, search_seconds, considered,
                        generation, cause, window_seconds=window, gains=gains)  # fmt: skip
    plan = next(c.plan for c in cands if c.policy == selected)
    return Decision(selected, plan, cands, None, mtbf_seconds, search_seconds, considered,
                    generation, cause, window_seconds=window, gains=gains)  # fmt: skip


def _keep(
    spec: JobSpec, est: Estimator, current: Plan, generation: int, window: float, cause: str
) -> Candidate:
    """The current plan, timed at the workers' speeds; nothing changes, nothing is paid."""
    # A kept restore plan loads no checkpoint again: it is the layout that restore searched.
    policy = Policy.DYNAMIC if current.policy is Policy.RESTORE else current.policy
    plan, oom = priced_plan(
        spec, est, policy, generation, current.pipelines, current.routing, current.excluded,
        (), 0.0, window, cause,
    )  # fmt: skip
    return candidate_of(Policy.KEEP, plan, oom)


def _weighted(
    spec: JobSpec,
    est: Estimator,
    current: Plan,
    fenced: set[str],
    held: Held,
    generation: int,
    window: float,
    cause: str,
) -> Candidate:
    result = weighted_reroute(est, current, fenced)
    if result.routing is None:
        return infeasible(Policy.REROUTE, result.reason, spec.rebuild_seconds)
    return routed_candidate(
        spec, est, current, result.routing, fenced, held, generation, window, cause
    )


def _repartitioned(
    spec: JobSpec,
    est: Estimator,
    pipelines: Sequence[Pipeline],
    routing: RoutingTable,
    excluded: Sequence[str],
    about: Collection[str],
    held: Held,
    generation: int,
    window: float,
    cause: str,
    search_seconds: float,
) -> Candidate:
    """A layout whose slots run on their owners, re-split by the workers' speeds: its owners
    receive the layers they gain (a migration), after `search_seconds` when it was searched."""
    if routing != own_routing(pipelines):
        return infeasible(Policy.DYNAMIC, "the layout has rerouted slots")
    pipes = speed_split(est, pipelines, excluded, about)
    running = {st.worker for pipe in pipes for st in pipe.stages}
    try:
        migration, seconds = restorer.repairs(spec, pipes, running, held)
    except restorer.LostLayers as e:
        return infeasible(Policy.DYNAMIC, str(e))
    transition = search_seconds + spec.rebuild_seconds + seconds
    plan, oom = priced_plan(
        spec, est, Policy.DYNAMIC, generation, pipes, own_routing(pipes), excluded, migration,
        transition, window, cause,
    )  # fmt: skip
    return candidate_of(Policy.DYNAMIC, plan, oom)


def _exclude(
    spec: JobSpec,
    current: Plan,
    slow: list[str],
    holdings: Held | None,
    generation: int,
    window: float,
    mtbf: float,
    cause: str,
) -> Candidate:
    """What core.decide selects with the slow workers failed, rescored over the window."""
    if not slow:
        return infeasible(Policy.EXCLUDE, "no worker is slow")
    d = decide(spec, current, slow, mtbf_seconds=mtbf, generation=generation,
               window_seconds=min(window, mtbf), cause=cause, holdings=holdings)  # fmt: skip
    chosen = next((c for c in d.candidates if c.policy == d.selected), None)
    if d.plan is None or chosen is None:
        return infeasible(Policy.EXCLUDE, d.unrecoverable or "no feasible plan")
    e = d.plan.estimates
    score = selector.score(d.plan.global_batch, e.step_seconds, e.transition_seconds, window,
                           chosen.at_risk, spec.restart_seconds)  # fmt: skip
    plan = replace(d.plan, estimates=replace(e, score=score, mtbf_seconds=window))
    return Candidate(Policy.EXCLUDE, True, "", e.step_seconds, e.transition_seconds,
                     score, chosen.peak_memory_bytes, plan,
                     chosen.at_risk)  # fmt: skip
