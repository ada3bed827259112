"""Which sample each sample position reads, and the thread that reads a worker's next micro-batches.

Step s trains the positions [s*B, (s+1)*B), B the job's global batch (chameleond.worker._samples);
plans only partition them. Here a position becomes a sample, as a pure function of (position,
dataset, shuffle, seed), so a restore, a re-plan or a new process reads the same sample for it:

- A map-style dataset of n samples (`len`, `dataset[i]`): position p is epoch e = p // n. Without
  shuffle it reads sample p % n; with shuffle, sample perm_e[p % n], perm_e a permutation of
  range(n) drawn by a torch.Generator seeded from (seed, e) (`permutation`).
- A stream (an iterable without `len` and `[i]`): position p is the p-th sample of the stream read
  again and again, each pass an epoch (`set_epoch(e)` before pass e, where the stream has it: a
  Hugging Face stream's `.shuffle(seed=...)` then reshuffles, deterministically). There is no
  index, so every worker reads the same whole stream in the same order and skips the positions of
  micro-batches that are not its own: a worker collates only its own micro-batches, and whichever
  worker reads position p gets the same sample. A stream must not be split between workers
  (`split_dataset_by_node`, a rank-sharded IterableDataset): a plan moves micro-batches between
  workers, so a fixed shard per worker would lose and repeat samples (the job's data digest then
  differs between workers, and they stop).

A `StreamReader` keeps a cursor: a later position skips forward, an earlier one (a restore, or a
re-plan that moved this worker back) reopens the pass and skips forward from its start, or from a
mark: where the stream has `state_dict()` / `load_state_dict()` (a Hugging Face IterableDataset,
a torchdata stateful dataset), each read records the stream's state at its first position, and a
seek back resumes from the nearest one. Hugging Face resumes exactly except from a shuffle buffer
(refilled on resume, it yields other samples, and reads further on): each mark keeps the digest
of the sample it precedes and the state after it, and a resume that reads another sample or
reaches another state falls back to skipping, for good.

The `Prefetcher` is one daemon thread per worker that prepares (reads and collates, nothing moved
to the accelerator: the training thread does that) the micro-batches the step runner said the
worker will read next, in the order they are read: those of the step being read and
`Training.prefetch` more. A batch read before it is ready waits for it; one never announced is
prepared in the reading thread. A step's batches stay until a later step is read (a failed step
trained again reads them again); a batch no longer wanted stops being read. An error of the user's
dataset is raised in the reading thread as the same exception.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset

from chameleond.worker.api import DataError, ModelError

log = logging.getLogger(__name__)

Cancel = Callable[[], bool] | None  # a read stops (Cancelled) once it returns True


class Cancelled(Exception):
    """A read stopped because its micro-batch is no longer wanted."""


PERMUTATIONS_KEPT = 2  # the current epoch's and the next
MARKS_KEPT = 64  # stream states kept for seeking back: dense near the cursor, sparser further back


def permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of a shuffled map-style dataset's n samples in `epoch`: the same on every worker
    and every run with the same torch."""
    h = hashlib.sha256(f"chameleond/shuffle/{seed}/{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") >> 1)
    return torch.randperm(n, generator=generator, dtype=torch.int32 if n < 2**31 else torch.int64)


