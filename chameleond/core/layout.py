"""The job's own layout (`spec.layout`, as the operator laid it out: host-aligned pipelines) as
plans are built from it: its pipelines, split as the search splits them, and that layout priced
for a decision, whole again or rerouted around its missing workers.

The search prices every stage boundary at the slowest link among the survivors (core.search), so
over hosts it cannot tell a host-aligned layout from one whose pipelines cross hosts; `decide`
prices the job's own layout beside the search's, each boundary at its real link, and keeps the
faster (docs/planner.md, "Beyond the paper" 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from chameleond.core import restorer
from chameleond.core.holdings import Held
from chameleond.core.plan import Pipeline, Plan, Stage, Transfer
from chameleond.core.reroute import RoutingTable, reroute
from chameleond.core.search import ShapeModel, micro_batch_floor
from chameleond.core.spec import JobSpec


class LayoutError(ValueError):
    """The job's own layout does not fit (a pipeline over memory with every split)."""


def layout_pipelines(spec: JobSpec) -> list[Pipeline]:
    """The pipelines of `spec.layout`, split as `initial_plan` describes."""
    workers = [w for pipe in spec.layout for w in pipe]
    model = ShapeModel(spec, workers)
    lengths = [len(pipe) for pipe in spec.layout]
    micro = micro_batch_split(model, lengths, spec.training.micro_batches)
    pipelines, first = [], 0
    for p, (pipe, m) in enumerate(zip(spec.layout, micro, strict=True)):
        _, sizes = model.best(len(pipe), m)
        if sizes is None:
            raise LayoutError(
                f"plan: pipeline {p} ({len(pipe)} stages) does not fit in memory with any split"
            )
        stages = tuple(Stage(w, a, b) for w, (a, b) in zip(pipe, model.bounds(sizes), strict=True))
        pipelines.append(Pipeline(stages, first, m))
        first += m
    return pipelines


def micro_batch_split(model: ShapeModel, lengths: Sequence[int], total: int) -> list[int]:
    """Algorithm 1 step 2 for given pipelines: proportional floors (at least 1), the remainder to
    the pipelines where one more micro-batch costs least; overshoot taken from the largest."""
    n_surv = sum(lengths)
    micro = [micro_batch_floor(total, n_surv, n) for n in lengths]
    r = total - sum(micro)
    if r >= 0:
        ranked = sorted(
            range(len(lengths)), key=lambda j: (model.best(lengths[j], micro[j] + 1)[0], j)
        )
        for j in ranked[:r]:
            micro[j] += 1
    else:
        for _ in range(-r):
            j = max(range(len(micro)), key=lambda i: (micro[i], lengths[i]))
            micro[j] -= 1
    return micro


def own_routing(pipelines: Sequence[Pipeline]) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """Every slot runs its own micro-batches."""
    return tuple(tuple((st.worker,) * p.micro_batches for st in p.stages) for p in pipelines)


def own_layout(
    spec: JobSpec, survivors: Sequence[str], held: Held
) -> tuple[tuple[Pipeline, ...], tuple[Transfer, ...], float] | None:
    """The job's own layout (`spec.layout`) when every worker of it is live: its pipelines, the
    migration that gives each worker the layers of its slot it does not hold, and that
    migration's seconds; None otherwise. The search prices every stage boundary at the slowest
    link among the survivors (core.search), so when they span hosts it can rank a layout that
    crosses hosts above the operator's host-aligned one; with every worker back (a scale-up after
    repairs) the job's own layout is priced beside the search's and the estimator, with each
    boundary's real link, keeps the faster."""
    live = set(survivors)
    if not all(w in live for pipe in spec.layout for w in pipe):
        return None
    try:
        pipelines = layout_pipelines(spec)
        migration, seconds = restorer.repairs(spec, pipelines, survivors, held)
    except (LayoutError, restorer.LostLayers):
        return None
    return tuple(pipelines), migration, seconds


def own_layout_rerouted(
    spec: JobSpec, current: Plan, survivors: Sequence[str], held: Held
) -> tuple[tuple[Pipeline, ...], tuple[Transfer, ...], float, RoutingTable] | None:
    """The job's own layout with some of its workers out, their micro-batches rerouted to their
    same-stage peers (core.reroute), and the migration that gives each executing worker the
    layers of its slot it lacks: priced beside the search's layout for the reason `own_layout`
    gives. None when every worker of it is live (`own_layout`), when the current plan already has
    its slots (the reroute candidate is this plan), or when some stage has no live peer."""
    live = set(survivors)
    layout_workers = {w for pipe in spec.layout for w in pipe}
    if layout_workers <= live:
        return None
    owners = [[st.worker for st in p.stages] for p in current.pipelines]
    if owners == [list(p) for p in spec.layout]:
        return None  # the current plan runs the job's own layout: the reroute candidate is this
    try:
        pipelines = tuple(layout_pipelines(spec))
    except LayoutError:
        return None
    result = reroute(spec, replace(current, pipelines=pipelines), layout_workers - live)
    if result.routing is None:
        return None
    running = {w for pipe in result.routing for stage in pipe for w in stage}
    try:
        migration, seconds = restorer.repairs(spec, pipelines, running, held)
    except restorer.LostLayers:
        return None
    return pipelines, migration, seconds, result.routing
