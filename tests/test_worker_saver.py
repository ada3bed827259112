"""Checkpoints in pipeline bubbles (chameleond.worker._saver): placement, a snapshot that is the
committed
step's state whatever runs meanwhile, and the background write. Real tensors and files; the end to
end proof (a job restored from bubble checkpoints retrains the same losses) is in test_up.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from worker_harness import builtin_model, tiny_spec

from chameleond.core.decide import initial_plan
from chameleond.core.schedule import idle_before
from chameleond.core.spec import parse_spec
from chameleond.worker import _checkpoint as checkpoint
from chameleond.worker._activation import run_stage
from chameleond.worker._generation import op_order
from chameleond.worker._layer import LayerState
from chameleond.worker._model import Arch
from chameleond.worker._saver import MODES, CheckpointMode, Saver, Snapshot, Written, place
from chameleond.worker._state import WorkerState

BUBBLE, SYNC = CheckpointMode.BUBBLE, CheckpointMode.SYNC

ARCH = Arch(d_model=16, heads=2, blocks=2, seq_len=8, vocab=256, seed=3, lr=1e-2)
CPU = torch.device("cpu")
MODEL = builtin_model(ARCH)


def test_pieces_fill_the_slots_in_proportion_to_their_idle_time() -> None:
    assert place([1] * 8, [0.0, 3.0, 0.0, 1.0]) == [1, 1, 1, 1, 1, 1, 3, 3]
    assert place([1, 1, 1], [0.0, 0.0]) == [1, 1, 1]  # no bubble: after the last op
    slots = place([5, 1, 9, 2, 7], [0.5, 0.0, 2.0, 1.5])
    assert slots == sorted(slots) and 1 not in slots  # in order; an idle-free slot gets nothing
    with pytest.raises(ValueError):
        place([1], [])


def trained_state(owned: range, steps: int = 2) -> WorkerState:
    """Layers with AdamW state after `steps` committed updates on random gradients."""
    state = WorkerState(MODEL, CPU)
    for i in owned:
        state.build_from_seed(i)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        for i in owned:
            for p in state.layer(i).params():
                p.grad = torch.randn(p.shape, generator=gen)
        state.mark_pending(step, owned)
        state.apply_pending(12)
    return state


def idle_of_a_stage() -> list[float]:
    """The bubbles of a stage-1 worker of a real plan (2 pipelines x 2 stages)."""
    plan = initial_plan(parse_spec(tiny_spec("t", workers=4, stages=2)))
    order = op_order(plan)
    makespan = max(op.end for ops in order.values() for op in ops)
    return idle_before(order[plan.pipelines[0].stages[1].worker], makespan)


def test_a_checkpoint_written_across_a_step_is_the_committed_state(tmp_path: Path) -> None:
    state = trained_state(range(ARCH.n_layers))
    committed = {i: state.layer(i).state_buffer().clone() for i in state.layers}
    idle = idle_of_a_stage()
    assert sum(idle) > 0 and idle[0] > 0  # a later stage waits for its first activation
    snap = Snapshot(tmp_path, "w1", state, 4, sorted(state.layers), idle)
    x = torch.randint(0, ARCH.vocab, (2, ARCH.seq_len))
    for slot in range(len(idle)):  # the next step runs: forwards and backwards between writes
        assert checkpoint.written(tmp_path) == {}  # no final name before the last piece
        snap.write(slot)
        run_stage([state.layer(i).module for i in sorted(state.layers)], x)[0].sum().backward()
    assert snap.complete and snap.stall_seconds == 0.0 and snap.bubble_seconds > 0
    state.mark_pending(2, tuple(state.layers))
    state.apply_pending(12)  # the next update
    saved = checkpoint.read(checkpoint.checkpoint_path(tmp_path, "w1", 1))
    assert (saved.step, saved.model, saved.layers.keys()) == (
        1,
        MODEL.fingerprint,
        committed.keys(),
    )
    for i, buf in committed.items():
        back = LayerState(MODEL, i, CPU)
        back.load_state_tensors(saved.layers[i], 1)
        assert torch.equal(back.state_buffer(), buf)
        assert not torch.equal(state.layer(i).state_buffer(), buf)


def test_the_file_is_safetensors(tmp_path: Path) -> None:
    """Any safetensors reader opens it: the format, checked by hand against its specification."""
    import json
    import struct

    state = trained_state(range(2))
    path = checkpoint.save(tmp_path, "w0", state, (0, 1))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and header.pop("__metadata__")["step"] == "1"
    end = 0
    for t in header.values():  # contiguous, in order
        assert t["data_offsets"][0] == end
        end = t["data_offsets"][1]
    assert len(raw) == 8 + n + end
    weight = header["0.tokens.weight"]
    begin, stop = weight["data_offsets"]
    assert weight["dtype"] == "F32" and stop - begin == 4 * math.prod(weight["shape"])
    got = torch.frombuffer(bytearray(raw[8 + n + begin : 8 + n + stop]), dtype=torch.float32)
    tokens = dict(state.layer(0).module.named_parameters())["tokens.weight"]
    assert torch.equal(got, tokens.detach().reshape(-1))


def test_bubble_and_sync_checkpoints_write_the_same_file(tmp_path: Path) -> None:
    owned = (0, 1, 2)
    reports: list[Written] = []
    for mode in (BUBBLE, SYNC):
        state = trained_state(range(3))
        saver = Saver(tmp_path / mode, "w0", 2, reports.append, mode)
        saver.committed(state, 5, owned, [0.0, 1.0, 2.0])
        for slot in range(3):
            saver.bubble(slot)
        saver.flush()
    bubble, sync = reports
    assert (bubble.step, bubble.generation, bubble.layers) == (1, 5, owned)  # steps 0, 1: due
    assert bubble.bytes == sync.bytes > 0
    assert bubble.stall_seconds == 0.0 and bubble.bubble_seconds > 0
    assert sync.bubble_seconds == 0.0 and sync.stall_seconds > 0
    files = [checkpoint.checkpoint_path(tmp_path / m, "w0", 1).read_bytes() for m in MODES]
    assert files[0] == files[1]


def test_a_step_ended_early_writes_the_rest_before_anything_changes(tmp_path: Path) -> None:
    reports: list[Written] = []
    state = trained_state(range(2))
    (tmp_path / "w1-000000000.tmp").write_bytes(b"partial")  # a kill mid-write, earlier
    saver = Saver(tmp_path, "w1", 1, reports.append)
    assert not list(tmp_path.glob("*.tmp"))
    saver.committed(state, 3, (0, 1), [1.0, 1.0, 1.0])
    saver.bubble(0)  # a fault ends the step here
    assert reports == []
    saver.flush()
    assert [w.step for w in reports] == [1] and reports[0].stall_seconds > 0
    assert checkpoint.written(tmp_path) == {"w1": {1}}
    saver.flush()  # nothing under way: nothing happens
    assert len(reports) == 1


def test_measured_bubbles_place_the_next_checkpoint(tmp_path: Path) -> None:
    """After a measured step, the pieces follow where the worker really waited (plus what it
    wrote there), not the op order's timeline; a new generation starts from the timeline again."""
    state = trained_state(range(3))
    saver = Saver(tmp_path, "w0", 1, lambda w: None)
    timeline = [1.0, 0.0, 0.0, 1.0]
    saver.observe(7, [0.0, 0.0, 0.004, 0.0], vote_seconds=0.0)  # the wait is before op 2
    saver.committed(state, 7, (0, 1, 2), timeline)
    for slot in (0, 1):
        saver.bubble(slot)
        assert saver._snapshot is None  # nothing begins before the measured bubble
    saver.bubble(2)
    assert saver._snapshot is None and checkpoint.written(tmp_path) == {"w0": {1}}  # all there
    # The next step waited 1 ms at op 2 after writing there: its idle is wait + write, averaged.
    wrote = saver._wrote[2]
    saver.observe(7, [0.0, 0.0, 0.001, 0.0], vote_seconds=0.002)
    assert saver._idle is not None
    idle = saver._idle[1]
    assert idle[2] == pytest.approx((0.004 + 0.001 + wrote) / 2) and idle[3] == 0.001
    state.mark_pending(2, (0, 1, 2))
    state.apply_pending(12)
    saver.committed(state, 8, (0, 1, 2), timeline)  # a new generation: the timeline's slots
    saver.bubble(0)
    assert saver._snapshot is not None and not saver._snapshot.complete


