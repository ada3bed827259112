"""Hugging Face causal LMs as the library's `Layers` (docs/hf.md; public as `chameleond.hf`).

`split_causal_lm(model)` cuts a `transformers` causal LM into the layers a pipeline stage holds:

    layer 0            the embeddings (token, plus position for GPT-2)
    layers 1..n        one per decoder block
    layer n + 1        the final norm and the LM head

Each layer is a module with one tensor in and one tensor out: a decoder block's wrapper computes
what the block needs besides the hidden states (position ids, the causal mask, rotary position
embeddings) from the hidden states themselves, so a stage needs nothing but its input activation.
The layers hold the model's own submodules (no copy), except for tied parameters: GPT-2 uses one
matrix as token embedding and LM head; that parameter gets a copy in the head layer, declared as a
`Tie`, and the library keeps the two copies equal (their gradients are summed before the update).
Every parameter of the model ends up in exactly one layer, or in both layers of a declared tie;
`split_causal_lm` checks this and names any parameter it would drop.

`causal_lm_loss(logits, batch)` is the per-sample loss the library sums over the global batch: the
shifted next-token cross-entropy, averaged over each sample's labelled tokens.

Needs the `hf` extra (`pip install 'chameleond[hf]'`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask

from chameleond.worker import Layers, ModelError, Tie, split

IGNORE_INDEX = -100  # the label Hugging Face models skip in their loss
# config.model_type -> the base model's (embeddings, decoder blocks, final norm) attributes. GPT-2
# adds learned positions to its token embeddings; the others apply rotary positions in each block.
FAMILIES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "gpt2": (("wte", "wpe", "drop"), "h", "ln_f"),
    "llama": (("embed_tokens",), "layers", "norm"),
    "mistral": (("embed_tokens",), "layers", "norm"),
    "qwen2": (("embed_tokens",), "layers", "norm"),
}


class GPT2Embeddings(nn.Module):
    """Token + learned position embeddings, then the embedding dropout (GPT2Model's first part)."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class TokenEmbeddings(nn.Module):
    """Token embeddings only: the blocks add positions (rotary)."""

    def __init__(self, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(input_ids)
        return out


class DecoderBlock(nn.Module):
    """One decoder block as hidden states -> hidden states.

    Position ids are 0..seq-1 (no padding, no cache: training on full sequences); the causal mask
    is built as the model builds it, for the model's attention implementation; a rotary model's
    position embeddings come from this layer's own copy of the model's rotary module (buffers
    only, no parameters).

    The mask and the position ids depend only on the input's shape, dtype and device (positions
    0..seq-1 are never a packed sequence, which is what `create_causal_mask` looks for in them):
    they are built once and kept for the next micro-batch of the same shape, where the model
    itself builds them at each forward (once for all its blocks; this wrapper would otherwise
    build them once per block)."""

    def __init__(self, block: nn.Module, config: Any, rotary: nn.Module | None) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config
        self._shape_key: tuple[Any, ...] | None = None
        self._kept: tuple[torch.Tensor, Any] | None = None  # position ids, mask

    def _positions_and_mask(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Any]:
        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device)
        if self._kept is None or key != self._shape_key:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=None,
                cache=None,
                position_ids=None,  # 0..seq-1: no packed sequence to look for
            )
            self._shape_key, self._kept = key, (position_ids, mask)
        return self._kept

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids, mask = self._positions_and_mask(hidden)
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, position_ids=position_ids)
        out = self.block(hidden, use_cache=False, **kwargs)
        # transformers 5 blocks return the hidden states; older ones a tuple led by them.
        return out[0] if isinstance(out, tuple) else out


class LMHead(nn.Module):
    """Final norm, then the LM head: hidden states -> logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return logits


def split_causal_lm(model: PreTrainedModel) -> Layers:
    """`model`'s layers: embeddings, each decoder block, final norm + head (see the module doc).

    The layers take over the model's submodules; tied parameters are untied (a copy in the later
    layer, declared as a `Tie`), so use the layers, not `model`, from here on. Raises ModelError
    for a model family it does not know or a parameter no layer would hold."""
    name = type(model).__name__
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ModelError(f"{name}: model_type {model_type!r} is not one of {known}")
    embed_names, blocks_name, norm_name = FAMILIES[model_type]
    base = model.base_model
    head = model.get_output_embeddings()
    if base is model or not isinstance(head, nn.Module):
        raise ModelError(f"{name}: not a causal LM (no base model and LM head)")

    def part(attr: str) -> nn.Module:
        found = getattr(base, attr, None)
        if not isinstance(found, nn.Module):
            raise ModelError(f"{name}: its {model_type} base model has no module {attr!r}")
        return found

    embeds = [part(n) for n in embed_names]
    embeddings = GPT2Embeddings(*embeds) if model_type == "gpt2" else TokenEmbeddings(*embeds)
    blocks = part(blocks_name)
    if not isinstance(blocks, nn.ModuleList):
        raise ModelError(f"{name}: its decoder blocks {blocks_name!r} are not a ModuleList")
    rotary = getattr(base, "rotary_emb", None)
    modules: list[nn.Module] = [
        embeddings,
        *(DecoderBlock(b, model.config, copy.deepcopy(rotary)) for b in blocks),
        LMHead(part(norm_name), head),
    ]
    ties = untie(modules)
    # `split` refuses a cut that leaves a parameter of the model in no layer, naming it.
    return split(model, lambda _: modules, ties)


def untie(modules: list[nn.Module]) -> list[Tie]:
    """Give every parameter used by two layers a copy in the later one, and declare the pair.

    A parameter shared within one layer stays shared: that layer's optimizer sees it once."""
    first_use: dict[int, tuple[int, str]] = {}
    ties: list[Tie] = []
    for index, module in enumerate(modules):
        copies: dict[int, nn.Parameter] = {}  # this layer's copy of each earlier layer's parameter
        for pname, param in list(module.named_parameters(remove_duplicate=False)):
            owner = first_use.setdefault(id(param), (index, pname))
            if owner[0] == index:
                continue
            if id(param) not in copies:
                copies[id(param)] = nn.Parameter(
                    param.detach().clone(), requires_grad=param.requires_grad
                )
                ties.append(Tie(first=owner, second=(index, pname)))
            parent, _, leaf = pname.rpartition(".")
            setattr(module.get_submodule(parent), leaf, copies[id(param)])
    return ties


def causal_lm_loss(logits: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-sample next-token cross-entropy, [samples]: logits at position t predict label t + 1
    (labels unshifted, as Hugging Face models take them), averaged over each sample's tokens whose
    label is not -100. With every token labelled, the mean over samples is `model(...).loss`."""
    labels = batch["labels"][:, 1:]
    shifted = logits[:, :-1, :]
    per_token = F.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(labels.shape)
    counted = (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)
    return per_token.sum(dim=1) / counted
