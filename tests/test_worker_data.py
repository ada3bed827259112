"""The worker's data path (chameleond.worker._sampler): each sample position reads one sample, a
pure function of (position, dataset, shuffle, seed), for map-style datasets (shuffled per epoch) and
streams (read again pass after pass, sought back exactly); the prefetch thread that hides reading
behind compute (the step being read and `prefetch` more ahead, a failed step's batches kept for its
retry, a read no longer wanted stopped, a restore's first step read while the generation builds, a
prepared batch taken without the thread's lock) and raises the dataset's own errors; the datasets
the library refuses. Real torch and Hugging Face datasets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import datasets
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from chameleond.worker import ModelError, Training
from chameleond.worker._sampler import MapReader, StreamReader, permutation
from chameleond.worker._step import resume_step
from chameleond.worker._trainable import Trainable

CPU = torch.device("cpu")


def training(dataset: Any, **kw: Any) -> Training:
    fields: dict[str, Any] = {"global_batch": 4, "micro_batch": 2, **kw}
    return Training(
        model=[nn.Identity()],
        loss=lambda out, batch: out.float().sum(dim=1),
        dataset=dataset,
        optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
        **fields,
    )


class Passes(IterableDataset[torch.Tensor]):
    """A torch stream of `n` samples per pass, in an order of its pass (`set_epoch`): sample i of
    pass e is [(3i + e) % n, e]. Counts the passes it opened."""

    def __init__(self, n: int = 7) -> None:
        self.n, self.epoch, self.opened = n, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.opened += 1
        epoch = self.epoch
        for i in range(self.n):
            yield torch.tensor([(3 * i + epoch) % self.n, epoch])

    def at(self, position: int) -> list[int]:
        epoch, i = divmod(position, self.n)
        return [(3 * i + epoch) % self.n, epoch]


def values(samples: list[Any]) -> list[Any]:
    return [s.tolist() if isinstance(s, torch.Tensor) else s for s in samples]


def hf_rows(n: int = 10) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"input_ids": [i, i + 1, i + 2], "row": i}


# map-style --------------------------------------------------------------------------------------


def test_unshuffled_positions_wrap_around_the_dataset() -> None:
    reader = MapReader(list(range(10)), shuffle=False, seed=0)
    assert reader.read(range(8, 13)) == ([8, 9, 0, 1, 2], [8, 9, 0, 1, 2])


def test_shuffle_is_a_permutation_per_epoch_drawn_from_the_seed() -> None:
    n = 50
    reader = MapReader(list(range(n)), shuffle=True, seed=7)
    epochs = [reader.read(range(e * n, (e + 1) * n))[0] for e in range(3)]
    assert all(sorted(ids) == list(range(n)) for ids in epochs)
    assert len({tuple(ids) for ids in epochs}) == 3  # a new order each epoch
    assert epochs[0] != list(range(n))
    again = MapReader(list(range(n)), shuffle=True, seed=7)
    assert [again.read(range(e * n, (e + 1) * n))[0] for e in (2, 0, 1)] == [
        epochs[2],
        epochs[0],
        epochs[1],
    ]
    other = MapReader(list(range(n)), shuffle=True, seed=8)
    assert other.read(range(n))[0] != epochs[0]
    assert torch.equal(permutation(n, 7, 1), torch.tensor(epochs[1], dtype=torch.int32))


def test_a_shuffled_position_reads_the_same_sample_however_it_is_reached() -> None:
    data = [torch.tensor([i]) for i in range(13)]
    walked = MapReader(data, shuffle=True, seed=3)
    for start in range(0, 60, 4):
        walked.read(range(start, start + 4))
    for p in (0, 12, 13, 40, 59):
        fresh = MapReader(data, shuffle=True, seed=3)
        assert fresh.read(range(p, p + 1)) == walked.read(range(p, p + 1))


# streams ----------------------------------------------------------------------------------------


def test_a_stream_position_is_its_sample_in_pass_after_pass() -> None:
    stream = Passes()
    reader = StreamReader(stream)
    ids, samples = reader.read(range(5, 16))  # skips 0..4, crosses two passes' ends
    assert values(samples) == [stream.at(p) for p in range(5, 16)]
    assert ids == list(range(5, 16))  # a stream's sample ids are its positions
    fresh = StreamReader(Passes())
    assert values(fresh.read(range(15, 16))[1]) == [stream.at(15)]  # pure: however reached


def test_a_stream_reader_resumes_exactly_after_going_back() -> None:
    stream = Passes()
    reader = StreamReader(stream)
    for start in (0, 4, 10, 30):  # forward: one open per pass, no reopening
        assert values(reader.read(range(start, start + 3))[1]) == [
            stream.at(p) for p in range(start, start + 3)
        ]
    assert stream.opened == 5  # passes 0..4 (position 32 is in pass 4)
    for start in (12, 3, 29, 33):  # a restore, a re-plan that moved this worker back, and on
        assert values(reader.read(range(start, start + 4))[1]) == [
            stream.at(p) for p in range(start, start + 4)
        ]


class Flaky(Passes):
    """Raises once, at sample 3 of its first pass."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i, sample in enumerate(super().__iter__()):
            if i == 3 and self.opened == 1:
                raise OSError("connection reset")
            yield sample


