"""Re-partitioning around slow workers: a slow worker's stage gets fewer layers, its pipeline
fewer micro-batches.

Algorithm 1 (core.search) assumes equal devices: its layouts give every stage of a length the
same split, and every pipeline micro-batches in proportion to its length. With one worker at
speed v < 1 (`WorkerSpec.speed`), that layout's step waits on the slow stage. This is the step
after it, on a layout whose workers are placed (the search's, restored, or the current plan's):

1. Layers. Each pipeline with a worker whose speed is not 1 gets the split whose slowest stage,
   its work over its worker's speed, is least and that fits every worker's memory
   (`Balancer.split_at_speeds`; a recovered worker's pipeline is balanced back alike).
2. Micro-batches. One at a time, from the pipeline whose workers end their step last to the one
   that ends first, while the step gets shorter; every pipeline keeps one at least.

Every change is timed by the estimator (with the workers' speeds) and kept only if the step is
no longer (a re-split) or shorter (a micro-batch moved), so the result is never slower than its
input. Pipelines with a worker of several stages, or slots rerouted, are left as they are. Plain
data in, plain data out.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from chameleond.core.balance import Balancer
from chameleond.core.estimator import Estimator
from chameleond.core.layout import own_routing
from chameleond.core.plan import Pipeline, Stage
from chameleond.core.restorer import sync_groups
from chameleond.core.roster import roster

# At most this many micro-batches moved between pipelines in one re-partition (each move times
# the whole step once).
MOVES = 64


def speed_split(
    est: Estimator,
    pipelines: Sequence[Pipeline],
    excluded: Collection[str],
    about: Collection[str] = (),
) -> tuple[Pipeline, ...]:
    """`pipelines` (each slot run by its owner) re-split by their workers' speeds and their
    micro-batches moved by pace: the fastest such layout found, `pipelines` if none is faster.
    The pipelines re-split are those with a worker below full speed or named in `about` (the
    workers whose speed the decision is about: a recovered one's pipeline is balanced back)."""
    workers = roster(est.spec)
    speed, memory = workers.speed, workers.memory
    out = tuple(pipelines)
    best = _step(est, out, excluded)
    balancer = Balancer(est.table)
    splits: dict[tuple[tuple[float, ...], int, tuple[int, ...]], tuple[int, ...] | None] = {}
    touched = False
    for p, pipe in enumerate(out):
        owners = [st.worker for st in pipe.stages]
        if len(set(owners)) < len(owners):
            continue
        if all(speed[w] == 1.0 for w in owners) and not any(w in about for w in owners):
            continue
        touched = True
        key = (
            tuple(speed[w] for w in owners),
            min(pipe.micro_batches, len(owners)),
            tuple(memory[w] for w in owners),
        )
        if key not in splits:
            splits[key] = balancer.split_at_speeds(*key)
        sizes = splits[key]
        if sizes is None or sizes == tuple(st.end_layer - st.first_layer for st in pipe.stages):
            continue
        trial = _with(out, p, _resplit(pipe, sizes))
        t = _step(est, trial, excluded)
        if t <= best:  # not slower: another pipeline may bound the step until micro-batches move
            out, best = trial, t
    if touched:
        out, best = _move_micro_batches(est, out, excluded, best)
    return out


def _move_micro_batches(
    est: Estimator, pipelines: tuple[Pipeline, ...], excluded: Collection[str], best: float
) -> tuple[tuple[Pipeline, ...], float]:
    """One micro-batch at a time from the pipeline that ends last to the one that ends first,
    while the step gets shorter (at most MOVES)."""
    out = pipelines
    for _ in range(MOVES):
        if len(out) < 2:
            break
        finishes = est.finishes(out, own_routing(out))
        ends = [max(finishes.get(st.worker, 0.0) for st in pipe.stages) for pipe in out]
        late = max(range(len(out)), key=ends.__getitem__)
        early = min(range(len(out)), key=ends.__getitem__)
        if late == early or out[late].micro_batches <= 1:
            break
        counts = [p.micro_batches for p in out]
        counts[late] -= 1
        counts[early] += 1
        trial = _renumbered(out, counts)
        t = _step(est, trial, excluded)
        if t >= best:
            break
        out, best = trial, t
    return out, best


def _step(est: Estimator, pipelines: Sequence[Pipeline], excluded: Collection[str]) -> float:
    routing = own_routing(pipelines)
    if est.over_memory(est.peak_memory(pipelines, routing, excluded)):
        return float("inf")
    return est.step_seconds(pipelines, routing, sync_groups(pipelines, excluded))


def _resplit(pipe: Pipeline, sizes: Sequence[int]) -> Pipeline:
    stages, first = [], pipe.stages[0].first_layer
    for st, n in zip(pipe.stages, sizes, strict=True):
        stages.append(Stage(st.worker, first, first + n))
        first += n
    return Pipeline(tuple(stages), pipe.first_micro_batch, pipe.micro_batches)


def _with(pipelines: tuple[Pipeline, ...], p: int, pipe: Pipeline) -> tuple[Pipeline, ...]:
    return (*pipelines[:p], pipe, *pipelines[p + 1 :])


def _renumbered(pipelines: Sequence[Pipeline], counts: Sequence[int]) -> tuple[Pipeline, ...]:
    out, first = [], pipelines[0].first_micro_batch if pipelines else 0
    for pipe, m in zip(pipelines, counts, strict=True):
        out.append(Pipeline(pipe.stages, first, m))
        first += m
    return tuple(out)
