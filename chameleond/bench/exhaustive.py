"""Algorithm 1's space enumerated literally: the tests' referee where it finishes (up to about a
dozen devices), for the search and for the exact search `chameleonctl bench planner` uses
(bench/exact.py), whose reductions it checks. It lives with the bench, not in the decision core: no
decision depends on it.

No memo and no pruning: for every survivor count the search may use, every partition, every
remainder placement, every combination of layer splits over the pipelines; each pipeline timed by
`schedule.build_schedule` on the search's link.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations, product

from chameleond.core.estimator import LayerTable
from chameleond.core.plan import Pipeline, Stage
from chameleond.core.schedule import FORWARD, build_schedule
from chameleond.core.search import Layout, ShapeModel, micro_batch_floor, spare_counts
from chameleond.core.spec import JobSpec, LinkSpec


@dataclass(frozen=True)
class Exhaustive:
    layout: Layout | None
    layouts: int  # layouts timed
    complete: bool  # False: the space was larger than the limit and the answer is not known


def exhaustive(spec: JobSpec, survivors: Sequence[str], limit: int = 20_000) -> Exhaustive:
    """Algorithm 1's space enumerated literally, without memo or pruning: the search's referee.

    For every survivor count the search may use (`spare_counts`): every partition, every
    remainder placement, every combination of layer splits over the pipelines; each layout timed
    by `schedule.build_schedule` over all its pipelines at once.
    """
    best: Layout | None = None
    timed = 0
    for used in spare_counts(spec, len(survivors)):
        ref = _exhaustive_all(spec, survivors[:used], limit - timed)
        timed += ref.layouts
        if not ref.complete:
            return Exhaustive(None, timed, False)
        if ref.layout is not None and (best is None or ref.layout.seconds < best.seconds):
            best = ref.layout
    return Exhaustive(best, timed, True)


def _exhaustive_all(spec: JobSpec, survivors: Sequence[str], limit: int) -> Exhaustive:
    n_surv, total = len(survivors), spec.training.micro_batches
    model = ShapeModel(spec, survivors)
    lo = max(spec.search.min_stages, 1)
    hi = min(spec.search.max_stages, model.n_layers, n_surv)
    best: Layout | None = None
    timed = 0
    for lengths in partitions(n_surv, lo, hi):
        if len(lengths) > total:
            continue
        for micro in _placements(lengths, n_surv, total):
            splits = [model.candidates(n, m) for n, m in zip(lengths, micro, strict=True)]
            for sizes in product(*splits):
                timed += 1
                if timed > limit:
                    return Exhaustive(None, timed - 1, False)
                if not all(model.fits(sz, m) for sz, m in zip(sizes, micro, strict=True)):
                    continue
                # Pipelines share no worker: each one's longest path, plus its sync share.
                seconds = max(
                    model.with_sync(sz, schedule_finishes(model.table, model.link, sz, m))
                    for sz, m in zip(sizes, micro, strict=True)
                )
                if best is None or seconds < best.seconds:
                    shape = tuple(tuple(model.bounds(sz)) for sz in sizes)
                    best = Layout(shape, tuple(micro), seconds)
    return Exhaustive(best, timed, True)


def partitions(total: int, lo: int, hi: int, floor: int = 0) -> list[tuple[int, ...]]:
    """Non-decreasing sequences of lengths in [lo, hi] summing to total."""
    if total == 0:
        return [()]
    out: list[tuple[int, ...]] = []
    for n in range(max(lo, floor), min(hi, total) + 1):
        out.extend((n, *rest) for rest in partitions(total - n, lo, hi, n))
    return out


def _placements(lengths: Sequence[int], n_surv: int, total: int) -> list[tuple[int, ...]]:
    """Algorithm 1 step 2, literally: floors, repairs, every placement of the remainder."""
    micro = [micro_batch_floor(total, n_surv, n) for n in lengths]
    r = total - sum(micro)
    if r < 0:
        for _ in range(-r):
            j = max(range(len(micro)), key=lambda i: (micro[i], lengths[i]))
            micro[j] -= 1
        return [tuple(micro)]
    out = []
    for extra in combinations(range(len(lengths)), r):
        m = list(micro)
        for j in extra:
            m[j] += 1
        out.append(tuple(m))
    return out


def schedule_finishes(
    table: LayerTable, link: LinkSpec, sizes: Sequence[int], n_micro: int
) -> list[float]:
    """Per stage, the end of its last op in `schedule.build_schedule`'s schedule of one pipeline
    of these stage sizes, a worker per slot, on `link`."""
    stages, first = [], 0
    for s, k in enumerate(sizes):
        stages.append(Stage(f"s{s}", first, first + k))
        first += k
    pipe = Pipeline(tuple(stages), 0, n_micro)
    routing = [[[st.worker] * n_micro for st in pipe.stages]]

    def op(_p: int, s: int, kind: str, _w: str) -> float:
        st = pipe.stages[s]
        if kind == FORWARD:
            return table.forward_seconds(st.first_layer, st.end_layer)
        return table.backward_seconds(st.first_layer, st.end_layer)

    def comm(_p: int, s: int, _k: str, a: str, b: str) -> float:
        end = pipe.stages[s].end_layer
        return 0.0 if a == b else link.transfer_seconds(table.output_bytes(end))

    ops = build_schedule([pipe], routing, op, comm).ops
    return [max(o.end for o in ops[st.worker]) for st in pipe.stages]
