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


def sample_ids(step: int, micro_batch_id: int, job_batch: int, micro_batch: int) -> range:
    """The ids of global micro-batch `micro_batch_id` of step `step`, for a job of global batch
    `job_batch` (whatever the plan trains)."""
    first = step * job_batch + micro_batch_id * micro_batch
    return range(first, first + micro_batch)


def trained_micro_batches(plan: Plan) -> list[int]:
    """The global micro-batch ids a step of `plan` trains, ascending."""
    return sorted(g for pipe in plan.pipelines for g in pipe.micro_batch_ids)
