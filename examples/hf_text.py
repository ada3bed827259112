"""Text for the Hugging Face example, from files every machine already has: no download.

The corpus is the Python standard library's own `.py` sources (directories walked in sorted order,
site-packages and tests excluded, the first `max_chars` characters). A byte-level BPE
(`tokenizers`) is trained on it at start-up and cached under `cache_dir` with the token ids, keyed
by the corpus digest and the vocabulary size. BPE training is deterministic, so every worker that
trains its own gets the same merges; the digest names what was trained on. The token stream is
cut into blocks of `seq_len` tokens (`run_clm.py`'s "group_texts" in transformers); sample i is
block i.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from tokenizers.models import BPE
from tokenizers.pre_tokenizers import ByteLevel as ByteLevelPre
from tokenizers.trainers import BpeTrainer

DEFAULT_MAX_CHARS = 1_000_000
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests"}


class TextError(RuntimeError):
    """The local corpus is missing or too small for the requested blocks."""


def stdlib_texts(max_chars: int, root: Path | None = None) -> list[str]:
    """The standard library's .py files in a fixed order, until `max_chars` characters."""
    base = str(root or sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            text = (Path(dirpath) / name).read_text(encoding="utf-8", errors="replace")
            texts.append(text[: max_chars - total])
            total += len(texts[-1])
            if total >= max_chars:
                return texts
    return texts


def digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes included) trained on `texts`."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = ByteLevelPre(add_prefix_space=False)
    tok.decoder = ByteLevelDecoder()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=ByteLevelPre.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def cached_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: Path) -> Tokenizer:
    """The tokenizer of `texts`, trained once per corpus and vocabulary, then read back.

    Workers starting together may all train it: each writes a file of its own and renames it into
    place, so a reader never sees half a file (and they all wrote the same one)."""
    path = cache_dir / f"bpe-{digest(texts)}-{vocab_size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = train_tokenizer(texts, vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return tok


class TokenBlocks(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Map-style dataset: sample i is the i-th block of `seq_len` tokens of the corpus."""

    def __init__(self, ids: torch.Tensor, seq_len: int, corpus_digest: str) -> None:
        if ids.numel() < seq_len:
            raise TextError(f"{ids.numel()} tokens do not make one block of {seq_len}")
        self.blocks = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
        self.digest = corpus_digest

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i]}


def stdlib_blocks(
    seq_len: int,
    vocab_size: int,
    cache_dir: Path,
    max_chars: int = DEFAULT_MAX_CHARS,
    root: Path | None = None,
) -> TokenBlocks:
    texts = stdlib_texts(max_chars, root)
    if sum(map(len, texts)) < 10_000:
        raise TextError(f"the standard library sources under {root or 'stdlib'} are too small")
    name = digest(texts)
    path = cache_dir / f"ids-{name}-{vocab_size}.pt"
    if path.exists():
        ids = torch.load(path, weights_only=True)
    else:
        tok = cached_tokenizer(texts, vocab_size, cache_dir)
        encoded = [i for enc in tok.encode_batch(list(texts)) for i in enc.ids]
        ids = torch.tensor(encoded, dtype=torch.long)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(ids, tmp)
        tmp.replace(path)
    return TokenBlocks(ids, seq_len, name)


def collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack the blocks; the labels are the inputs (the loss shifts them, as in transformers)."""
    input_ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chameleond" / "hf-example"
