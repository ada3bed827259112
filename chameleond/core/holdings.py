"""Holdings: which worker holds a current copy of which layer. The planner restores from these.

A plan says who *should* hold what. What the workers acknowledged says who *does*, and the two
differ while a transition is in flight. Take a plan whose new receiver is cut off from its only
source by a fault: the receiver owns layers in the plan but holds nothing. Planning from the
plan's stage owners would then publish a plan on a worker with no state. The rules follow the
worker runtime (chameleond.worker._migrate, chameleond.worker._runtime):

* `published(plan)`: nothing moves yet. A new owner holds its layers only once it acknowledges.
* `ready(worker)`: the worker finished the generation's migration. It holds what the plan gives
  it, and still holds what it held before: sources keep their layers until the first commit.
* `committed()`: a step of the current generation committed. A step commits on every worker of
  the plan or on none, so each worker of the plan holds exactly its own layers. Workers drop
  unowned layers after that commit, and any copy outside the plan is now a step behind.
* `lost(worker)`: a worker that comes back is a new process and holds nothing. A failed worker's
  entry is simply ignored: `decide` drops the failed workers before it reads holdings.

Pure and plain: intervals [first_layer, end_layer), merged and sorted, keyed by worker id.

`Checkpoints` are the other copies: the steps at which the workers wrote their layers to the job's
checkpoint directory (`checkpoint` events). When some layer has lost every copy in memory, the
newest step whose files cover every layer is what a `restore` plan loads.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chameleond.core.plan import Pipeline, Plan

Interval = tuple[int, int]  # [first_layer, end_layer)
Held = Mapping[str, list[Interval]]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, with overlapping or touching intervals joined."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def of_pipelines(
    pipelines: Iterable[Pipeline], holds: Callable[[str], bool] = lambda w: True
) -> dict[str, list[Interval]]:
    """The layers each worker owns in `pipelines` (those `holds` accepts), merged."""
    raw: dict[str, list[Interval]] = {}
    for pipe in pipelines:
        for st in pipe.stages:
            w = st.worker
            if holds(w):
                got = raw.get(w)
                if got is None:
                    raw[w] = [(st.first_layer, st.end_layer)]
                else:
                    got.append((st.first_layer, st.end_layer))
    # Most workers own one stage: its interval is already merged unless it is empty.
    return {w: ivs if len(ivs) == 1 and ivs[0][0] < ivs[0][1] else merge(ivs)
            for w, ivs in raw.items()}  # fmt: skip


def coverage(held: Held, n_layers: int) -> tuple[list[int], list[str | None]]:
    """Per layer: how many workers of `held` hold it, and its holder where exactly one does
    (None elsewhere). A sweep over the intervals' ends, so linear in the intervals and the
    layers; each worker's intervals must not overlap (merged, as `Held` is)."""
    return spans_coverage([(a, b, w) for w, ivs in held.items() for a, b in ivs], n_layers)


def holder_counts(held: Held, n_layers: int, out: Collection[str] = ()) -> list[int]:
    """Per layer: how many workers of `held`, but those in `out`, hold it (`coverage`'s counts
    alone)."""
    starts: list[int] = []
    ends: list[int] = []
    for w, ivs in held.items():
        if w not in out:
            for a, b in ivs:
                if a < b:
                    starts.append(a)
                    ends.append(min(b, n_layers))
    return _counts(starts, ends, n_layers).tolist()


def sole_holders(spans: Sequence[tuple[int, int, str]], n_layers: int) -> set[str]:
    """The workers of (first_layer, end_layer, worker) spans, no two of one worker overlapping,
    that are some layer's only holder: `spans_coverage`'s sole holders, as a set."""
    starts = np.array([a for a, _, _ in spans], np.intp)
    ends = np.minimum(np.array([b for _, b, _ in spans], np.intp), n_layers)
    alone = _counts(starts, ends, n_layers) == 1
    if not alone.any():
        return set()
    # A span over a layer held once is that layer's holder.
    prefix = np.concatenate(([0], np.cumsum(alone)))
    over = np.flatnonzero((prefix[ends] - prefix[starts] > 0) & (starts < ends))
    return {spans[i][2] for i in over.tolist()}


def _counts(starts: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray,
            n_layers: int) -> np.ndarray:  # fmt: skip
    """Per layer, the spans [start, end) over it (ends at most n_layers)."""
    size = n_layers + 1
    first, end = np.asarray(starts, np.intp), np.asarray(ends, np.intp)
    count = np.bincount(first, minlength=size) - np.bincount(end, minlength=size)
    return np.cumsum(count[:n_layers])


def spans_coverage(
    spans: Sequence[tuple[int, int, str]], n_layers: int
) -> tuple[list[int], list[str | None]]:
    """`coverage` of (first_layer, end_layer, worker) spans, no two of one worker overlapping."""
    workers = list(dict.fromkeys(w for _, _, w in spans))
    number = {w: i for i, w in enumerate(workers)}
    starts = [a for a, b, _ in spans if a < b]
    ends = [min(b, n_layers) for a, b, _ in spans if a < b]
    index = [number[w] for a, b, w in spans if a < b]
    size = n_layers + 1
    first, end = np.array(starts, np.intp), np.array(ends, np.intp)
    count = np.bincount(first, minlength=size) - np.bincount(end, minlength=size)
    # The sum of the holders' indices: the holder itself where there is one.
    at = np.array(index, np.int64)
    which = np.bincount(first, at, size).astype(np.int64) - np.bincount(end, at, size).astype(
        np.int64
    )
    counts = np.cumsum(count[:n_layers]).tolist()
    sums = np.cumsum(which[:n_layers]).tolist()
    return counts, [workers[i] if c == 1 else None for c, i in zip(counts, sums, strict=True)]


