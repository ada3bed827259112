"""The drop candidate: the pipelines that lost a worker are left out, the others train on.

TorchFT-style elasticity for jobs that accept a smaller batch (`training.min_global_batch` below
`global_batch`): a pipeline any of whose stage owners or routing executors failed (or is excluded
by the current plan) is dropped; every other pipeline is kept unchanged, with the same stages,
the same `first_micro_batch` and the same `micro_batches`. The dropped pipelines' global
micro-batch ids are not trained while the plan runs, so a step trains the kept pipelines' samples
only and the plan's `global_batch` says how many (the workers divide the summed gradients by it).
Nothing moves (the kept owners hold their layers): the transition is a communicator rebuild.
The alive workers of a dropped pipeline are simply not in the plan, idle until a later plan
takes them back.

Infeasible, with the reason, when the job's batch is fixed, when no worker of the current plan
failed, when nothing or too few samples would remain, or when a kept owner does not hold its
layers yet (a fault during a transition, core.holdings).

On a join the candidate grows back (`regrow`, TorchFT's rejoin): the job's own pipelines
(`spec.layout`) whose workers are all live, each training its own micro-batch ids, the returning
workers receiving their slots' layers from a replica. Offered while fewer than all of them are
whole (with all of them it is the job's own layout, which the dynamic candidate prices at the
full batch) and when it trains more samples per step than the current plan. On a fault the same
set is the alternative to the current plan's unbroken pipelines, and the higher score is the drop
candidate: a layout that crosses hosts (the search's) loses several pipelines to one host's
fault, the job's own host-aligned layout one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from chameleond.core.holdings import Held
from chameleond.core.layout import own_routing
from chameleond.core.plan import Pipeline, Plan
from chameleond.core.reroute import RoutingTable
from chameleond.core.spec import JobSpec

FIXED_BATCH = "the job's global batch is fixed (min_global_batch)"


@dataclass(frozen=True)
class Dropping:
    pipelines: tuple[Pipeline, ...]  # the kept pipelines, unchanged; () when infeasible
    routing: RoutingTable | None  # their rows of the current routing; None: infeasible
    reason: str = ""  # why dropping is infeasible
    dropped: tuple[int, ...] = ()  # indices of the dropped pipelines in the current plan


def drop(spec: JobSpec, current: Plan, failed: Collection[str], held: Held) -> Dropping:
    """The current plan without the pipelines that lost a worker. `failed`: the cumulative failed
    set of the decision; `held`: what the live workers hold (core.holdings)."""
    if spec.training.fixed_batch:
        return Dropping((), None, FIXED_BATCH)
    out = set(failed)
    fenced = out | set(current.excluded)
    running = {w for pipe in current.routing for stage in pipe for w in stage} - set(
        current.excluded
    )
    if not out & running:
        return Dropping((), None, "no pipeline lost a worker")
    kept: list[int] = []
    dropped: list[int] = []
    for p, (pipe, rows) in enumerate(zip(current.pipelines, current.routing, strict=True)):
        workers = {st.worker for st in pipe.stages} | {w for row in rows for w in row}
        (dropped if workers & fenced else kept).append(p)
    if not dropped:
        return Dropping((), None, "no pipeline lost a worker")
    if not kept:
        return Dropping((), None, f"every one of the {len(dropped)} pipelines lost a worker")
    pipelines = tuple(current.pipelines[p] for p in kept)
    samples = sum(p.micro_batches for p in pipelines) * spec.training.micro_batch
    least = spec.training.min_global_batch
    if samples < least:
        return Dropping(
            (), None, f"{samples} samples per step would remain, below min_global_batch {least}"
        )
    for p in kept:
        for s, st in enumerate(current.pipelines[p].stages):
            ivs = held.get(st.worker, ())
            if not any(a <= st.first_layer and st.end_layer <= b for a, b in ivs):
                return Dropping(
                    (), None,
                    f"{st.worker} (stage {s} of pipeline {p}) does not hold layers "
                    f"{st.first_layer}-{st.end_layer - 1} yet",
                )  # fmt: skip
    routing = tuple(current.routing[p] for p in kept)
    return Dropping(pipelines, routing, "", tuple(dropped))


def regrow(
    spec: JobSpec,
    current: Plan,
    own: Sequence[Pipeline],
    survivors: Collection[str],
    *,
    joining: bool = True,
) -> Dropping:
    """The job's own pipelines `own` whose workers are all in `survivors`, with their own
    routing (the caller prices the layers the workers lack). On a join (`joining`) only when
    they train more samples than the current plan."""
    if spec.training.fixed_batch:
        return Dropping((), None, FIXED_BATCH)
    live = set(survivors)
    whole = [p for p, pipe in enumerate(own) if all(st.worker in live for st in pipe.stages)]
    if len(whole) == len(own):
        return Dropping((), None, "every pipeline of the job is whole: the full batch trains")
    pipelines = tuple(own[p] for p in whole)
    samples = sum(p.micro_batches for p in pipelines) * spec.training.micro_batch
    if joining and samples <= current.global_batch:
        return Dropping(
            (), None, f"the whole pipelines train {samples} samples per step, the current plan "
            f"{current.global_batch}",
        )  # fmt: skip
    if samples < spec.training.min_global_batch:
        return Dropping(
            (), None, f"{samples} samples per step, below min_global_batch "
            f"{spec.training.min_global_batch}",
        )  # fmt: skip
    routing = own_routing(pipelines)
    dropped = tuple(p for p in range(len(own)) if p not in set(whole))
    return Dropping(pipelines, routing, "", dropped)
