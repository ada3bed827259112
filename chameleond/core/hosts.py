"""Which workers a host runs, and on which device: the per-host agent (chameleon-agent) starts a
host's workers from `host_slots`. Plain data in, plain data out; any spec's workers (a JobSpec's, or
the `[[hosts]]` form's after parsing) will do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

INDEXED_KINDS = ("cuda", "npu")  # kinds whose devices are numbered on a host: `cuda:N`


class Placed(Protocol):
    """A worker as the spec places it (chameleond.core.spec.WorkerSpec)."""

    @property
    def id(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def device(self) -> str: ...


@dataclass(frozen=True)
class Slot:
    """One worker a host runs, and the device it runs on: `cpu`, `cuda:N` or `npu:N`."""

    worker: str
    device: str


def hosts_of(workers: Sequence[Placed]) -> tuple[str, ...]:
    """The job's hosts, each once, in the order of their first worker in `workers` (a spec's)."""
    return tuple(dict.fromkeys(w.host for w in workers))


def host_slots(workers: Sequence[Placed], host: str) -> tuple[Slot, ...]:
    """The workers `host` runs, in spec order, each with its device: `cpu` for a cpu worker,
    `cuda:N` / `npu:N` numbering the host's workers of that kind in spec order from 0. A worker
    the spec already pins to a device (`cuda:3`) keeps it, and the others skip that number."""
    mine = [w for w in workers if w.host == host]
    pinned: dict[str, set[int]] = {kind: set() for kind in INDEXED_KINDS}
    for w in mine:
        kind, _, index = w.device.partition(":")
        if kind in pinned and _digits(index):
            pinned[kind].add(int(index))
    following = dict.fromkeys(INDEXED_KINDS, 0)
    slots = []
    for w in mine:
        if w.device not in INDEXED_KINDS:
            slots.append(Slot(w.id, w.device))
            continue
        n = following[w.device]
        while n in pinned[w.device]:
            n += 1
        following[w.device] = n + 1
        slots.append(Slot(w.id, f"{w.device}:{n}"))
    return tuple(slots)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()