def test_a_step_failed_after_bubble_writes_leaves_no_slot_behind(tmp_path: Path) -> None:
    """A checkpoint is written in bubbles 0..4 of a step that then fails (the rest is flushed);
    the next generation has three slots: its first measured step places the next checkpoint by
    its own waits alone."""
    reports: list[Written] = []
    state = trained_state(range(3))
    saver = Saver(tmp_path, "w0", 1, reports.append)
    saver.committed(state, 4, (0, 1, 2), [1.0] * 6)
    for slot in range(5):
        saver.bubble(slot)
    saver.flush()  # the step failed: generation 4 is over
    assert [w.step for w in reports] == [1]
    saver.observe(5, [0.0, 0.003, 0.0], vote_seconds=0.001)  # a step of generation 5 committed
    assert saver._idle == (5, [0.0, 0.003, 0.001])
    state.mark_pending(2, (0, 1, 2), 12)
    state.apply_pending()
    saver.committed(state, 5, (0, 1, 2), [1.0, 0.0, 0.0])  # measured, not this timeline
    saver.bubble(0)
    assert saver._snapshot is None  # no idle time measured before op 0
    saver.bubble(1)
    assert saver._snapshot is not None
    saver.bubble(2)
    assert [w.step for w in reports] == [1, 2] and reports[1].stall_seconds == 0.0
    assert checkpoint.written(tmp_path) == {"w0": {1, 2}}