def sample_digest(value: Any, h: Any) -> None:
    """Feeds a sample or a batch into hash `h`: its tensors' bytes, mappings by sorted key."""
    if isinstance(value, torch.Tensor):  # as bytes: numpy has no bfloat16
        t = value.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(value.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            sample_digest(value[k], h)
    elif isinstance(value, tuple | list):
        for v in value:
            sample_digest(v, h)
    elif hasattr(value, "tobytes"):  # numpy
        h.update(value.tobytes())
    else:
        h.update(repr(value).encode())


def _digest(value: Any) -> str:
    h = hashlib.sha256()
    sample_digest(value, h)
    return h.hexdigest()


# readers ------------------------------------------------------------------------------------------


class MapReader:
    """A map-style dataset read by position. Thread-safe: reads are serialised."""

    def __init__(self, dataset: Any, shuffle: bool, seed: int) -> None:
        self.dataset = dataset
        self.length = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self._permutations: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        shuffled = f"/shuffle/{self.seed}" if self.shuffle else ""
        return f"map/{self.length}{shuffled}"

    def sample_id(self, position: int) -> int:
        epoch, index = divmod(position, self.length)
        if not self.shuffle:
            return index
        perm = self._permutations.get(epoch)
        if perm is None:  # computed once per epoch: a permutation of a large n takes a while
            perm = self._permutations[epoch] = permutation(self.length, self.seed, epoch)
            while len(self._permutations) > PERMUTATIONS_KEPT:
                self._permutations.popitem(last=False)
        else:
            self._permutations.move_to_end(epoch)
        return int(perm[index])

    def sample_ids(self, positions: range) -> list[int]:
        """The dataset indexes `positions` read (nothing is read)."""
        with self._lock:
            return [self.sample_id(p) for p in positions]

    def read(self, positions: range, cancelled: Cancel = None) -> tuple[list[int], list[Any]]:
        """(sample ids, samples) of `positions`; Cancelled once `cancelled()`, between samples."""
        with self._lock:
            ids = [self.sample_id(p) for p in positions]
            read = []
            for i in ids:
                if cancelled is not None and cancelled():
                    raise Cancelled
                read.append(self.dataset[i])
            return ids, read


@dataclass
class _Mark:
    """The stream's state just before position `position` of pass `epoch`; the digests of the
    samples of the read that made it and the state just after them (None until read: such a
    mark is not used)."""

    position: int
    epoch: int
    state: Any
    digests: list[str] = field(default_factory=list)
    after: Any = None


class StreamReader:
    """A stream read by position, with a cursor (module docstring). Thread-safe: reads are
    serialised."""

    name = "stream"

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self._stateful = callable(getattr(dataset, "state_dict", None)) and callable(
            getattr(dataset, "load_state_dict", None)
        )
        self._starts = [0]  # the first position of each pass reached so far
        self._epoch = 0
        self._cursor = 0  # the position the open iterator gives next
        self._source: Any = dataset  # what the open iterator iterates (a view after a resume)
        self._it: Iterator[Any] | None = None
        self._yielded = 0  # by the open iterator: its state is its own only after one sample
        self._pushed: list[Any] = []  # samples read ahead, given next
        self._marks: list[_Mark] = []  # by position
        self._lock = threading.Lock()

    def sample_ids(self, positions: range) -> list[int]:
        """A stream's sample ids are its positions: sample p of the stream read pass after pass."""
        return list(positions)

    def read(self, positions: range, cancelled: Cancel = None) -> tuple[list[int], list[Any]]:
        """(sample ids: the positions, samples) of `positions`; Cancelled once `cancelled()`,
        while it skips to them (the cursor stays where it got, for the next read)."""
        with self._lock:
            try:
                self._seek(positions.start, cancelled)
                mark = self._mark()
                read = [self._next() for _ in positions]
            except Cancelled:
                raise
            except BaseException:
                self._it = None  # a generator that raised is over: the next read reopens
                raise
            if mark is not None:
                mark.digests = [_digest(sample) for sample in read]
                mark.after = self._state()
            return list(positions), read

    # the cursor ---------------------------------------------------------------------------------

    def _seek(self, position: int, cancelled: Cancel = None) -> None:
        """Makes `position` the next one read: the closest of the cursor (when not past it), the
        start of its pass and a mark before it."""
        epoch = bisect.bisect_right(self._starts, position) - 1
        at = self._starts[epoch]
        if self._it is not None and at <= self._cursor <= position:
            at = self._cursor
        i = bisect.bisect_right([m.position for m in self._marks], position) - 1
        mark = self._marks[i] if i >= 0 else None
        if mark is not None and mark.after is not None and mark.position > at:
            self._resume(mark)
        elif at != self._cursor or self._it is None:
            self._open(epoch, self._starts[epoch])
        while self._cursor < position:
            if cancelled is not None and cancelled():
                raise Cancelled
            self._next()

    def _resume(self, mark: _Mark) -> None:
        """Opens the stream at `mark` from its state, reads the mark's samples again and keeps
        them for the next reads; back to the pass's start, and no more marks, unless they and the
        state after them are the ones read before."""
        try:
            view = _view(self.dataset)
            _set_epoch(view, mark.epoch)
            view.load_state_dict(mark.state)
            self._open(mark.epoch, mark.position, view)
            again = [self._next() for _ in mark.digests]
            same = [_digest(sample) for sample in again] == mark.digests and _same(
                self._source.state_dict(), mark.after
            )
        except Exception as e:  # a state it cannot load, a pass of another length
            self._stop_marking(f"resuming it from its state_dict failed ({e!r})")
        else:
            if same:
                self._pushed = again
                self._cursor -= len(again)
                return
            self._stop_marking("resuming it from its state_dict does not read as before")
        self._open(mark.epoch, self._starts[mark.epoch])

    def _state(self) -> Any:
        """The open stream's state_dict; None, and no more marks, if it has none to give."""
        try:
            return self._source.state_dict()
        except Exception as e:
            self._stop_marking(f"its state_dict() raised {e!r}")
            return None

    def _stop_marking(self, why: str) -> None:
        log.warning("the stream is read from its start to seek back: %s", why)
        self._stateful = False
        self._marks.clear()

    def _mark(self) -> _Mark | None:
        """A mark at the cursor, for a later seek back; only once the open iterator has given a
        sample (a Hugging Face stream's state is the previous pass's until then)."""
        if not self._stateful or self._pushed or self._yielded == 0:
            return None
        positions = [m.position for m in self._marks]
        i = bisect.bisect_left(positions, self._cursor)
        if i < len(positions) and positions[i] == self._cursor:
            return None
        state = self._state()
        if state is None:
            return None
        mark = _Mark(self._cursor, self._epoch, state)
        self._marks.insert(i, mark)
        if len(self._marks) > MARKS_KEPT:
            # Thin the older half: marks far behind the cursor are rarely needed, and sparse there.
            del self._marks[1 : MARKS_KEPT // 2 : 2]
        return mark

    def _open(self, epoch: int, position: int, source: Any = None) -> None:
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        if source is None:
            source = self.dataset
            _set_epoch(source, epoch)
        self._source, self._epoch, self._cursor = source, epoch, position
        self._it, self._yielded, self._pushed = iter(source), 0, []

    def _next(self) -> Any:
        """The sample at the cursor; the cursor moves on."""
        if self._pushed:
            self._cursor += 1
            return self._pushed.pop(0)
        assert self._it is not None
        while True:
            start = self._starts[self._epoch]
            known = (
                self._starts[self._epoch + 1] - start
                if self._epoch + 1 < len(self._starts)
                else None
            )
            try:
                sample = next(self._it)
            except StopIteration:
                self._end_pass(self._cursor - start, known)
                continue
            if known is not None and self._cursor - start >= known:
                raise DataError(_changed(self._epoch, known, f"more than {known}"))
            self._cursor += 1
            self._yielded += 1
            return sample

    def _end_pass(self, length: int, known: int | None) -> None:
        if length == 0:
            raise DataError(f"the stream gave no sample in its pass {self._epoch}")
        if known is None:
            self._starts.append(self._cursor)
        elif length != known:
            raise DataError(_changed(self._epoch, known, str(length)))
        self._open(self._epoch + 1, self._cursor)


def _changed(epoch: int, before: int, now: str) -> str:
    return (
        f"pass {epoch} of the stream gave {now} samples, {before} when read before: a stream "
        "must give the same samples each time it is read"
    )


def _same(state: Any, before: Any) -> bool:
    try:
        return bool(state == before)
    except Exception:  # states holding tensors: not comparable, not trusted
        return False


def _set_epoch(dataset: Any, epoch: int) -> None:
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _view(dataset: Any) -> Any:
    """A shallow copy that a loaded state does not leak from: a Hugging Face stream's
    `load_state_dict` sets where EVERY later pass of that epoch starts, and its `copy.copy` shares
    the original's attributes."""
    view = object.__new__(type(dataset))
    view.__dict__.update(vars(dataset))
    return view


Reader = MapReader | StreamReader


def reader_for(dataset: Any, shuffle: bool, seed: int, global_batch: int) -> Reader:
    """The reader of `Training.dataset`; ModelError, one line, for one the library cannot read."""
    kind = type(dataset).__name__
    if isinstance(dataset, Iterator) and not isinstance(dataset, IterableDataset):
        raise ModelError(
            f"the dataset is an iterator ({kind}), read once: give an iterable that can be read "
            "again (a torch IterableDataset, datasets.IterableDataset.from_generator)"
        )
    stream = isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    )
    if stream and not hasattr(dataset, "__iter__"):
        raise ModelError(
            f"the dataset ({kind}) is neither map-style (len() and dataset[i]) nor iterable"
        )
    if stream:
        if shuffle:
            raise ModelError(
                "Training.shuffle needs a map-style dataset: shuffle a stream itself (a Hugging "
                "Face stream's .shuffle(seed=...), reshuffled each pass through set_epoch)"
            )
        return StreamReader(dataset)
    n = len(dataset)
    if n < global_batch:
        raise ModelError(
            f"the dataset has {n} samples, fewer than one global batch of {global_batch}"
        )
    return MapReader(dataset, shuffle, seed)


# the prefetcher -----------------------------------------------------------------------------------

Key = tuple[int, int, int, int]  # (step, global micro-batch, the job's global batch, micro-batch)


@dataclass(frozen=True)
class Prepared:
    positions: range
    samples: tuple[int, ...]
    batch: Any  # collated, on the CPU
    tokens: int = 0  # Training.tokens of the batch, counted here


@dataclass
class _Entry:
    reads: int  # still to be taken in its step; 0: taken, kept for a retry of the step
    order: int  # its place in its step's announcement: prepared in (step, order)
    state: str = "expected"  # -> "preparing" -> "ready"
    value: Prepared | None = None
    error: BaseException | None = None


class Prefetcher:
    """Prepares the announced micro-batches (`expect`) in a daemon thread, in the order they are
    read: those of the earliest step not yet taken, and `depth` more after them; `take` gives one.
    `depth` 0: no thread, every micro-batch prepared where it is taken.

    A micro-batch dropped while the thread reads it (a new generation reads other ones) stops
    being read at the reader's next sample (`Cancelled`).

    A step's micro-batches stay once taken, until the worker moves on to a later step: a step
    that fails and is trained again (a new generation, a new attempt) reads them again, and finds
    them ready.

    `expect`, `take` and `close` are called from one thread, the training thread: only it adds
    or removes entries (under the lock) and counts their reads; the prefetch thread changes only
    the entry it prepares. So a prepared micro-batch is taken without the lock when that leaves
    the thread nothing new to prepare, and the thread is woken only when it has a micro-batch to
    prepare: on a loaded host the thread, just woken, may hold the lock while it waits for a core
    and for the interpreter lock, just as the training thread needs them."""

    def __init__(self, prepare: Callable[[Key, Cancel], Prepared], depth: int) -> None:
        self._prepare = prepare
        self._depth = depth
        self._entries: dict[Key, _Entry] = {}
        self._announced: dict[int, tuple[Counter[int], int, int]] = {}  # step -> what expect said
        self._lock = threading.Lock()
        self._prepared = threading.Condition(self._lock)  # a micro-batch is ready
        self._work = threading.Condition(self._lock)  # one is to prepare, or closed
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits for work
        self._unprepared = 0  # entries "expected": the thread is woken only when there are some
        self._taking = -1  # the step of the last `take`
        self._closed = False
        # Since training started (the first `expect`): seconds preparing micro-batches, in any
        # thread, and seconds the reading thread waited for one (or prepared it itself).
        self.prepare_seconds = 0.0
        self.wait_seconds = 0.0

    def expect(self, step: int, micro_batches: Sequence[int], job_batch: int, size: int) -> None:
        """This worker reads `micro_batches` (one entry per read, in the order read) of `step`
        next. Announcing a step again with the same reads changes nothing; with others, replaces
        them: the micro-batches still read keep what was prepared (taken ones are read again),
        the others are dropped. Announcements of steps more than one away are forgotten (a new
        generation resumed elsewhere)."""
        if self._depth == 0:
            return
        reads = Counter(micro_batches)
        with self._lock:
            if self._closed:
                return
            self._forget(lambda s: abs(s - step) > 1)
            if self._announced.get(step) == (reads, job_batch, size):
                return
            self._announced[step] = (reads, job_batch, size)
            wanted = {(step, g, job_batch, size): reads[g] for g in micro_batches}  # read order
            self._drop([k for k in self._entries if k[0] == step and k not in wanted])
            for order, (key, n) in enumerate(wanted.items()):
                entry = self._entries.get(key)
                if entry is None:
                    self._entries[key] = _Entry(n, order)
                    self._unprepared += 1
                else:
                    entry.reads, entry.order = n, order
            if self._thread is None:
                # Training starts: the reads before it (the start-up checks, the profile, the
                # data digest) had nothing to hide behind, and are not counted.
                self.prepare_seconds = self.wait_seconds = 0.0
                self._thread = threading.Thread(
                    target=self._loop, name="chameleond-prefetch", daemon=True
                )
                self._thread.start()
            else:
                self._wake()

    def take(self, key: Key) -> Prepared:
        """Micro-batch `key`, once ready; the same exception if preparing it raised. One announced
        but not started yet is prepared here (once, however many reads were announced)."""
        t0 = time.perf_counter()
        entry = self._entries.get(key)
        if key[0] != self._taking and not any(k[0] < key[0] for k in self._entries):
            self._taking = key[0]  # a new step, and nothing of an earlier one to forget
        if (
            entry is not None
            and key[0] == self._taking
            and entry.state == "ready"  # set after its value and error
            and entry.value is not None
            and (entry.reads != 1 or not self._unprepared)
        ):
            # Prepared, and this read leaves the thread nothing new to prepare: taken without the
            # lock (the class's docstring).
            entry.reads = max(0, entry.reads - 1)
            self.wait_seconds += time.perf_counter() - t0
            return entry.value
        with self._lock:
            try:
                if key[0] != self._taking:  # a new step: the earlier ones are done
                    self._taking = key[0]
                    self._forget(lambda s: s < key[0])
                entry = self._entries.get(key)
                while entry is not None and entry.state == "preparing":
                    self._prepared.wait()
                    entry = self._entries.get(key)
                if entry is None:  # never announced
                    entry = _Entry(1, 0, "preparing")
                    self._run(key, entry)
                elif entry.state == "expected":  # announced, and the thread has not got to it
                    entry.state = "preparing"
                    self._unprepared -= 1
                    self._run(key, entry)
                if entry.reads > 0:
                    entry.reads -= 1
                    if entry.reads == 0:
                        if entry.error is not None:  # prepared again if read again
                            self._entries.pop(key, None)
                        self._wake()  # one more may be in the window
                if entry.error is not None:
                    raise entry.error
                assert entry.value is not None
                return entry.value
            finally:
                self.wait_seconds += time.perf_counter() - t0

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread (after the micro-batch it is preparing); later reads are prepared where
        they are taken. Idempotent."""
        with self._lock:
            self._closed = True
            self._depth = 0
            self._drop(list(self._entries))
            self._announced.clear()
            self._work.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _forget(self, stale: Callable[[int], bool]) -> None:
        self._drop([k for k in self._entries if stale(k[0])])
        for step in [s for s in self._announced if stale(s)]:
            del self._announced[step]

    def _drop(self, keys: Sequence[Key]) -> None:
        for key in keys:
            if self._entries.pop(key).state == "expected":
                self._unprepared -= 1

    def _wake(self) -> None:
        """Wakes the thread if it waits and has a micro-batch to prepare now."""
        if self._idle and self._unprepared and self._next_key() is not None:
            self._work.notify()

    def _run(self, key: Key, entry: _Entry, cancelled: Cancel = None) -> None:
        """Prepares `entry`, which its caller marked "preparing", without the lock (held on entry
        and on return)."""
        self._lock.release()
        t0 = time.perf_counter()
        try:
            value, error = self._prepare(key, cancelled), None
        except BaseException as e:  # raised where the micro-batch is taken
            value, error = None, e
        finally:
            self._lock.acquire()
        self.prepare_seconds += time.perf_counter() - t0
        entry.value, entry.error, entry.state = value, error, "ready"
        self._prepared.notify_all()

    def _next_key(self) -> tuple[Key, _Entry] | None:
        """The first micro-batch still to prepare in the window: in the order they are read, those
        not yet taken of the earliest step, then `depth` more."""
        pending = sorted(
            ((k, e) for k, e in self._entries.items() if e.reads > 0),
            key=lambda ke: (ke[0][0], ke[1].order),
        )
        if not pending:
            return None
        first = pending[0][0][0]
        window = sum(1 for k, _ in pending if k[0] == first) + self._depth
        return next(((k, e) for k, e in pending[:window] if e.state == "expected"), None)

    def _loop(self) -> None:
        with self._lock:
            while True:
                while not self._closed and (chosen := self._next_key()) is None:
                    self._idle = True
                    self._work.wait()
                    self._idle = False
                if self._closed:
                    return
                assert chosen is not None
                key, entry = chosen
                entry.state = "preparing"
                self._unprepared -= 1
                self._run(key, entry, functools.partial(self._dropped, key, entry))

    def _dropped(self, key: Key, entry: _Entry) -> bool:
        """Whether `entry`, which the thread reads, was dropped since (a new generation reads other
        micro-batches, or other steps): its read stops (a stream skipping to a far position).
        Called without the lock: one lookup."""
        return self._entries.get(key) is not entry
