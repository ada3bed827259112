"""The daemon's heap and Python's cyclic garbage collector.

At 8,192 workers the daemon holds 0.3 to 0.9 million objects: the job's records, spec, plans and
measures, trees of plain data that reference counting frees. Under the collector's default
thresholds, what a job of that size rebuilds as its workers report (the planner's spec, the
snapshot's documents, the measures) is promoted to the oldest generation fast enough that a
full collection ran every 1 to 2 s, walked every object, took 0.15 to 0.9 s on the development
machine and freed nothing in nearly all of them (docs/daemon.md, "What a large job costs the
daemon"). Those pauses fell between a fault and its plan, and between a plan and its
publication.

So the daemon keeps what it holds in the collector's permanent generation (`gc.freeze`): a
collection walks only what was made since. `Heap.settle()` collects everything once and freezes
what survives. The daemon settles at start, then from housekeeping while nothing is being
decided (no decision due or running, every worker's acknowledgement of the plan in) once a plan
was published since the last settle (what a new plan made stays), else every SETTLE_SECONDS: a
cycle among frozen objects is freed that long after it became garbage at most, while the job
is quiet. A settle is a pause (0.2 to 0.9 s at 8,192 workers), and a fault that comes during
one waits for it: so they are rare, and never while a fault is being decided.
"""

from __future__ import annotations

import gc
import time

SETTLE_SECONDS = 600.0


class Heap:
    """When the heap was last settled, and what that cost."""

    def __init__(self, every: float = SETTLE_SECONDS) -> None:
        self.every = every
        self.settled_at: float | None = None  # time.monotonic() of the last settle
        self.generation = 0  # the plan's at the last settle
        self.last_seconds = 0.0  # what the last settle took
        self.frozen = 0  # objects frozen by it
        self.freed = 0  # unreachable objects it found

    def due(self, now: float, generation: int) -> bool:
        """Whether to settle at `now` (time.monotonic()) with plan `generation` published."""
        if self.settled_at is None or generation != self.generation:
            return True
        return now - self.settled_at >= self.every

    def settle(self, generation: int = 0) -> float:
        """One full collection of every object (frozen ones included), then what survives is
        frozen, with plan `generation` published. Returns the seconds it took."""
        began = time.perf_counter()
        gc.unfreeze()
        self.freed = gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self.last_seconds = time.perf_counter() - began
        self.settled_at = time.monotonic()
        self.generation = generation
        return self.last_seconds
