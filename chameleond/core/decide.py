"""`decide()`: a fault set in, a `Decision` out (every candidate, the selected plan).

The candidates (PAPER.md sections 3-7; core/candidates.py): reroute (the current layout, failed
slots executed by their same-range peers), dynamic (Algorithm 1 over the survivors) and, where
`training.min_global_batch` < `global_batch`, drop (the pipelines that lost no worker).

All are timed by the same model (core.estimator) and scored by core.selector, each with the
samples its plan trains per step; the higher score wins, on ties reroute (it moves nothing), then
drop, then dynamic (core/decision.py, `select`). Beyond the paper (docs/planner.md):

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

import functools
import gc
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import ParamSpec, TypeVar

from chameleond.core import selector
from chameleond.core.candidates import (
    drop_candidate,
    dynamic_candidate,
    infeasible,
    lost_layers,
    priced_plan,
    regrow_candidate,
    reroute_candidate,
    restore_seconds,
    switch_pays_after,
    worker_order,
)
from chameleond.core.decision import Decision, select
from chameleond.core.estimator import Estimator
from chameleond.core.holdings import Held, of_plan
from chameleond.core.layout import LayoutError, layout_pipelines, own_routing
from chameleond.core.plan import Plan
from chameleond.core.policy import CANDIDATES, Policy
from chameleond.core.roster import roster
from chameleond.core.search import result_key, search, tables_key
from chameleond.core.spec import JobSpec

POLICIES = tuple(p.value for p in CANDIDATES)


class DecisionError(ValueError):
    """The request itself is wrong (unknown worker, generation not increasing, bad D)."""


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
    plan, oom = priced_plan(
        spec, Estimator(spec), Policy.INITIAL, generation, pipelines, routing, (), (), 0.0, mtbf, ""
    )
    if oom:
        raise DecisionError(f"plan: {oom}")
    return plan


P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(f: Callable[P, R]) -> Callable[P, R]:
    """`f` with Python's cyclic garbage collector paused while it runs. A decision allocates
    hundreds of thousands of short-lived objects at 8,192 workers, nearly all freed by reference
    counting; with the collector on, they start full collections that walk every live object
    (the spec, the plans) while a fault waits. Those collections run after the decision."""

    @functools.wraps(f)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        was = gc.isenabled()
        gc.disable()
        try:
            return f(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return paused


# The faults a plan's decision is prepared for (`prepare`): its last host, and its last workers.
PREPARED_LOSSES = (1, 2, 4)


@gc_paused
def prepare(spec: JobSpec, current: Plan) -> None:
    """Search, between faults, as the decisions on `current` after the likeliest faults will:
    the loss of the host of its last running worker, and of its last 1, 2 and 4 workers. The
    search keeps its tables (core.search `job_tables`: pipeline shapes, split costs, bounds) and
    its results (by what they are computed from: the survivors' count, least memory and hosts,
    `result_key`), so that the decision a fault waits for neither builds tables nor searches.
    The tables of one host's loss also serve another host's loss and the loss of one, two or
    four workers (tests/test_search_at_scale.py: those searches time no new shape); each result
    serves a fault of as many workers, on workers alike."""
    for survivors in _likely_survivors(spec, current):
        search(spec, survivors)


def prepared_for(spec: JobSpec, current: Plan) -> tuple[object, ...]:
    """What `prepare(spec, current)` computes from: while it stays equal, preparing again would
    find everything kept."""
    likely = _likely_survivors(spec, current)
    return (tables_key(spec), *(result_key(spec, survivors) for survivors in likely))


def _likely_survivors(spec: JobSpec, current: Plan) -> list[list[str]]:
    order = worker_order(spec)
    owners = {st.worker for pipe in current.pipelines for st in pipe.stages}
    running = sorted(owners - set(current.excluded), key=order.__getitem__)
    if not running:
        return []
    host = roster(spec).host
    gone = host[running[-1]]
    likely = [[w for w in running if host[w] != gone]]
    likely += [running[:-k] for k in PREPARED_LOSSES if k < len(running)]
    return [survivors for survivors in likely if survivors]


@gc_paused
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
    order = worker_order(spec)
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
    lost = lost_layers(spec, every, fenced)
    if lost is not None:
        cands = tuple(infeasible(p, lost) for p in CANDIDATES)
        if checkpoint_step is None:
            return Decision(None, None, cands, lost, mtbf, 0.0, 0, generation, cause,
                            window_seconds=window)  # fmt: skip
        # Every survivor loads its layers from the checkpoint: any of them suits any slot.
        anywhere = {w: [(0, len(spec.layers))] for w in survivors}
        dyn, _, search_seconds, considered = dynamic_candidate(
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
    rr = reroute_candidate(spec, est, current, fenced - reclaim, held, generation, mtbf, cause)
    dyn, switch, search_seconds, considered = dynamic_candidate(
        spec, est, current, survivors, held, generation, mtbf, cause, fenced
    )

    grown = regrow_candidate(
        spec, est, current, survivors, fenced, held, generation, window, cause, joining
    )
    dr = grown
    if not joining:
        kept = drop_candidate(spec, est, current, out, held, generation, mtbf, cause)
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
        after = switch_pays_after(rr.step_seconds, dyn.step_seconds, switch.estimates)
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