def test_a_stream_that_raised_is_read_again_from_its_start() -> None:
    stream = Flaky()
    reader = StreamReader(stream)
    with pytest.raises(OSError, match="connection reset"):
        reader.read(range(2, 5))
    assert values(reader.read(range(2, 9))[1]) == [stream.at(p) for p in range(2, 9)]
    assert values(reader.read(range(13, 15))[1]) == [stream.at(p) for p in (13, 14)]


def test_a_hugging_face_stream_seeks_back_from_its_state() -> None:
    stream = datasets.IterableDataset.from_generator(hf_rows).with_format("torch")
    reader = StreamReader(stream)
    for start in (0, 4, 8, 14, 22):
        reader.read(range(start, start + 2))
    assert [m.position for m in reader._marks] == [4, 8, 14, 22]
    for start in (9, 5, 23, 1, 15):
        _, samples = reader.read(range(start, start + 2))
        assert [int(s["row"]) for s in samples] == [p % 10 for p in range(start, start + 2)]
    assert reader._stateful  # every resume from a state read the sample recorded there


def test_a_shuffled_hugging_face_stream_reshuffles_per_pass_and_still_seeks_back_exactly() -> None:
    stream = datasets.IterableDataset.from_generator(hf_rows).shuffle(seed=1, buffer_size=4)
    reference = [row["row"] for row in StreamReader(stream).read(range(30))[1]]
    passes = [reference[0:10], reference[10:20], reference[20:30]]
    assert all(sorted(p) == list(range(10)) for p in passes) and passes[0] != passes[1]
    reader = StreamReader(stream)
    for start in (0, 6, 12, 24):
        reader.read(range(start, start + 3))
    for start in (7, 13, 2, 25):
        rows = [row["row"] for row in reader.read(range(start, start + 3))[1]]
        assert rows == reference[start : start + 3]
    # A shuffle buffer is refilled on resume (other samples): the reader skips from the start.
    assert not reader._stateful


# through Trainable.batch ------------------------------------------------------------------------


def test_a_hugging_face_dataset_is_read_map_style_and_shuffled() -> None:
    rows = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(8)]})
    model = Trainable(training(rows.with_format("torch"), shuffle=True, seed=5))
    batch = model.batch(1, 1, 4, 2, CPU)
    ids = model.read_ids(1, [1])
    order = permutation(8, 5, 0).tolist()
    assert model.sample_ids(1, 1, 4, 2) == range(6, 8)
    assert model.reader.sample_ids(range(6, 8)) == list(ids)  # the same, without reading
    assert ids == tuple(order[6:8])
    assert torch.equal(batch["input_ids"], torch.tensor([[i, i] for i in ids]))
    assert len(model.data_digest()) == 16


def test_a_hugging_face_stream_is_read_through_the_trainable() -> None:
    stream = datasets.IterableDataset.from_generator(hf_rows).with_format("torch")
    model = Trainable(training(stream))
    digest = model.data_digest()
    model.expect(3, [0, 1], 4, 2)
    assert model.batch(3, 1, 4, 2, CPU)["row"].tolist() == [4, 5]  # positions 14, 15
    assert model.batch(3, 0, 4, 2, CPU)["row"].tolist() == [2, 3]  # back: 12, 13
    model.close()
    same = datasets.IterableDataset.from_generator(hf_rows).with_format("torch")
    assert Trainable(training(same)).data_digest() == digest  # another worker, the same stream
    assert Trainable(training(same.skip(1))).data_digest() != digest  # other first samples


