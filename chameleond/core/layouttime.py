"""A layout's step as its plan runs it, at shape level, and the uniform layouts it is weighed
against (core.search's last step; docs/planner.md, "Layouts that split the layers unevenly").

The search's objective times each pipeline alone, its stages' gradients reduced in a ring over
N / n_j peers: exact when every pipeline has one length and one layer split, so that each stage
is one sync group and all groups run in one round. When pipelines cut the layers at different
boundaries (two lengths, or one length whose micro-batch classes chose different splits), a
plan's sync groups are the segments between any two boundaries, each reduced over every
pipeline, and a worker whose stage spans several segments takes part in several groups: they
go to rounds (core.restorer.sync_groups). Such a layout, fastest by the per-pipeline objective,
stepped 10 to 15% slower as a plan than a layout of one length and one split (docs/planner.md).

`layout_seconds` times a layout the way core.estimator times its plan on homogeneous devices
with every stage boundary on `link`: the longest path of each pipeline, then the segments'
all-reduces over all pipelines in the DSATUR rounds of their conflicts, from each segment's last
backward when the job overlaps sync with the backward pass. `settle` weighs the search's layout
against the fastest uniform layout of each allowed length (one split, the micro-batches as even
as they go) and keeps the fastest by that time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from itertools import pairwise

from chameleond.core.colouring import dsatur
from chameleond.core.estimator import (
    LayerTable,
    overlapped_sync_end,
    ring_allreduce_seconds,
    stage_finishes,
)
from chameleond.core.spec import LinkSpec

Stages = tuple[tuple[int, int], ...]  # one pipeline's (first_layer, end_layer) per stage
Sizes = tuple[int, ...]
# A (length, micro-batches) class's fastest memory-feasible split: (its time, its sizes).
Best = Callable[[int, int], tuple[float, Sizes | None]]


@dataclass(frozen=True)
class Timing:
    """What `layout_seconds` times with: the job's layer figures, the link of every stage
    boundary and sync ring, and whether sync overlaps the backward pass."""

    table: LayerTable
    link: LinkSpec
    overlap: bool


def layout_seconds(
    timing: Timing, shape: tuple[Stages, ...], micro_batches: tuple[int, ...]
) -> float:
    """The layout's step: its pipelines' longest paths and its gradient sync as a plan runs it."""
    t, link = timing.table, timing.link
    finishes: dict[tuple[Stages, int], list[float]] = {}
    for stages, m in zip(shape, micro_batches, strict=True):
        if (stages, m) not in finishes:
            fwd = tuple(t.forward_seconds(a, b) for a, b in stages)
            bwd = tuple(t.backward_seconds(a, b) for a, b in stages)
            comm = [link.transfer_seconds(t.output_bytes(b)) for _, b in stages[:-1]]
            finishes[(stages, m)] = stage_finishes(fwd, bwd, comm, m)
    path = max(max(f) for f in finishes.values())
    splits = {stages for stages, _ in finishes}
    bounds = sorted({b for stages in splits for span in stages for b in span})
    index = {b: k for k, b in enumerate(bounds)}
    segments = list(pairwise(bounds))
    # One group per segment, over one worker of each pipeline; a stage's segments are one
    # worker's groups, so they conflict (restorer._group_conflicts, with one owner per slot).
    adjacency: list[set[int]] = [set() for _ in segments]
    for stages in splits:
        for a, b in stages:
            clique = range(index[a], index[b])
            for k in clique:
                adjacency[k].update(clique)
    for k, near in enumerate(adjacency):
        near.discard(k)
    rounds = dsatur(adjacency)
    dp = len(shape)
    seconds = [ring_allreduce_seconds(dp, t.gradient_bytes(a, b), link) for a, b in segments]
    if not timing.overlap:
        slowest: dict[int, float] = {}
        for c, s in zip(rounds, seconds, strict=True):
            slowest[c] = max(slowest.get(c, 0.0), s)
        return path + sum(slowest.values())
    # A segment's gradients are complete when the last pipeline's stage over it ends.
    ready = [0.0] * len(segments)
    for (stages, _), ends in finishes.items():
        for (a, b), end in zip(stages, ends, strict=True):
            for k in range(index[a], index[b]):
                ready[k] = max(ready[k], end)
    return max(path, overlapped_sync_end(ready, seconds, rounds))


def uniform(
    best: Best, survivors: int, total: int, lengths: range, used: Collection[int]
) -> list[tuple[tuple[Stages, ...], tuple[int, ...]]]:
    """For each allowed length n, the layout of floor(N / n) pipelines of n stages (at most one
    per micro-batch) with one split, the fastest for the pipelines given the larger share of
    `total` micro-batches (it fits the others: fewer micro-batches stash less); `used`: the
    survivor counts a layout may use (search.spare_counts)."""
    out = []
    for n in lengths:
        dp = min(survivors // n, total)
        if not dp or n * dp not in used:
            continue
        m, extra = divmod(total, dp)
        sizes = best(n, m + 1 if extra else m)[1]
        if sizes is None:
            continue
        stages, first = [], 0
        for k in sizes:
            stages.append((first, first + k))
            first += k
        # As the search lists its layouts: by (length, micro-batches).
        micro = (m,) * (dp - extra) + (m + 1,) * extra
        out.append(((tuple(stages),) * dp, micro))
    return out


def settle(
    timing: Timing,
    shape: tuple[Stages, ...],
    micro_batches: tuple[int, ...],
    alternatives: list[tuple[tuple[Stages, ...], tuple[int, ...]]],
) -> tuple[tuple[Stages, ...], tuple[int, ...], float]:
    """The fastest of the search's layout and `alternatives` by `layout_seconds`, with its time;
    the search's on ties."""
    chosen = (shape, micro_batches, layout_seconds(timing, shape, micro_batches))
    for alt_shape, alt_micro in alternatives:
        seconds = layout_seconds(timing, alt_shape, alt_micro)
        if seconds < chosen[2]:
            chosen = (alt_shape, alt_micro, seconds)
    return chosen
