"""Model, data and p2p tags: the deterministic pieces every worker must agree on."""

from __future__ import annotations

import pytest
import torch

from chameleond.worker import _builtin as builtin
from chameleond.worker._activation import run_stage
from chameleond.worker._data import Corpus
from chameleond.worker._layer import LayerState
from chameleond.worker._model import Arch, ArchError, build_module
from chameleond.worker._trainable import Trainable

ARCH = Arch(d_model=16, heads=2, blocks=2, seq_len=8, vocab=256, seed=3, lr=1e-2)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus(max_bytes=256 * 1024)


@pytest.fixture(scope="module")
def model(corpus: Corpus) -> Trainable:
    return Trainable(builtin.training(ARCH, 4, 4, corpus))


def test_layers_are_a_function_of_seed_and_index() -> None:
    for i in range(ARCH.n_layers):
        a, b = build_module(ARCH, i), build_module(ARCH, i)
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(pa, pb)
    other = build_module(Arch(d_model=16, heads=2, blocks=2, seq_len=8, seed=4), 1)
    key = "qkv.weight"  # LayerNorm weights start at 1 whatever the seed
    assert not torch.equal(other.state_dict()[key], build_module(ARCH, 1).state_dict()[key])


def test_arch_validation_names_the_field() -> None:
    with pytest.raises(ArchError, match="heads"):
        Arch.from_mapping({"d_model": 30, "heads": 4})
    with pytest.raises(ArchError, match=r"model\.arch\.blocks"):
        Arch.from_mapping({"blocks": "four"})
    with pytest.raises(ArchError, match="vocab"):
        Arch.from_mapping({"vocab": 1000})
    assert Arch.from_mapping({"d_model": 64, "heads": 4, "lr": 3}).lr == 3.0


def _train_step(layers: list[LayerState], model: Trainable, step: int) -> float:
    batch = model.batch(step, 0, 4, 4, torch.device("cpu"))
    out, _ = run_stage([layer.module for layer in layers], model.inputs(batch))
    loss = model.loss_sum(out, batch, 4)
    loss.backward()
    for layer in layers:
        layer.apply_update(4, step)
    return float(loss.item())


def test_migrated_state_trains_exactly_like_the_original(model: Trainable) -> None:
    """Parameters + AdamW state through the byte buffer: the next steps are bit-identical."""
    cpu = torch.device("cpu")
    original = [LayerState(model, i, cpu) for i in range(ARCH.n_layers)]
    for step in range(2):
        _train_step(original, model, step)
    moved = []
    for layer in original:
        copy = LayerState(model, layer.index, cpu)
        copy.load_buffer(layer.state_buffer().clone(), layer.version)
        moved.append(copy)
    for step in range(2, 4):
        assert _train_step(original, model, step) == _train_step(moved, model, step)
    for a, b in zip(original, moved, strict=True):
        for pa, pb in zip(a.params(), b.params(), strict=True):
            assert torch.equal(pa, pb)


def test_fresh_state_round_trips_as_fresh(model: Trainable) -> None:
    layer = LayerState(model, 1, torch.device("cpu"))
    copy = LayerState(model, 1, torch.device("cpu"))
    copy.load_buffer(layer.state_buffer(), -1)
    assert not copy.optimizer.state and copy.version == -1


def test_micro_batches_partition_the_step_samples(corpus: Corpus) -> None:
    """Sample ids [s*B, (s+1)*B): micro-batches of any split cover each sample exactly once."""
    b, seq = 12, 8
    whole = [corpus.sample(i, seq) for i in range(2 * b, 3 * b)]
    for mbs in (1, 2, 3, 4, 6, 12):
        rows = []
        for g in range(b // mbs):
            x, y = corpus.micro_batch(2, g, b, mbs, seq)
            assert torch.equal(x[:, 1:], y[:, :-1])
            rows += [torch.cat([x[i], y[i, -1:]]) for i in range(mbs)]
        assert all(torch.equal(r, w) for r, w in zip(rows, whole, strict=True))


def test_corpus_is_deterministic(corpus: Corpus) -> None:
    again = Corpus(max_bytes=256 * 1024)
    assert again.digest == corpus.digest and len(corpus.data) == 256 * 1024
    assert torch.equal(again.sample(12345, 16), corpus.sample(12345, 16))