def test_a_torch_iterable_dataset_is_read_through_the_trainable() -> None:
    stream = Passes()
    model = Trainable(training(stream, prefetch=2))
    model.expect(0, [0, 1], 4, 2)
    model.expect(1, [0, 1], 4, 2)
    got = [model.batch(s, g, 4, 2, CPU).tolist() for s in (0, 1) for g in (0, 1)]
    assert got == [[stream.at(p) for p in range(2 * i, 2 * i + 2)] for i in range(4)]
    assert [model.read_ids(s, [0, 1]) for s in (0, 1)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert model.reader.sample_ids(model.sample_ids(1, 1, 4, 2)) == [6, 7]
    model.close()


# the prefetcher ---------------------------------------------------------------------------------


class Slow(Dataset[torch.Tensor]):
    """Sample i is [i, i, i, i], read in `seconds`; records the thread of each read."""

    def __init__(self, n: int, seconds: float, bad: int | None = None) -> None:
        self.n, self.seconds, self.bad = n, seconds, bad
        self.readers: list[str] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.readers.append(threading.current_thread().name)
        time.sleep(self.seconds)
        if i == self.bad:
            raise KeyError(f"sample {i} is corrupt")
        return torch.full((4,), float(i))


def settle(model: Trainable) -> None:
    """Until the prefetch thread has nothing left to prepare."""
    deadline = time.monotonic() + 10
    while model._prefetcher._next_key() is not None or not model._prefetcher._idle:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_the_prefetcher_hides_reading_behind_compute() -> None:
    model = Trainable(training(Slow(64, 0.004), global_batch=8, micro_batch=2))
    mine = [0, 1, 2, 3]
    for step in range(10):  # as the step runner: this step (if not yet) and the next
        model.expect(step, mine, 8, 2)
        model.expect(step + 1, mine, 8, 2)
        for g in mine:
            batch = model.batch(step, g, 8, 2, CPU)
            assert batch[:, 0].tolist() == [float((step * 8 + g * 2 + i) % 64) for i in (0, 1)]
            time.sleep(0.02)  # the micro-batch's forward and backward
    stats = model.data_stats()
    model.close()
    assert stats["prepare_seconds"] >= 40 * 2 * 0.004
    assert stats["overlap"] >= 0.9, stats


def test_a_dataset_error_is_raised_in_the_training_thread() -> None:
    model = Trainable(training(Slow(8, 0.0, bad=5)))
    model.expect(1, [0, 1], 4, 2)  # positions 4..7: micro-batch 0 holds sample 5
    with pytest.raises(KeyError, match="sample 5 is corrupt"):
        model.batch(1, 0, 4, 2, CPU)
    assert model.batch(1, 1, 4, 2, CPU)[:, 0].tolist() == [6.0, 7.0]
    model.close()


def test_the_prefetch_thread_keeps_only_its_window_and_stops() -> None:
    model = Trainable(training(Slow(8, 0.0), prefetch=3))
    model.expect(20, [0, 1, 0], 4, 2)  # micro-batch 0 read twice: a first and a last stage
    model.expect(21, [0, 1], 4, 2)
    first = model.batch(20, 0, 4, 2, CPU)
    assert model.batch(20, 0, 4, 2, CPU) is first
    model.expect(5, [1], 4, 2)  # a new generation resumed earlier: 20 and 21 are forgotten
    assert set(model._prefetcher._entries) <= {(5, 1, 4, 2)}
    assert model.batch(5, 1, 4, 2, CPU)[:, 0].tolist() == [6.0, 7.0]
    thread = model._prefetcher._thread
    assert thread is not None and thread.is_alive()
    model.close()
    model.close()
    assert not thread.is_alive()
    assert model.batch(6, 0, 4, 2, CPU)[:, 0].tolist() == [0.0, 1.0]  # read here after close
    assert not any(t.name == "chameleond-prefetch" and t.is_alive() for t in threading.enumerate())


def test_the_thread_prepares_the_step_being_read_and_prefetch_more() -> None:
    data = Slow(64, 0.0)
    model = Trainable(training(data, global_batch=8, micro_batch=2, prefetch=1))
    mine = [2, 0, 3, 1]  # in the order the worker reads them
    model.expect(0, mine, 8, 2)
    model.expect(1, mine, 8, 2)
    settle(model)
    ready = {k for k, e in model._prefetcher._entries.items() if e.state == "ready"}
    assert ready == {(0, g, 8, 2) for g in mine} | {(1, 2, 8, 2)}  # step 0, and one more
    for step in (0, 1):
        for g in mine:
            assert model.batch(step, g, 8, 2, CPU)[:, 0].tolist() == [
                step * 8 + g * 2,
                step * 8 + g * 2 + 1,
            ]
        settle(model)  # each take frees room in the window: the thread reads on
    model.close()
    assert data.readers == ["chameleond-prefetch"] * 16  # none read in the training thread


def test_a_step_trained_again_reads_the_batches_it_read_before() -> None:
    data = Slow(64, 0.0)
    model = Trainable(training(data, global_batch=8, micro_batch=2))
    model.expect(7, [0, 1], 8, 2)
    first = [model.batch(7, g, 8, 2, CPU) for g in (0, 1)]
    read = len(data.readers)
    # The generation fails during step 7; the next one trains it again, with the same reads...
    model.expect(7, [0, 1], 8, 2)
    again = [model.batch(7, g, 8, 2, CPU) for g in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
    assert len(data.readers) == read  # nothing read again
    # ... or, rerouted, one more: only that one is read.
    model.expect(7, [0, 2, 1], 8, 2)
    settle(model)
    assert model.batch(7, 2, 8, 2, CPU)[:, 0].tolist() == [60.0, 61.0]
    assert torch.equal(model.batch(7, 1, 8, 2, CPU), first[1])
    assert len(data.readers) == read + 2  # micro-batch 2's two samples
    model.batch(8, 0, 8, 2, CPU)  # a later step: step 7's are let go
    assert not any(k[0] == 7 for k in model._prefetcher._entries)
    model.close()


def test_a_prepared_batch_is_taken_while_the_thread_holds_the_lock() -> None:
    model = Trainable(training(Slow(16, 0.0)))
    model.expect(0, [0, 1], 4, 2)
    model.expect(1, [0, 1], 4, 2)
    settle(model)
    got: list[list[float]] = []

    def read() -> None:
        got.extend(model.batch(0, g, 4, 2, CPU)[:, 0].tolist() for g in (0, 1))

    reader = threading.Thread(target=read)
    with model._prefetcher._lock:  # as the thread does, just woken and waiting for a core
        reader.start()
        reader.join(5)
        assert got == [[0.0, 1.0], [2.0, 3.0]]
    model.close()


class SlowPasses(Passes):
    """Passes of `n` samples, each read in `seconds`; counts the samples it gave."""

    def __init__(self, n: int, seconds: float) -> None:
        super().__init__(n)
        self.seconds, self.given = seconds, 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for sample in super().__iter__():
            time.sleep(self.seconds)
            self.given += 1
            yield sample


def test_a_read_no_longer_wanted_stops_and_the_stream_reads_on_exactly() -> None:
    stream = SlowPasses(1000, 0.002)
    model = Trainable(training(stream))
    model.expect(100, [0], 4, 2)  # positions 400, 401: a skip of about a second
    time.sleep(0.05)
    model.expect(2, [1], 4, 2)  # a new generation resumed elsewhere: step 100 is dropped
    assert model.batch(2, 1, 4, 2, CPU).tolist() == [stream.at(p) for p in (10, 11)]
    model.close()
    assert stream.given < 300  # the skip stopped
    assert values(model.reader.read(range(350, 352))[1]) == [stream.at(p) for p in (350, 351)]


def test_a_restore_plan_resumes_after_its_checkpoint() -> None:
    """The step whose data a worker reads while it builds a generation: after its committed step,
    or, on a restore plan's first attempt, after the checkpoint every worker of it loads."""
    restore = SimpleNamespace(restore_step=9)
    assert resume_step(restore, 12, attempt=1) == 10  # type: ignore[arg-type]
    assert resume_step(restore, 12, attempt=2) == 13  # type: ignore[arg-type]
    assert resume_step(SimpleNamespace(restore_step=None), 12, attempt=1) == 13  # type: ignore[arg-type]


# refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "kw", "message"),
    [
        (list(range(3)), {}, "the dataset has 3 samples, fewer than one global batch of 4"),
        (42, {}, r"the dataset \(int\) is neither map-style"),
        (iter(range(10)), {}, r"the dataset is an iterator \(range_iterator\), read once"),
        (Passes(), {"shuffle": True}, "Training.shuffle needs a map-style dataset"),
        (list(range(8)), {"prefetch": -1}, "Training.prefetch must be an integer >= 0"),
    ],
)
def test_a_dataset_the_library_cannot_read_is_refused(
    dataset: Any, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelError, match=message):
        Trainable(training(dataset, **kw))
