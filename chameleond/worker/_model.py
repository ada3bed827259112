"""The built-in model (`chameleon-worker`'s default job): a small decoder-only transformer, one
module per layer, trained through the worker library like any user's model
(chameleond.worker._builtin).

Layer 0 is the token + position embedding, layers 1..blocks are transformer blocks, the last layer
is the final norm + LM head. Every layer is built from (seed, layer index) alone, so any worker can
build an identical copy of any layer without talking to anyone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class ArchError(ValueError):
    """The spec's [model.arch] table is unusable; the message names the field."""


@dataclass(frozen=True)
class Arch:
    d_model: int = 32
    heads: int = 2
    blocks: int = 4
    seq_len: int = 32
    vocab: int = 256
    seed: int = 0
    lr: float = 1e-3

    @property
    def n_layers(self) -> int:
        return self.blocks + 2

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> Arch:
        fields: dict[str, Any] = {}
        for name in ("d_model", "heads", "blocks", "seq_len", "vocab", "seed"):
            if name in m:
                v = m[name]
                if isinstance(v, bool) or not isinstance(v, int):
                    raise ArchError(f"model.arch.{name}: expected an integer, got {v!r}")
                fields[name] = v
        if "lr" in m:
            lr = m["lr"]
            if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr):
                raise ArchError(f"model.arch.lr: expected a number, got {lr!r}")
            fields["lr"] = float(lr)
        arch = cls(**fields)
        for name in ("d_model", "heads", "blocks", "seq_len", "vocab"):
            if getattr(arch, name) <= 0:
                raise ArchError(f"model.arch.{name}: must be > 0")
        if arch.seed < 0:
            raise ArchError("model.arch.seed: must be >= 0")
        if arch.lr <= 0:
            raise ArchError("model.arch.lr: must be > 0")
        if arch.d_model % arch.heads:
            raise ArchError(
                f"model.arch: heads ({arch.heads}) must divide d_model ({arch.d_model})"
            )
        if arch.vocab > 256:
            # The corpus is bytes; a larger vocabulary would only hold unused rows.
            raise ArchError("model.arch.vocab: the byte-level corpus needs vocab <= 256")
        return arch


class Embedding(nn.Module):
    def __init__(self, arch: Arch) -> None:
        super().__init__()
        self.tokens = nn.Embedding(arch.vocab, arch.d_model)
        self.positions = nn.Embedding(arch.seq_len, arch.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(pos)


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, arch: Arch) -> None:
        super().__init__()
        d = arch.d_model
        self.heads = arch.heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, arch: Arch) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(arch.d_model)
        self.out = nn.Linear(arch.d_model, arch.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_module(arch: Arch, index: int) -> nn.Module:
    """Layer `index`, initialised from (seed, index) only; the global RNG is left untouched."""
    if not 0 <= index < arch.n_layers:
        raise IndexError(f"layer {index} out of range 0..{arch.n_layers - 1}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(arch.seed * 1_000_003 + index)
        if index == 0:
            return Embedding(arch)
        if index == arch.n_layers - 1:
            return Head(arch)
        return Block(arch)


def sample_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over tokens: one loss per sample (PAPER.md section 8)."""
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return per_token.view(targets.shape).mean(dim=1)


def sample_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-sample mean over tokens, summed over samples."""
    return sample_losses(logits, targets).sum()
