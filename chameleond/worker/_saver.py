"""Checkpoints recorded in pipeline bubbles (BAFT, PAPER.md section 9).

The checkpoint of committed step s is what a worker holds from the commit of s to the update of s +
1: parameters and optimizer state do not change while step s + 1 runs its forwards and backwards. So
rather than stop training to write it (`--checkpoint-mode sync`), a worker writes it during step s +
1, in the idle slots its 1F1B schedule leaves. The file (chameleond.worker._checkpoint.FileWriter)
is written a piece at a time (the layers' tensors, copied to the host when the checkpoint begins,
in pieces of a MiB: chameleond.worker._safetensors.pieces), at the points where the worker waits
for a message in the op order's timeline (`Generation.idle`: the warm-up bubble of later stages,
the gaps of the steady phase, the cool-down of earlier stages). `place` spreads the pieces over
those slots in proportion to their idle time; a plan without bubbles (one stage per pipeline)
writes everything after its last op, while the gradients are exchanged. The file is complete,
renamed and reported (`checkpoint` event: the step, the layers, and what it cost) once the last
piece is written.

Pieces left when a step ends early (a fault, a newer plan) are written then, while the worker
waits for its next plan anyway; every piece is written before the next update (`flush`), so the
file is exactly the committed step. The work stays on the training thread: a writer thread would
compete with training for the interpreter lock and, on a host whose cores all train, for the CPU,
and would be idle exactly when training is not.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from chameleond.events import Checkpoint
from chameleond.worker._checkpoint import KEEP, open_layers
from chameleond.worker._state import WorkerState

log = logging.getLogger("chameleon.worker")


class CheckpointMode(StrEnum):
    BUBBLE = "bubble"  # record the layers in the pipeline's bubbles, write them in a thread
    SYNC = "sync"  # stop after the step and write


MODES = tuple(CheckpointMode)


@dataclass(frozen=True)
class Written:
    """One checkpoint file, complete: what the `checkpoint` event reports."""

    step: int
    generation: int  # of the plan the step committed under
    layers: tuple[int, ...]
    bytes: int
    bubble_seconds: float  # writing inside the step's bubbles
    stall_seconds: float  # training stopped for it: writing outside bubbles (sync: all of it)

    def event(self, worker: str) -> Checkpoint:
        """The `checkpoint` event of `worker` that reports this file."""
        return Checkpoint(
            worker, self.generation, self.step, self.layers, size_bytes=self.bytes,
            bubble_seconds=self.bubble_seconds, stall_seconds=self.stall_seconds,
        )  # fmt: skip


def place(sizes: Sequence[int], idle: Sequence[float]) -> list[int]:
    """The slot of each piece, in order: each slot takes a share of the bytes proportional to its
    share of the idle time (a piece goes to the slot its middle byte falls in). Slots without idle
    time get nothing; with no idle time at all, every piece goes to the last slot."""
    if not idle:
        raise ValueError("no slots to place pieces in")
    total_idle = sum(idle)
    if total_idle <= 0:
        return [len(idle) - 1] * len(sizes)
    bounds = list(itertools.accumulate(t / total_idle for t in idle))
    total = sum(sizes) or 1
    slots, done = [], 0
    for size in sizes:
        middle = (done + size / 2) / total
        slots.append(min(bisect.bisect_left(bounds, middle), len(idle) - 1))
        done += size
    return slots


class Snapshot:
    """One committed step's layers, being written piece by piece."""

    def __init__(
        self,
        directory: Path,
        worker: str,
        state: WorkerState,
        generation: int,
        layers: Sequence[int],
        idle: Sequence[float],
        keep: int = KEEP,
    ) -> None:
        self.step = state.committed_step
        self.generation = generation
        self.layers = tuple(layers)
        self.file, pieces = open_layers(directory, worker, state, self.layers, keep)
        # slot -> (offset in the file's data, piece), in order
        self._due: dict[int, deque[tuple[int, torch.Tensor]]] = {}
        sizes = [p.numel() for p in pieces]
        offsets = [0, *itertools.accumulate(sizes)][:-1]  # bytes: the pieces are uint8
        for piece, offset, slot in zip(pieces, offsets, place(sizes, idle), strict=True):
            self._due.setdefault(slot, deque()).append((offset, piece))
        self.bubble_seconds = 0.0
        self.stall_seconds = 0.0

    @property
    def complete(self) -> bool:
        return not self._due

    def write(self, slot: int) -> None:
        """The pieces placed in `slot`, a bubble of the running step, and any placed before it
        that are not written yet."""
        slots = sorted(k for k in self._due if k <= slot)
        if slots:
            t0 = time.perf_counter()
            try:
                for k in slots:
                    self._write(k)
            finally:
                self.bubble_seconds += time.perf_counter() - t0

    def write_rest(self) -> None:
        """Every piece not written yet, now (outside the bubbles: a stall)."""
        t0 = time.perf_counter()
        try:
            for slot in sorted(self._due):
                self._write(slot)
        finally:
            self.stall_seconds += time.perf_counter() - t0

    def _write(self, slot: int) -> None:
        pieces = self._due[slot]
        while pieces:
            offset, piece = pieces[0]
            self.file.write(piece, at=offset)
            # Due until written: an exception (a stop signal) in the middle of a slot leaves the
            # rest, this piece included, to `write_rest`; at its offset, a piece written twice is
            # written once.
            pieces.popleft()
        del self._due[slot]
        if self.complete:
            self.file.commit()

    def result(self) -> Written:
        return Written(
            self.step, self.generation, self.layers, self.file.nbytes, self.bubble_seconds,
            self.stall_seconds,
        )  # fmt: skip