def of_plan(plan: Plan, alive: Collection[str] | None = None) -> dict[str, list[Interval]]:
    """The layers each worker owns under `plan`, i.e. what it holds once the plan is in place.
    Workers in `plan.excluded`, and those not in `alive` when it is given, hold nothing."""
    excluded = set(plan.excluded)
    return of_pipelines(
        plan.pipelines, lambda w: w not in excluded and (alive is None or w in alive)
    )


@dataclass
class Holdings:
    """Current copies, per worker, as the workers' acknowledgements establish them."""

    held: dict[str, list[Interval]] = field(default_factory=dict)
    planned: dict[str, list[Interval]] = field(default_factory=dict)  # the current generation's
    generation: int = 0  # the current generation
    committed_generation: int = 0  # the generation whose first commit `held` reflects

    def published(self, generation: int, planned: Mapping[str, list[Interval]]) -> None:
        self.generation = generation
        self.planned = {w: list(ivs) for w, ivs in planned.items()}

    def restored(self) -> None:
        """The published plan is a `restore`: every worker drops what it holds and loads the
        checkpoint, so no copy counts until its worker acknowledges the plan."""
        self.held = {}

    def initial(self, generation: int, planned: Mapping[str, list[Interval]]) -> None:
        """The first plan: its layers are built from the seed, so each owner holds them."""
        self.published(generation, planned)
        self.held = {w: list(ivs) for w, ivs in planned.items()}

    def ready(self, worker: str, generation: int) -> None:
        if generation == self.generation and worker in self.planned:
            self.held[worker] = merge([*self.held.get(worker, ()), *self.planned[worker]])

    def committed(self, generation: int, out: Collection[str] = ()) -> None:
        """A step of `generation` committed; `out` are workers known to have failed since."""
        if generation != self.generation or generation == self.committed_generation:
            return
        self.committed_generation = generation
        self.held = {w: list(ivs) for w, ivs in self.planned.items() if w not in out}

    def lost(self, worker: str) -> None:
        self.held.pop(worker, None)

    def to_json(self) -> dict[str, Any]:
        return {
            "held": {w: [list(iv) for iv in ivs] for w, ivs in sorted(self.held.items())},
            "planned": {w: [list(iv) for iv in ivs] for w, ivs in sorted(self.planned.items())},
            "generation": self.generation,
            "committed_generation": self.committed_generation,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Holdings:
        def intervals(m: Mapping[str, Any]) -> dict[str, list[Interval]]:
            return {str(w): [(int(a), int(b)) for a, b in ivs] for w, ivs in m.items()}

        return cls(
            intervals(d["held"]),
            intervals(d["planned"]),
            int(d["generation"]),
            int(d["committed_generation"]),
        )


@dataclass
class Checkpoints:
    """Checkpoint steps and the layers written at each, the newest `KEEP` steps.

    A restore (generation g, step s) makes the files of steps after s a past that is gone: the
    workers of g delete them, and a report of one, written before g and arriving after it, is
    stale. A step some worker of a restore plan could not load is `unusable`: its files of that
    generation or before are never offered again (the job may train the step again and write new
    ones)."""

    KEEP = 4  # a few rounds: a kill can leave the newest round incomplete

    covered: dict[int, set[int]] = field(default_factory=dict)
    restore: tuple[int, int] | None = None  # (generation, step) of the newest restore plan
    unusable: dict[int, int] = field(default_factory=dict)  # step -> restore generation

    def add(self, step: int, layers: Iterable[int], generation: int) -> bool:
        """Record a worker's files at `step`, committed under `generation`; False when it adds
        nothing (a repeat, older than every step kept, stale, or of an unusable step)."""
        if self.restore is not None and generation < self.restore[0] and step > self.restore[1]:
            return False
        if generation <= self.unusable.get(step, 0):
            return False
        full = step not in self.covered and len(self.covered) >= self.KEEP
        if full and step < min(self.covered):
            return False
        have = self.covered.get(step, set())
        new = set(layers) - have
        if not new:
            return False
        self.covered[step] = have | new
        for old in sorted(self.covered)[: -self.KEEP]:
            del self.covered[old]
        return True

    def newest(self, n_layers: int) -> int | None:
        """The newest step whose files cover every layer, or None."""
        full = [s for s, layers in self.covered.items() if layers >= set(range(n_layers))]
        return max(full, default=None)

    def restored(self, generation: int, step: int) -> None:
        """Generation `generation` trains again from `step`."""
        self.covered = {s: ls for s, ls in self.covered.items() if s <= step}
        self.restore = (generation, step)

    def cannot_load(self, step: int, generation: int) -> bool:
        """A worker of the restore plan `generation` could not load its layers from the files of
        `step`; False when already known. Only steps as new as those kept are remembered: an
        older one is never offered anyway."""
        if self.unusable.get(step, 0) >= generation:
            return False
        self.covered.pop(step, None)
        floor = min(self.covered, default=step)
        self.unusable[step] = generation
        self.unusable = {s: g for s, g in self.unusable.items() if s >= floor}
        return True

    def to_json(self) -> dict[str, Any]:
        return {
            "covered": {str(s): sorted(ls) for s, ls in sorted(self.covered.items())},
            "restore": list(self.restore) if self.restore else None,
            "unusable": {str(s): g for s, g in sorted(self.unusable.items())},
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Checkpoints:
        covered = d.get("covered", d)  # an older daemon kept the steps alone
        restore = d.get("restore")
        return cls(
            {int(s): {int(x) for x in ls} for s, ls in covered.items()},
            (int(restore[0]), int(restore[1])) if restore else None,
            {int(s): int(g) for s, g in d.get("unusable", {}).items()},
        )
