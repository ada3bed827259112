"""examples/hf_text.py: local text, a deterministic cached BPE, samples by id."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tokenizers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import hf_text

CHARS = 60_000
VOCAB = 400
SEQ = 32


def test_bpe_training_is_deterministic_and_cached(tmp_path: Path) -> None:
    texts = hf_text.stdlib_texts(CHARS)
    assert sum(map(len, texts)) == CHARS
    a = hf_text.train_tokenizer(texts, VOCAB)
    b = hf_text.train_tokenizer(texts, VOCAB)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == VOCAB
    cached = hf_text.cached_tokenizer(texts, VOCAB, tmp_path)
    [path] = tmp_path.iterdir()
    assert path.name == f"bpe-{hf_text.digest(texts)}-{VOCAB}.json"
    assert cached.to_str() == a.to_str()
    stamp = path.stat().st_mtime_ns
    assert hf_text.cached_tokenizer(texts, VOCAB, tmp_path).to_str() == a.to_str()
    assert path.stat().st_mtime_ns == stamp  # read back, not trained again
    # Byte-level: any text, and exactly it, comes back from its ids.
    sample = texts[3][:500] + " naïve ∑ \t\n"
    assert a.decode(a.encode(sample).ids) == sample


def test_samples_are_blocks_of_the_token_stream(tmp_path: Path) -> None:
    data = hf_text.stdlib_blocks(SEQ, VOCAB, tmp_path, max_chars=CHARS)
    again = hf_text.stdlib_blocks(SEQ, VOCAB, tmp_path, max_chars=CHARS)
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == ["bpe", "ids"]
    assert len(data) > 100
    assert torch.equal(data.blocks, again.blocks) and data.digest == again.digest
    tok = hf_text.cached_tokenizer(hf_text.stdlib_texts(CHARS), VOCAB, tmp_path)
    stream = tok.encode_batch(hf_text.stdlib_texts(CHARS))
    ids = [i for e in stream for i in e.ids]
    assert data[5]["input_ids"].tolist() == ids[5 * SEQ : 6 * SEQ]
    assert int(data.blocks.max()) < VOCAB
    batch = hf_text.collate([data[i] for i in (7, 8, 9)])
    assert batch["input_ids"].shape == (3, SEQ) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])


def test_too_little_text_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    with pytest.raises(hf_text.TextError, match="too small"):
        hf_text.stdlib_blocks(SEQ, VOCAB, tmp_path / "cache", root=tmp_path / "src")
