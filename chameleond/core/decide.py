"""`decide()`: a fault set in, a `Decision` out (every candidate, the selected plan).

Candidates (PAPER.md sections 3-7):

* reroute: the current layout, failed slots executed by their same-range peers (core.reroute);
  transition = communicator rebuild only (nothing moves).
* dynamic: Algorithm 1 over the survivors (core.search), survivors put into the new slots with the
  fewest bytes moved (core.restorer); transition = search time + migration + rebuild. The search
  time is modelled (plans considered x `costs.search_seconds_per_plan`), never measured, so a
  decision is a pure function of its inputs.
* drop (beyond the paper; only where `training.min_global_batch` < `global_batch`): the current
  pipelines that lost no worker, unchanged (core.drop); a step trains fewer samples, and the
  plan's `global_batch` says how many. transition = rebuild only.

All are timed by the same model (core.estimator) and scored by core.selector, each with the
samples its plan trains per step; the higher score wins, on ties reroute (it moves nothing), then
drop, then dynamic. Beyond the paper (docs/planner.md):

1. Reroute first, switch later: when reroute wins but the dynamic plan steps faster, that plan is
   returned as `follow_up`. Its search runs while the rerouted plan trains (prep = search
   seconds); the switch itself is priced at its real transition, t_sw = migration + rebuild:
   parameters and optimizer state change every step, so state staged ahead of the switch would be
   stale and the migration stops training like any other. Over a remaining window R the switch
   pays when B/t_dyn * (R - t_sw) > B/t_rr * R, i.e. R > t_sw * t_rr / (t_rr - t_dyn) =
   `follow_up_after_seconds`. It is offered only if D > prep + that; whoever switches re-checks
   the remaining window when the plan is ready.
2. Rejoin: `joined` workers are survivors of the dynamic candidate (a scale-up plan); reroute is
   then "keep the current layout": a joined worker that owns a slot of it (it was excluded when
   it failed) takes that slot back, receiving its layers from a peer (ReCycle's rejoin), the
   others stay idle; scored the same way. With every
   worker of `spec.layout` live, the dynamic candidate also prices that layout (`own_layout`) and
   keeps the faster of it and the search's: the search prices every boundary at the slowest link,
   the estimator each at its own.
3. A fault during a transition: decide works from `current` (the last published plan), the
   cumulative failed set and `holdings` (core.holdings: the copies the workers acknowledged).
   State that has not been acknowledged at its new owner still counts at its old owner (sources
   keep it until the plan's first commit), and a kept layout whose owners lack some of their
   layers gets the repairs in its migration.
4. Unrecoverable: some layer has no surviving owner. With a checkpoint that covers every layer
   (`checkpoint_step`, PAPER.md section 9), the Decision selects `restore`: a plan searched over
   the survivors whose workers all load that checkpoint (nobody's memory counts any more, so
   nothing migrates). Its transition is the checkpoint load (the largest slot's state over
   `costs.checkpoint_read_bytes_per_second`) + the work lost since the checkpoint ((step -
   checkpoint_step) x the current plan's step, when `step` is given) + the rebuild. Without
   one, selected=None and `unrecoverable` names the layers and the failed workers that held
   them. Never an exception.
5. The window: a decision that answers a fault scores its candidates over `window_seconds`, the
   expected time to the next fault or return (docs/restorer.md, "The window ends at a fault or a
   return"): a rerouted plan hands a slot back when its worker returns, so a re-partition's
   faster steps count only until then. On a join the regrow (drop's grow back) is scored over the
   window too: a pipeline not grown back now is grown back with the next change (a fault's drop
   or another return's regrow), its transfer beside that change's, at no more than its own
   transition. A join's reroute and dynamic candidates are scored over D (docs/restorer.md says
   what deferring those to the next expected return measured).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from chameleond.core import restorer, selector
from chameleond.core.drop import FIXED_BATCH, drop, regrow
from chameleond.core.estimator import Estimator
from chameleond.core.holdings import Held, of_pipelines, of_plan
from chameleond.core.layout import (
    LayoutError,
    layout_pipelines,
    own_layout,
    own_layout_rerouted,
    own_routing,
)
from chameleond.core.plan import Estimates, Pipeline, Plan, Transfer
from chameleond.core.policy import CANDIDATES, Policy
from chameleond.core.reroute import RoutingTable, reroute
from chameleond.core.search import search
from chameleond.core.spec import JobSpec

POLICIES = tuple(p.value for p in CANDIDATES)


class DecisionError(ValueError):
    """The request itself is wrong (unknown worker, generation not increasing, bad D)."""


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


@dataclass(frozen=True)
class Decision:
    selected: Policy | None  # REROUTE | DYNAMIC | DROP | RESTORE | None (unrecoverable)
    plan: Plan | None
    candidates: tuple[Candidate, ...]  # (reroute, dynamic, drop): CANDIDATES' order
    unrecoverable: str | None
    mtbf_seconds: float
    search_seconds: float
    plans_considered: int
    generation: int
    cause: str = ""
    follow_up: Plan | None = None  # dynamic plan to switch to once prepared (rule 1 above)
    follow_up_after_seconds: float | None = None  # remaining window above which switching pays
    note: str = ""  # e.g. why a forced policy was not taken
    window_seconds: float | None = None  # the window a fault's candidates, or a regrow, used


def _infeasible(policy: Policy, reason: str, transition: float = 0.0) -> Candidate:
    return Candidate(policy, False, reason, math.inf, transition, 0.0, 0, None)


def _order(spec: JobSpec) -> dict[str, int]:
    return {w.id: i for i, w in enumerate(spec.workers)}


def _holders(held: Held) -> dict[int, set[str]]:
    """Layer -> the workers that hold it."""
    out: dict[int, set[str]] = {}
    for w, intervals in held.items():
        for a, b in intervals:
            for layer in range(a, b):
                out.setdefault(layer, set()).add(w)
    return out


def _lost_layers(spec: JobSpec, held: Held, out: set[str]) -> str | None:
    """'layers 4-7 lost every replica (workers w3, w7 failed)', or None."""
    holders_of = _holders(held)
    # A layer without parameters or optimizer state has nothing to lose (as in core.restorer).
    lost = [
        layer
        for layer, lp in enumerate(spec.layers)
        if lp.param_bytes + lp.optimizer_bytes > 0 and not holders_of.get(layer, set()) - out
    ]
    if not lost:
        return None
    order = _order(spec)
    who = sorted({w for layer in lost for w in holders_of.get(layer, ())}, key=order.__getitem__)
    word = "layer" if len(lost) == 1 else "layers"
    last = f"workers {', '.join(who)} failed" if who else "no worker acknowledged a copy"
    return f"{word} {restorer.layer_ranges(lost)} lost every replica ({last})"


def _plan(
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
        pipelines=tuple(pipelines),
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


def _candidate(policy: Policy, plan: Plan, oom: str | None) -> Candidate:
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
    running = {w for pipe in routing for stage in pipe for w in stage}
    held = [ws & running for ws in _holders(of_pipelines(pipelines)).values()]
    sole = {next(iter(ws)) for ws in held if len(ws) == 1}
    return len(sole) / len(running) if running else 0.0


def initial_plan(spec: JobSpec, generation: int = 1, mtbf_seconds: float | None = None) -> Plan:
    """The plan of `spec.layout`: each pipeline's layers split as the search splits them (the
    fastest of the split balanced by time and memory and the even splits, later stages taking the
    leftover layers on ties), micro-batches split proportionally to pipeline length as Algorithm 1
    step 2 does."""
    mtbf = spec.mtbf_prior_seconds if mtbf_seconds is None else mtbf_seconds
    try:
        pipelines = layout_pipelines(spec)
    except LayoutError as e:
        raise DecisionError(str(e)) from e
    routing = own_routing(pipelines)
    plan, oom = _plan(
        spec, Estimator(spec), Policy.INITIAL, generation, pipelines, routing, (), (), 0.0, mtbf, ""
    )
    if oom:
        raise DecisionError(f"plan: {oom}")
    return plan


def decide(
    spec: JobSpec,
    current: Plan,
    failed: Iterable[str],
    *,
    mtbf_seconds: float,
    generation: int,
    joined: Iterable[str] = (),
    window_seconds: float | None = None,
    force: Policy | str | None = None,
    cause: str = "",
    holdings: Held | None = None,
    checkpoint_step: int | None = None,
    step: int | None = None,
) -> Decision:
    """Every candidate for the cumulative failed set (and any joined workers), and the choice.
    `holdings`: who holds which layers (core.holdings); by default what `current` gives them.
    `checkpoint_step`: the newest checkpoint that covers every layer, if the job has one;
    `step`: the job's newest committed step (prices the work a restore loses).
    `mtbf_seconds`: D, the expected time to the next fault; `window_seconds`: the expected time to
    the next fault or return (selector.window_seconds; default D). A decision that answers a
    fault scores every candidate over the window, a join its regrow only (rule 5)."""
    order = _order(spec)
    out, back = set(failed), set(joined)
    unknown = sorted((out | back) - set(order))
    if unknown:
        raise DecisionError(f"unknown worker(s): {', '.join(unknown)}")
    if not (mtbf_seconds > 0):
        raise DecisionError(f"mtbf_seconds: must be > 0, got {mtbf_seconds!r}")
    if window_seconds is not None and not (0 < window_seconds <= mtbf_seconds):
        raise DecisionError(f"window_seconds: must be in (0, mtbf_seconds], got {window_seconds!r}")
    if generation <= current.generation:
        raise DecisionError(
            f"generation {generation} does not follow the current plan's {current.generation}"
        )
    if force is not None and force not in POLICIES:
        raise DecisionError(f"force: {force!r} is not one of {POLICIES}")
    forced = None if force is None else Policy(force)
    back -= out
    # Workers fenced by the current plan hold nothing usable, even when they come back.
    fenced = out | set(current.excluded)
    joining = bool(back) and not out - set(current.excluded)  # a join, no new fault
    window = float(mtbf_seconds if window_seconds is None else window_seconds)
    mtbf = float(mtbf_seconds) if joining else window  # what the candidates are scored over
    every = of_plan(current) if holdings is None else holdings

    owners = {st.worker for pipe in current.pipelines for st in pipe.stages}
    survivors = sorted((owners - fenced) | back, key=order.__getitem__)
    est = Estimator(spec)
    lost = _lost_layers(spec, every, fenced)
    if lost is not None:
        cands = tuple(_infeasible(p, lost) for p in CANDIDATES)
        if checkpoint_step is None:
            return Decision(None, None, cands, lost, mtbf, 0.0, 0, generation, cause,
                            window_seconds=window)  # fmt: skip
        # Every survivor loads its layers from the checkpoint: any of them suits any slot.
        anywhere = {w: [(0, len(spec.layers))] for w in survivors}
        dyn, _, search_seconds, considered = _dynamic_candidate(
            spec, est, current, survivors, anywhere, generation, mtbf, cause, fenced
        )
        if dyn.plan is None:
            why = f"{lost}; no plan to restore step {checkpoint_step} on: {dyn.reason}"
            return Decision(None, None, cands, why, mtbf, search_seconds, considered, generation,
                            cause, window_seconds=window)  # fmt: skip
        transition = restore_seconds(spec, current, dyn.plan, checkpoint_step, step)
        estimates = replace(
            dyn.plan.estimates,
            transition_seconds=transition,
            score=selector.score(
                dyn.plan.global_batch, dyn.plan.estimates.step_seconds, transition, mtbf,
                dyn.at_risk, spec.restart_seconds,
            ),
        )  # fmt: skip
        plan = replace(
            dyn.plan, policy=Policy.RESTORE, restore_step=checkpoint_step, estimates=estimates
        )
        note = f"{lost}: every worker loads the checkpoint of step {checkpoint_step}"
        return Decision(Policy.RESTORE, plan, cands, None, mtbf, search_seconds, considered,
                        generation, cause, note=note, window_seconds=window)  # fmt: skip

    held = {w: list(ivs) for w, ivs in every.items() if w not in fenced}
    # A returning worker whose slot the current layout still has takes it back (ReCycle).
    reclaim = back & owners
    rr = _reroute_candidate(spec, est, current, fenced - reclaim, held, generation, mtbf, cause)
    dyn, switch, search_seconds, considered = _dynamic_candidate(
        spec, est, current, survivors, held, generation, mtbf, cause, fenced
    )

    grown = _regrow_candidate(
        spec, est, current, survivors, fenced, held, generation, window, cause, joining
    )
    dr = grown
    if not joining:
        kept = _drop_candidate(spec, est, current, out, held, generation, mtbf, cause)
        # The current plan without its broken pipelines, or the job's own pipelines that are
        # whole (when the current layout crosses hosts, one host's fault breaks several of its
        # pipelines and only one of the job's own): the higher score; nothing moves on ties.
        dr = kept if not grown.feasible or kept.score >= grown.score else grown
    cands = (rr, dyn, dr)

    selected, note = select(cands, forced)
    by_policy = {c.policy: c for c in cands}
    if selected is None:
        weighed = [rr, dyn] if spec.training.fixed_batch else [rr, dyn, dr]
        reason = "no feasible plan: " + "; ".join(f"{c.policy}: {c.reason}" for c in weighed)
        return Decision(
            None, None, cands, reason, mtbf, search_seconds, considered, generation, cause,
            note=note, window_seconds=window,
        )  # fmt: skip

    follow_up, after = None, None
    if selected == Policy.REROUTE and dyn.feasible and switch is not None:
        after = _switch_pays_after(rr.step_seconds, dyn.step_seconds, switch.estimates)
        prep = search_seconds
        if after is not None and mtbf > prep + after:
            follow_up = replace(switch, generation=generation + 1)
        else:
            after = None
    return Decision(
        selected,
        by_policy[selected].plan,
        cands,
        None,
        mtbf,
        search_seconds,
        considered,
        generation,
        cause,
        follow_up,
        after,
        note,
        window,
    )


# On equal scores the candidate that moves the fewest bytes: reroute and drop move nothing (drop
# also trains fewer samples, so it ties reroute only where both are worth the same), dynamic last.
_TIE_ORDER = (Policy.REROUTE, Policy.DROP, Policy.DYNAMIC)


def select(
    candidates: Sequence[Candidate], force: Policy | None = None
) -> tuple[Policy | None, str]:
    """The policy to run (None: none is feasible) and a note when a forced policy was not.

    The higher score wins; on ties reroute, then drop, then dynamic (_TIE_ORDER).
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
    best = max(feasible, key=lambda c: (c.score, -_TIE_ORDER.index(c.policy)))
    return best.policy, note


