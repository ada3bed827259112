"""The candidates a decision weighs (core/decide.py), each a plan priced by the same model.

* reroute: the current layout, failed slots executed by their same-range peers (core.reroute);
  transition = communicator rebuild only (nothing moves).
* dynamic: Algorithm 1 over the survivors (core.search), survivors put into the new slots with the
  fewest bytes moved (core.restorer); transition = search time + migration + rebuild. The search
  time is modelled (plans considered x `costs.search_seconds_per_plan`), never measured, so a
  decision is a pure function of its inputs.
* drop (beyond the paper; only where `training.min_global_batch` < `global_batch`): the current
  pipelines that lost no worker, unchanged (core.drop), or the job's own pipelines that are whole
  again (the regrow); a step trains fewer samples, and the plan's `global_batch` says how many.

Each is timed by core.estimator and scored by core.selector with the samples its plan trains per
step. A restore (every worker loads a checkpoint) is priced by `restore_seconds`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from chameleond.core import restorer, selector
from chameleond.core.drop import FIXED_BATCH, drop, regrow
from chameleond.core.estimator import Estimator
from chameleond.core.holdings import Held, holder_counts, of_pipelines, sole_holders
from chameleond.core.layout import (
    LayoutError,
    layout_pipelines,
    own_layout,
    own_layout_rerouted,
    own_routing,
)
from chameleond.core.plan import Estimates, Pipeline, Plan, Transfer, executors
from chameleond.core.policy import Policy
from chameleond.core.reroute import RoutingTable, reroute
from chameleond.core.roster import roster
from chameleond.core.search import search
from chameleond.core.spec import JobSpec


@dataclass(frozen=True)
class Candidate:
    policy: Policy  # REROUTE | DYNAMIC | DROP
    feasible: bool
    reason: str  # why infeasible; "" when feasible
    step_seconds: float  # inf when infeasible
    transition_seconds: float
    score: float  # samples/s over the expected window; 0 when infeasible
    peak_memory_bytes: int  # the largest per-worker peak of the plan
    plan: Plan | None
    at_risk: float = 0.0  # the share of the plan's workers that are some layer's only holder


def infeasible(policy: Policy, reason: str, transition: float = 0.0) -> Candidate:
    return Candidate(policy, False, reason, math.inf, transition, 0.0, 0, None)


def worker_order(spec: JobSpec) -> Mapping[str, int]:
    return roster(spec).order


def _holders(held: Held) -> dict[int, set[str]]:
    """Layer -> the workers that hold it."""
    out: dict[int, set[str]] = {}
    for w, intervals in held.items():
        for a, b in intervals:
            for layer in range(a, b):
                out.setdefault(layer, set()).add(w)
    return out


def lost_layers(spec: JobSpec, held: Held, out: set[str]) -> str | None:
    """'layers 4-7 lost every replica (workers w3, w7 failed)', or None."""
    counts = holder_counts(held, len(spec.layers), out)
    # A layer without parameters or optimizer state has nothing to lose (as in core.restorer).
    lost = [
        layer
        for layer, lp in enumerate(spec.layers)
        if lp.param_bytes + lp.optimizer_bytes > 0 and not counts[layer]
    ]
    if not lost:
        return None
    holders_of = _holders(held)
    order = worker_order(spec)
    who = sorted({w for layer in lost for w in holders_of.get(layer, ())}, key=order.__getitem__)
    word = "layer" if len(lost) == 1 else "layers"
    last = f"workers {', '.join(who)} failed" if who else "no worker acknowledged a copy"
    return f"{word} {restorer.layer_ranges(lost)} lost every replica ({last})"


def priced_plan(
    spec: JobSpec,
    est: Estimator,
    policy: Policy,
    generation: int,
    pipelines: Sequence[Pipeline],
    routing: tuple[tuple[tuple[str, ...], ...], ...],
    excluded: Sequence[str],
    migration: tuple[Any, ...],
    transition: float,
    mtbf: float,
    cause: str,
) -> tuple[Plan, str | None]:
    """A plan with its estimates, and the out-of-memory reason if a worker does not fit. Its
    global batch is the samples its pipelines train per step (the spec's B but for a drop plan)."""
    pipelines = tuple(pipelines)
    groups = restorer.sync_groups(pipelines, excluded)
    step = est.step_seconds(pipelines, routing, groups)
    memory = est.peak_memory(pipelines, routing, excluded)
    batch = sum(p.micro_batches for p in pipelines) * spec.training.micro_batch
    plan = Plan(
        job=spec.name,
        generation=generation,
        policy=policy,
        global_batch=batch,
        micro_batch=spec.training.micro_batch,
        pipelines=pipelines,
        routing=routing,
        migration=migration,
        sync_groups=groups,
        estimates=Estimates(
            step_seconds=step,
            transition_seconds=transition,
            score=selector.score(
                batch,
                step,
                transition,
                mtbf,
                at_risk(pipelines, routing),
                spec.restart_seconds,
            ),
            mtbf_seconds=mtbf,
            peak_memory_bytes=memory,
        ),
        excluded=tuple(excluded),
        cause=cause,
    )
    return plan, est.over_memory(memory)


def candidate_of(policy: Policy, plan: Plan, oom: str | None) -> Candidate:
    """A priced plan as a candidate: infeasible when it runs out of memory (`oom` says where)."""
    e = plan.estimates
    peak = max(e.peak_memory_bytes.values(), default=0)
    if oom:
        return Candidate(policy, False, oom, e.step_seconds, e.transition_seconds, 0.0, peak, None)
    risk = at_risk(plan.pipelines, plan.routing)
    return Candidate(
        policy, True, "", e.step_seconds, e.transition_seconds, e.score, peak, plan, risk
    )


def at_risk(
    pipelines: Sequence[Pipeline], routing: tuple[tuple[tuple[str, ...], ...], ...]
) -> float:
    """The share of the plan's workers whose loss would leave some layer with no copy: those
    that are a layer's only holder among the workers the plan runs (a rerouted slot's owner
    is gone and holds nothing)."""
    for seen, seen_routing, risk in _RISKS:
        if seen is pipelines and seen_routing is routing:
            return risk
    running = executors(routing)
    if not running:
        return 0.0
    spans = [(st.first_layer, st.end_layer, st.worker) for pipe in pipelines
             for st in pipe.stages if st.worker in running]  # fmt: skip
    n_layers = max((b for _, b, _ in spans), default=0)
    if len({w for _, _, w in spans}) < len(spans):  # a worker of several stages: merged
        held = of_pipelines(pipelines, running.__contains__)
        spans = [(a, b, w) for w, ivs in held.items() for a, b in ivs]
    risk = len(sole_holders(spans, n_layers)) / len(running)
    if isinstance(pipelines, tuple) and isinstance(routing, tuple):  # immutable: kept
        _RISKS.insert(0, (pipelines, routing, risk))
        del _RISKS[4:]
    return risk


# The last plans' risk, by identity: a candidate's plan is priced, then made a candidate, and the
# dynamic one's also made a switch.
_RISKS: list[tuple[Sequence[Pipeline], Sequence[Sequence[Sequence[str]]], float]] = []


def switch_pays_after(step_rr: float, step_dyn: float, switch: Estimates) -> float | None:
    """Remaining window R above which switching from reroute to the prepared plan pays."""
    if step_dyn >= step_rr:
        return None
    return switch.transition_seconds * step_rr / (step_rr - step_dyn)


def reroute_candidate(
    spec: JobSpec,
    est: Estimator,
    current: Plan,
    fenced: set[str],
    held: Held,
    generation: int,
    mtbf: float,
    cause: str,
) -> Candidate:
    result = reroute(spec, current, fenced)
    if result.routing is None:
        return infeasible(Policy.REROUTE, result.reason, spec.rebuild_seconds)
    return routed_candidate(
        spec, est, current, result.routing, fenced, held, generation, mtbf, cause
    )


def routed_candidate(
    spec: JobSpec,
    est: Estimator,
    current: Plan,
    routing: RoutingTable,
    fenced: set[str],
    held: Held,
    generation: int,
    window: float,
    cause: str,
) -> Candidate:
    """The current layout with this routing (a reroute, or a slow worker's weighted share): the
    owners that never acknowledged their layers receive them (repairs); nothing changed costs
    nothing, else the rebuild and the repairs."""
    excluded = sorted(fenced, key=worker_order(spec).__getitem__)
    running = executors(routing)
    try:  # owners that never acknowledged the layers the layout gives them receive them now
        repairs, seconds = restorer.repairs(spec, current.pipelines, running, held)
    except restorer.LostLayers as e:
        return infeasible(Policy.REROUTE, str(e), spec.rebuild_seconds)
    unchanged = routing == current.routing and set(current.excluded) == fenced
    transition = 0.0 if unchanged and not repairs else spec.rebuild_seconds + seconds
    plan, oom = priced_plan(
        spec, est, Policy.REROUTE, generation, current.pipelines, routing, excluded, repairs,
        transition, window, cause,
    )  # fmt: skip
    return candidate_of(Policy.REROUTE, plan, oom)


def drop_candidate(
    spec: JobSpec,
    est: Estimator,
    current: Plan,
    out: set[str],
    held: Held,
    generation: int,
    mtbf: float,
    cause: str,
) -> Candidate:
    result = drop(spec, current, out, held)
    if result.routing is None:
        return infeasible(Policy.DROP, result.reason, spec.rebuild_seconds)
    fenced = out | set(current.excluded)
    excluded = sorted(fenced, key=worker_order(spec).__getitem__)
    plan, oom = priced_plan(
        spec, est, Policy.DROP, generation, result.pipelines, result.routing, excluded, (),
        spec.rebuild_seconds, mtbf, cause,
    )  # fmt: skip
    return candidate_of(Policy.DROP, plan, oom)


def regrow_candidate(
    spec: JobSpec,
    est: Estimator,
    current: Plan,
    survivors: Sequence[str],
    fenced: set[str],
    held: Held,
    generation: int,
    mtbf: float,
    cause: str,
    joining: bool,
) -> Candidate:
    """The job's own pipelines whose workers are all live (core.drop.regrow), the workers
    receiving the layers of their slots they do not hold: on a join, with a smaller batch
    running, the job grows back; on a fault, an alternative to dropping from the current plan.
    Scored over the window to the next fault or return (`mtbf` here: rule 5)."""
    if spec.training.fixed_batch:
        return infeasible(Policy.DROP, FIXED_BATCH, spec.rebuild_seconds)
    try:
        own = layout_pipelines(spec)
    except LayoutError as e:
        return infeasible(Policy.DROP, str(e))
    result = regrow(spec, current, own, survivors, joining=joining)
    if result.routing is None:
        return infeasible(Policy.DROP, result.reason, spec.rebuild_seconds)
    try:
        migration, seconds = restorer.repairs(spec, result.pipelines, survivors, held)
    except restorer.LostLayers as e:
        return infeasible(Policy.DROP, str(e), spec.rebuild_seconds)
    excluded = sorted(fenced - set(survivors), key=worker_order(spec).__getitem__)
    plan, oom = priced_plan(
        spec, est, Policy.DROP, generation, result.pipelines, result.routing, excluded, migration,
        spec.rebuild_seconds + seconds, mtbf, cause,
    )  # fmt: skip
    return candidate_of(Policy.DROP, plan, oom)


def dynamic_candidate(
    spec: JobSpec,
    est: Estimator,
    current: Plan,
    survivors: Sequence[str],
    held: Held,
    generation: int,
    mtbf: float,
    cause: str,
    fenced: set[str],
) -> tuple[Candidate, Plan | None, float, int]:
    """The dynamic candidate, the same plan as a background switch (search hidden), search time,
    layouts considered."""
    found = search(spec, survivors)
    search_seconds = found.plans_considered * spec.costs.search_seconds_per_plan
    if found.layout is None:
        reason = found.reason or "no layout"
        return infeasible(Policy.DYNAMIC, reason), None, search_seconds, found.plans_considered
    try:
        restored = restorer.assign(
            spec, current, found.layout.shape, found.layout.micro_batches, survivors, held
        )
    except (restorer.RestoreError, restorer.LostLayers) as e:
        return infeasible(Policy.DYNAMIC, str(e)), None, search_seconds, found.plans_considered
    order = worker_order(spec)
    known = {st.worker for pipe in current.pipelines for st in pipe.stages} | set(current.excluded)
    # Failed workers are excluded; survivors a layout leaves idle stay on standby (spares).
    excluded = sorted((known | fenced) - set(survivors), key=order.__getitem__)

    def priced(
        pipelines: Sequence[Pipeline],
        migration: tuple[Transfer, ...],
        moving: float,
        routing: RoutingTable | None = None,
    ) -> tuple[Plan, str | None, float]:
        # Chosen now: search, migration and rebuild stop training. As a follow-up the search is
        # hidden; the migration still stops training (the state it moves changes every step).
        switch_seconds = moving + spec.rebuild_seconds
        plan, oom = priced_plan(
            spec, est, Policy.DYNAMIC, generation, pipelines,
            own_routing(pipelines) if routing is None else routing, excluded,
            migration, search_seconds + switch_seconds, mtbf, cause,
        )  # fmt: skip
        return plan, oom, switch_seconds

    plan, oom, switch_seconds = priced(
        restored.pipelines, restored.migration, restored.migration_seconds
    )
    # The job's own layout, whole or rerouted around its missing workers, beside the search's.
    alt = None
    own = own_layout(spec, survivors, held)
    if own is not None:
        alt = priced(*own)
    elif (around := own_layout_rerouted(spec, current, survivors, held)) is not None:
        alt = priced(*around)
    if alt is not None:
        faster = (alt[0].estimates.step_seconds, alt[2]) < (plan.estimates.step_seconds,
                                                             switch_seconds)  # fmt: skip
        if alt[1] is None and (oom is not None or faster):
            plan, oom, switch_seconds = alt
    switch = replace(
        plan,
        estimates=replace(
            plan.estimates,
            transition_seconds=switch_seconds,
            score=selector.score(
                plan.global_batch,
                plan.estimates.step_seconds,
                switch_seconds,
                mtbf,
                at_risk(plan.pipelines, plan.routing),
                spec.restart_seconds,
            ),
        ),
    )
    cand = candidate_of(Policy.DYNAMIC, plan, oom)
    return cand, (switch if cand.feasible else None), search_seconds, found.plans_considered


def restore_seconds(
    spec: JobSpec, current: Plan, plan: Plan, checkpoint_step: int, step: int | None
) -> float:
    """A restore's transition: every worker reads its slot's state from the checkpoint (the
    largest slot bounds it), the steps since the checkpoint are trained again, and the
    communicators are rebuilt."""
    est = Estimator(spec)
    largest = max(
        (est.table.state_bytes(st.first_layer, st.end_layer) for p in plan.pipelines
         for st in p.stages),
        default=0,
    )  # fmt: skip
    load = largest / spec.costs.checkpoint_read_bytes_per_second
    lost_steps = max(0, step - checkpoint_step) if step is not None else 0
    return load + lost_steps * current.estimates.step_seconds + spec.rebuild_seconds
