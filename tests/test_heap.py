"""The daemon's heap policy (daemon/heap.py): a settle frees cycles, frozen ones included, and
freezes what survives; it is due after a new plan or after its period."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from chameleond.daemon.heap import Heap


@pytest.fixture(autouse=True)
def _thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the suite runs with the collector as it found it


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_settle_freezes_what_survives_and_frees_cycles_frozen_before() -> None:
    heap = Heap()
    kept = [Node() for _ in range(1000)]
    frozen_cycle = cycle()  # garbage already, frozen by the first settle before it is collected
    gc.disable()
    try:
        gc.freeze()  # as a settle leaves it: the cycle is in the permanent generation
        gc.collect()
        assert frozen_cycle() is not None  # a collection does not walk frozen objects
        heap.settle(generation=3)
        assert frozen_cycle() is None  # the settle did
    finally:
        gc.enable()
    assert heap.freed >= 2
    assert heap.frozen == gc.get_freeze_count() >= len(kept)
    assert heap.last_seconds > 0
    assert all(gc.is_tracked(k) for k in kept)


def test_a_settle_is_due_at_start_after_a_new_plan_and_after_its_period() -> None:
    heap = Heap(every=60.0)
    assert heap.due(0.0, 0)
    heap.settle(generation=1)
    at = heap.settled_at
    assert at is not None
    assert not heap.due(at + 1.0, 1)
    assert heap.due(at + 1.0, 2)  # a plan published since
    assert heap.due(at + 60.0, 1)