def _switch_pays_after(step_rr: float, step_dyn: float, switch: Estimates) -> float | None:
    """Remaining window R above which switching from reroute to the prepared plan pays."""
    if step_dyn >= step_rr:
        return None
    return switch.transition_seconds * step_rr / (step_rr - step_dyn)


def _reroute_candidate(
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
        return _infeasible(Policy.REROUTE, result.reason, spec.rebuild_seconds)
    excluded = sorted(fenced, key=_order(spec).__getitem__)
    running = {w for pipe in result.routing for stage in pipe for w in stage}
    try:  # owners that never acknowledged the layers the layout gives them receive them now
        repairs, seconds = restorer.repairs(spec, current.pipelines, running, held)
    except restorer.LostLayers as e:
        return _infeasible(Policy.REROUTE, str(e), spec.rebuild_seconds)
    unchanged = result.routing == current.routing and set(current.excluded) == fenced
    transition = 0.0 if unchanged and not repairs else spec.rebuild_seconds + seconds
    plan, oom = _plan(
        spec, est, Policy.REROUTE, generation, current.pipelines, result.routing, excluded, repairs,
        transition, mtbf, cause,
    )  # fmt: skip
    return _candidate(Policy.REROUTE, plan, oom)


def _drop_candidate(
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
        return _infeasible(Policy.DROP, result.reason, spec.rebuild_seconds)
    fenced = out | set(current.excluded)
    excluded = sorted(fenced, key=_order(spec).__getitem__)
    plan, oom = _plan(
        spec, est, Policy.DROP, generation, result.pipelines, result.routing, excluded, (),
        spec.rebuild_seconds, mtbf, cause,
    )  # fmt: skip
    return _candidate(Policy.DROP, plan, oom)


def _regrow_candidate(
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
        return _infeasible(Policy.DROP, FIXED_BATCH, spec.rebuild_seconds)
    try:
        own = layout_pipelines(spec)
    except LayoutError as e:
        return _infeasible(Policy.DROP, str(e))
    result = regrow(spec, current, own, survivors, joining=joining)
    if result.routing is None:
        return _infeasible(Policy.DROP, result.reason, spec.rebuild_seconds)
    try:
        migration, seconds = restorer.repairs(spec, result.pipelines, survivors, held)
    except restorer.LostLayers as e:
        return _infeasible(Policy.DROP, str(e), spec.rebuild_seconds)
    excluded = sorted(fenced - set(survivors), key=_order(spec).__getitem__)
    plan, oom = _plan(
        spec, est, Policy.DROP, generation, result.pipelines, result.routing, excluded, migration,
        spec.rebuild_seconds + seconds, mtbf, cause,
    )  # fmt: skip
    return _candidate(Policy.DROP, plan, oom)


def _dynamic_candidate(
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
        return _infeasible(Policy.DYNAMIC, reason), None, search_seconds, found.plans_considered
    try:
        restored = restorer.assign(
            spec, current, found.layout.shape, found.layout.micro_batches, survivors, held
        )
    except (restorer.RestoreError, restorer.LostLayers) as e:
        return _infeasible(Policy.DYNAMIC, str(e)), None, search_seconds, found.plans_considered
    order = _order(spec)
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
        plan, oom = _plan(
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
    cand = _candidate(Policy.DYNAMIC, plan, oom)
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
        "candidates": [candidate_to_dict(c) for c in d.candidates],
        "follow_up": follow,
        "note": d.note,
    }