class Saver:
    """A worker's checkpoints: every `every` committed steps, in bubbles or stopping training,
    keeping the newest `keep` files."""

    def __init__(
        self,
        directory: Path,
        worker: str,
        every: int,
        report: Callable[[Written], None],
        mode: CheckpointMode = CheckpointMode.BUBBLE,
        keep: int = KEEP,
    ) -> None:
        if every < 1 or mode not in MODES or keep < 1:
            raise ValueError(f"checkpoints need every >= 1, keep >= 1 and a mode of {MODES}")
        self.directory, self.worker, self.keep = directory, worker, keep
        self.every, self.mode = every, mode
        self._report = report
        self._snapshot: Snapshot | None = None
        self._due: Callable[[], Snapshot] | None = None  # a checkpoint due, not yet begun
        self._begins = 0  # the slot it begins in: the first with idle time
        self._idle: tuple[int, list[float]] | None = None  # (generation, measured idle per slot)
        self._wrote: dict[int, float] = {}  # seconds written in each slot of the running step
        self._wrote_in = -1  # the generation of that step
        self._slot = -1  # the last slot the running step reached
        for stale in directory.glob(f"{worker}-*.tmp"):  # a file a kill left unfinished
            stale.unlink(missing_ok=True)

    def observe(self, generation: int, waits: Sequence[float], vote_seconds: float) -> None:
        """A step of `generation` waited `waits` (StepRunner.waits), then `vote_seconds` in the
        commit vote: with what this saver wrote in each slot, the idle time the step had there.
        Averaged over the generation's steps, it places the next checkpoints."""
        idle = list(waits)
        idle[-1] += vote_seconds  # the cool-down: waiting for the last stage to finish
        # Writes of another generation come from a step that failed after writing in its bubbles
        # (the rest was flushed): that step never committed, and its slots are not these. A slot
        # past this step's is skipped, never an error: the step has committed already.
        if self._wrote_in == generation:
            for slot, seconds in self._wrote.items():
                if slot < len(idle):
                    idle[slot] += seconds
        self._wrote, self._slot = {}, -1
        if self._idle is not None and self._idle[0] == generation:
            idle = [(a + b) / 2 for a, b in zip(self._idle[1], idle, strict=True)]
        self._idle = (generation, idle)

    def committed(
        self, state: WorkerState, generation: int, owned: Sequence[int], idle: Sequence[float]
    ) -> None:
        """`state.committed_step` just committed under `generation`: a checkpoint of it is due
        if it is an every-th step. It begins in the first bubble of the step that follows (in
        sync mode: now). `idle`: the bubbles of the steps to come in the op order's timeline
        (Generation.idle), used until `observe` has measured a step of the generation."""
        if (state.committed_step + 1) % self.every:
            return
        if self._idle is not None and self._idle[0] == generation:
            idle = self._idle[1]
        self.flush()
        self._due = functools.partial(
            Snapshot, self.directory, self.worker, state, generation, owned, idle, self.keep
        )
        # It begins in the first bubble worth a tenth of the step's idle time, or the last slot.
        total = sum(idle)
        self._begins = next(
            (k for k, t in enumerate(idle) if total > 0 and t >= total / 10), len(idle) - 1
        )
        if self.mode == CheckpointMode.SYNC:
            self.flush()

    def bubble(self, slot: int) -> None:
        """The running step reached idle slot `slot` (StepRunner.run)."""
        if slot <= self._slot:
            # A step begins again (slots rise within one): the writes recorded belong to a step
            # that ended early, in this generation (a rebuild), and never committed.
            self._wrote = {}
        self._slot = slot
        if self._due is not None and slot >= self._begins:
            self._begin(in_bubble=True)
        if self._snapshot is not None:
            self._wrote_in = self._snapshot.generation
            t0 = time.perf_counter()
            self._guarded(functools.partial(self._snapshot.write, slot))
            self._wrote[slot] = self._wrote.get(slot, 0.0) + time.perf_counter() - t0

    def flush(self) -> None:
        """Write what is left of the checkpoint due or under way. Called before every update
        and when a generation ends."""
        if self._due is not None:
            self._begin(in_bubble=False)
        if self._snapshot is not None:
            self._guarded(self._snapshot.write_rest)

    def _begin(self, *, in_bubble: bool) -> None:
        begin, self._due = self._due, None
        assert begin is not None
        t0 = time.perf_counter()
        try:
            snapshot = begin()
        except (OSError, ValueError) as e:
            log.error("checkpoint not begun: %s", e)
            return
        if in_bubble:
            snapshot.bubble_seconds += time.perf_counter() - t0
        else:
            snapshot.stall_seconds += time.perf_counter() - t0
        self._snapshot = snapshot

    def _guarded(self, write: Callable[[], None]) -> None:
        snapshot = self._snapshot
        assert snapshot is not None
        try:
            write()
        except OSError as e:
            log.error("checkpoint of step %d not written: %s", snapshot.step, e)
            snapshot.file.abort()
            self._snapshot = None
            return
        if snapshot.complete:
            self._snapshot = None
            self._report(snapshot.result())
