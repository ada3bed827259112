"""Hugging Face causal LMs as the library's `Layers` (`chameleond.worker.hf`, docs/hf.md).

`split_causal_lm(model)` cuts a `transformers` causal LM into the layers a pipeline stage holds:

    layer 0            the embeddings (token, plus position for GPT-2)
    layers 1..n        one per decoder block
    layer n + 1        the final norm and the LM head

Each layer is a module with one tensor in and one tensor out: a decoder block's wrapper computes
what the block needs besides the hidden states (position ids, the causal or sliding-window mask,
rotary position embeddings) from the hidden states themselves, so a stage needs nothing but its
input activation.
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
# The attention implementations (config._attn_implementation) whose mask the split builds, the
# one their model gives them for full sequences without padding or cache. Flex attention's
# BlockMask, and the masks of hub kernels, are not built here: such a model is refused.
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


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

    Position ids are 0..seq-1 (no padding, no cache: training on full sequences); the attention
    mask is the one the model gives this block for its attention implementation (`causal_mask`);
    a rotary model's position embeddings come from this layer's own copy of the model's rotary
    module (buffers only, no parameters).

    The mask and the position ids depend only on the input's shape, dtype and device and the
    attention implementation: they are built once and kept for the next micro-batch of the same
    shape, where the model itself builds them at each forward (once for all its blocks; this
    wrapper would otherwise build them once per block)."""

    def __init__(
        self, block: nn.Module, config: Any, rotary: nn.Module | None, window: int | None
    ) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config
        self.window = window  # the block's sliding window, None for full causal attention
        self._shape_key: tuple[Any, ...] | None = None
        self._kept: tuple[torch.Tensor, torch.Tensor | None] | None = None  # position ids, mask

    def _positions_and_mask(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        implementation = self.config._attn_implementation
        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device, implementation)
        if self._kept is None or key != self._shape_key:
            batch, seq = hidden.shape[:2]
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
            mask = causal_mask(implementation, batch, seq, self.window, hidden.dtype, hidden.device)
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


def causal_mask(
    implementation: str,
    batch: int,
    seq: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """The attention mask a decoder block gets from its model for `batch` full sequences of `seq`
    tokens (positions 0..seq-1, no padding, no cache): query q sees keys q - window < k <= q
    (k <= q without a window).

    Built here rather than through `transformers.masking_utils.create_causal_mask`, whose
    signature changed four times within transformers 5 (`input_embeds` -> `inputs_embeds`; the
    cache argument after a required `cache_position`, keyword-only, positional, then renamed
    `cache`; docs/hf.md): what the model gives each implementation for such sequences has not.
    sdpa and flash attention get no mask when it would be plain causal (the kernel's own
    `is_causal`; flash attention also applies the window itself); sdpa otherwise a boolean mask
    [batch, 1, seq, seq], True where a key is seen; eager always an additive one of `dtype`,
    0 where a key is seen and dtype's minimum elsewhere."""
    if implementation not in ATTENTION:
        raise ModelError(refused_attention(implementation))
    if window is not None and window > seq:
        window = None  # longer than the sequence: plain causal (transformers' rule for sdpa)
    if implementation.startswith("flash_attention") or (
        implementation == "sdpa" and window is None
    ):
        return None
    query = torch.arange(seq, device=device).unsqueeze(1)
    key = torch.arange(seq, device=device).unsqueeze(0)
    seen = key <= query
    if window is not None:
        seen &= key > query - window
    seen = seen.expand(batch, 1, seq, seq)
    if implementation == "sdpa":
        return seen
    zero = torch.tensor(0.0, device=device, dtype=dtype)
    return torch.where(seen, zero, torch.finfo(dtype).min)


def refused_attention(implementation: object) -> str:
    return (
        f"attention implementation {implementation!r} is not one the split builds masks for "
        f"({', '.join(ATTENTION)}): load the model with attn_implementation='sdpa'"
    )


def sliding_window(model_type: str, config: Any, index: int) -> int | None:
    """Block `index`'s sliding window, as its model masks it: every Mistral block's when the
    config has one, a Qwen2 block's when `layer_types` names it a sliding one; None otherwise."""
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral":
        return window if isinstance(window, int) else None
    if model_type == "qwen2" and isinstance(window, int):
        layer_types = getattr(config, "layer_types", None) or []
        if index < len(layer_types) and layer_types[index] == "sliding_attention":
            return window
    return None


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
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ATTENTION:
        raise ModelError(f"{name}: {refused_attention(implementation)}")
    rotary = getattr(base, "rotary_emb", None)
    decoders = [
        DecoderBlock(
            b, model.config, copy.deepcopy(rotary), sliding_window(model_type, model.config, i)
        )
        for i, b in enumerate(blocks)
    ]
    modules: list[nn.Module] = [embeddings, *decoders, LMHead(part(norm_name), head)]
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
