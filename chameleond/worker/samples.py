"""Which samples a plan's steps train, and what a step's sums are divided by.

The sample ids are laid out by the job's global batch B (`Training.global_batch`, the spec's), never
by a plan's: global micro-batch g of step k covers ids [k*B + g*mbs, k*B + (g+1)*mbs). A plan's
pipelines say which of the step's B / mbs global micro-batches are trained. Every plan but a `drop`
plan trains all of them; a drop plan (the job's `[training] min_global_batch` lets the batch shrink)
keeps the surviving pipelines as they were, so the dropped pipelines' micro-batch ids are simply
not trained in its steps: no sample moves to another id, and a later plan with the full batch
trains step k's ids where they always were, so none is trained twice.

A plan's `global_batch` is the samples its steps train (the sum of its pipelines' micro-batches x
mbs): the divisor of the gradient sums and of the loss sum, and the `samples` a step event reports.
"""

from __future__ import annotations

from chameleond.core.plan import Plan


class PlanBatchError(ValueError):
    """A plan's batch does not fit the job: its micro-batches, or its global batch."""


def sample_ids(step: int, micro_batch_id: int, job_batch: int, micro_batch: int) -> range:
    """The ids of global micro-batch `micro_batch_id` of step `step`, for a job of global batch
    `job_batch` (whatever the plan trains)."""
    first = step * job_batch + micro_batch_id * micro_batch
    return range(first, first + micro_batch)


def trained_micro_batches(plan: Plan) -> list[int]:
    """The global micro-batch ids a step of `plan` trains, ascending."""
    return sorted(g for pipe in plan.pipelines for g in pipe.micro_batch_ids)


def check_batch(plan: Plan, job_batch: int, micro_batch: int) -> None:
    """PlanBatchError unless the plan trains distinct micro-batches of the job's step layout, of
    the job's size, and its global batch counts exactly the samples they hold."""
    gen = plan.generation
    if plan.micro_batch != micro_batch:
        raise PlanBatchError(
            f"plan generation {gen}: micro_batch {plan.micro_batch}, the job's is {micro_batch}"
        )
    per_step = job_batch // micro_batch
    seen: set[int] = set()
    for p, pipe in enumerate(plan.pipelines):
        ids = pipe.micro_batch_ids
        if pipe.micro_batches < 1:
            raise PlanBatchError(
                f"plan generation {gen}: pipeline {p} trains {pipe.micro_batches} micro-batches"
            )
        if ids.start < 0 or ids.stop > per_step:
            raise PlanBatchError(
                f"plan generation {gen}: pipeline {p} trains micro-batches "
                f"{ids.start}..{ids.stop - 1}, outside the job's 0..{per_step - 1}"
            )
        overlap = seen.intersection(ids)
        if overlap:
            raise PlanBatchError(
                f"plan generation {gen}: pipeline {p} trains micro-batches {sorted(overlap)} "
                "that an earlier pipeline trains too"
            )
        seen.update(ids)
    trained = len(seen) * micro_batch
    if plan.global_batch != trained:
        raise PlanBatchError(
            f"plan generation {gen}: global_batch {plan.global_batch}, but its pipelines train "
            f"{len(seen)} micro-batches of {micro_batch} = {trained} samples per step"
        )