def test_a_rebuilt_generation_does_not_count_the_failed_steps_writes(tmp_path: Path) -> None:
    state = trained_state(range(3))
    saver = Saver(tmp_path, "w0", 1, lambda w: None)
    saver.committed(state, 4, (0, 1, 2), [1.0, 1.0, 1.0])
    saver.bubble(0)
    saver.bubble(1)
    saver.flush()  # the step failed; generation 4 is built again (attempt 2)
    for slot in range(3):
        saver.bubble(slot)  # its first step: nothing to write
    saver.observe(4, [0.002, 0.0, 0.0], vote_seconds=0.0)
    assert saver._idle == (4, [0.002, 0.0, 0.0])


def test_an_exception_in_a_bubble_loses_no_piece(tmp_path: Path) -> None:
    """A stop signal can end a write in the middle of a slot: what was due there is still due,
    and the rest written later makes the same file as an uninterrupted write."""
    state = trained_state(range(3))
    expected = checkpoint.save(tmp_path / "whole", "w0", state, (0, 1, 2)).read_bytes()
    snap = Snapshot(tmp_path, "w0", state, 4, (0, 1, 2), [1.0, 1.0])
    writer = snap.file
    writer._file.close()  # the next write raises, as a signal handler's exception would
    with pytest.raises(ValueError):
        snap.write(0)
    assert not snap.complete
    writer._file = open(writer._tmp, "r+b")  # noqa: SIM115 - the writer owns it from here
    snap.write_rest()
    assert snap.complete
    assert checkpoint.checkpoint_path(tmp_path, "w0", 1).read_bytes() == expected


def test_a_piece_written_again_at_its_offset_changes_nothing(tmp_path: Path) -> None:
    state = trained_state(range(2))
    expected = checkpoint.save(tmp_path / "whole", "w0", state, (0, 1)).read_bytes()
    out, pieces = checkpoint.open_layers(tmp_path, "w0", state, (0, 1))
    offsets = [0]
    for piece in pieces:
        offsets.append(offsets[-1] + piece.numel())  # uint8: a byte per element
    out.write(pieces[0], at=offsets[0])
    out.write(pieces[1], at=offsets[1])
    out.write(pieces[1], at=offsets[1])  # interrupted after the write, before it was marked
    for piece, at in zip(pieces[2:], offsets[2:], strict=False):
        out.write(piece, at=at)
    assert out.commit().read_bytes() == expected


def test_a_short_file_never_gets_its_final_name(tmp_path: Path) -> None:
    """The size checked is the whole file's (length and header included), not the tensors'."""
    out = checkpoint.FileWriter(tmp_path, "w0", 3, {"x": torch.zeros(10, dtype=torch.uint8)}, {})
    out.write(torch.zeros(9, dtype=torch.uint8))
    with pytest.raises(OSError, match="header says"):
        out.commit()
    assert checkpoint.written(tmp_path) == {}
