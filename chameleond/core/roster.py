"""The job's workers as lookups by id: their place in the spec's order, host, speed and memory.

Every part of a decision asks for these (the order sorts survivors and transfers, the hosts price
links); at 8,192 workers each dict is a pass over the spec, so they are built once per job's
worker list and shared. Read them, never change them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from chameleond.core.spec import JobSpec, WorkerSpec


@dataclass(frozen=True)
class Roster:
    order: Mapping[str, int]  # index in spec.workers
    host: Mapping[str, str]
    speed: Mapping[str, float]
    memory: Mapping[str, int]


# The rosters of the jobs asked about most recently, by their worker tuple (kept, so its id is
# not reused while the entry lives).
_ROSTERS: dict[int, tuple[tuple[WorkerSpec, ...], Roster]] = {}
_ROSTERS_KEPT = 8


def roster(spec: JobSpec) -> Roster:
    """The lookups of `spec.workers`, built on the first request for that worker list."""
    workers = spec.workers
    found = _ROSTERS.get(id(workers))
    if found is not None and found[0] is workers:
        return found[1]
    made = Roster(
        {w.id: i for i, w in enumerate(workers)},
        {w.id: w.host for w in workers},
        {w.id: w.speed for w in workers},
        {w.id: w.memory_bytes for w in workers},
    )
    _ROSTERS[id(workers)] = (workers, made)
    while len(_ROSTERS) > _ROSTERS_KEPT:  # the oldest first; decisions of two jobs may race
        _ROSTERS.pop(next(iter(_ROSTERS), 0), None)
    return made
