"""chameleond.worker._gate: the bench's turns between the library and the plain loop, and their
records."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from chameleond.bench.worker_overhead import _block, _ratios
from chameleond.worker._gate import StepGate, open_gate, read_record


def test_a_training_waits_at_its_limit_and_records_each_step(tmp_path: Path) -> None:
    gate, record = tmp_path / "gate", tmp_path / "gate.w0"
    open_gate(gate, 0, 2)
    g = StepGate(gate, "library", record)
    g.before(0)
    g.before(1)
    released = threading.Event()

    def later() -> None:
        time.sleep(0.3)
        released.set()
        open_gate(gate, 0, 3)

    t = threading.Thread(target=later)
    t.start()
    g.before(2)  # waits for the limit to reach 3
    assert released.is_set()
    t.join()
    g.close()
    got = read_record(record)
    assert sorted(got) == [0, 1, 2]
    # The pause before step 2 is in no step's time.
    assert all(wall < 0.25 for wall, _ in got.values())


def test_a_plain_training_reads_its_own_column(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    open_gate(gate, 1, 0)
    g = StepGate(gate, "plain", tmp_path / "gate.plain0")
    g.before(0)  # plain may start step 0, the library may not
    g.close()
    assert list(read_record(tmp_path / "gate.plain0")) == [0]
    with pytest.raises(ValueError, match="gate kind"):
        StepGate(gate, "other", tmp_path / "x")


def test_blocks_leave_out_their_first_step_and_take_the_slowest_process() -> None:
    a = {0: (9.0, 9.0), 1: (1.0, 0.5), 2: (2.0, 0.5), 3: (3.0, 0.5)}
    b = {0: (9.0, 9.0), 1: (1.5, 1.5), 2: (1.0, 1.5), 3: (3.0, 1.5)}
    assert _block([a, b], range(0, 4)) == (2.0, 1.0)
    # Each library block against the mean of the plain blocks on either side.
    assert _ratios([1.1, 2.0], [1.0, 1.2, 2.8]) == pytest.approx([1.0, 1.0])
