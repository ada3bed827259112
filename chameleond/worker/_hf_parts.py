"""Finding a Hugging Face causal LM's parts from its structure (`chameleond.worker.hf`).

A causal LM is a base model plus an LM head (`get_output_embeddings()`). The base model's direct
parts, in registration order, must each be one the split knows: the token embeddings
(`get_input_embeddings()`), learned position embeddings (a plain `nn.Embedding`, GPT-2's wpe) and
an embedding dropout before the decoder blocks, the blocks (the base's one `nn.ModuleList`), the
rotary module (`rotary_emb`, buffers only), and the final norm after the blocks (a module whose
class is a norm: LayerNorm, RMSNorm, ...). Anything else, at the top or in the base, would be a
computation the layers leave out, so it is refused by name rather than dropped. So are configs
whose forward does what the layers do not (logit soft-capping) and attention layer types other
than full and sliding-window attention.

Nothing here reads a tensor's values: it works on a model built on the `meta` device.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from chameleond.worker.api import ModelError

ROTARY = "rotary_emb"
LAYER_TYPES = ("full_attention", "sliding_attention")
# Config attributes whose computation the layers do not reproduce: refused when set.
UNSUPPORTED = {
    "final_logit_softcapping": "soft-capped logits",
}


@dataclass
class Parts:
    """A causal LM's parts, each the model's own module; names are the base model's attributes."""

    tokens: nn.Module
    tokens_name: str
    positions: nn.Module | None
    positions_name: str | None
    dropout: nn.Module | None
    dropout_name: str | None
    blocks: nn.ModuleList
    rotary: nn.Module | None
    norm: nn.Module
    head: nn.Module


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm | nn.RMSNorm) or "norm" in type(module).__name__.lower()


def find_parts(model: nn.Module) -> Parts:
    """`model`'s parts (see the module doc), or a ModelError naming its class and the part."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ModelError(f"{name}: not a decoder-only causal LM (an encoder-decoder or no config)")
    for attr, what in UNSUPPORTED.items():
        if getattr(config, attr, None) is not None:
            raise ModelError(f"{name}: its config sets {attr} ({what}), which the split lacks")
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise ModelError(f"{name}: not a causal LM: it has no base model under an LM head")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Module):
        raise ModelError(f"{name}: not a causal LM: it has no LM head (get_output_embeddings)")
    for child_name, child in model.named_children():
        if child is not base and child is not head:
            raise ModelError(
                f"{name}: part {child_name!r} ({type(child).__name__}) is neither its base "
                "model nor its LM head; the split does not know what it computes"
            )
    get_tokens = getattr(base, "get_input_embeddings", None)
    tokens = get_tokens() if callable(get_tokens) else None
    base_name = type(base).__name__
    found: dict[str, tuple[str, nn.Module]] = {}
    for child_name, child in base.named_children():
        role = _role(child_name, child, tokens, "blocks" in found)
        if role is None:
            raise ModelError(
                f"{name}: its base model {base_name} has a part the split does not know: "
                f"{child_name!r} ({type(child).__name__})"
            )
        if role in found:
            raise ModelError(
                f"{name}: its base model {base_name} has two {role} parts: "
                f"{found[role][0]!r} and {child_name!r}"
            )
        found[role] = (child_name, child)
    for role, what in (
        ("tokens", "token embeddings (get_input_embeddings(), a direct part of the base model)"),
        ("blocks", "decoder blocks (an nn.ModuleList in its base model)"),
        ("norm", "final norm (a norm module after the decoder blocks)"),
    ):
        if role not in found:
            raise ModelError(f"{name}: cannot find its {what} in {base_name}")
    blocks = found["blocks"][1]
    assert isinstance(blocks, nn.ModuleList)

    def optional(role: str) -> tuple[str | None, nn.Module | None]:
        return found.get(role, (None, None))

    positions_name, positions = optional("positions")
    dropout_name, dropout = optional("dropout")
    return Parts(
        tokens=found["tokens"][1],
        tokens_name=found["tokens"][0],
        positions=positions,
        positions_name=positions_name,
        dropout=dropout,
        dropout_name=dropout_name,
        blocks=blocks,
        rotary=optional("rotary")[1],
        norm=found["norm"][1],
        head=head,
    )


def _role(
    child_name: str, child: nn.Module, tokens: nn.Module | None, after_blocks: bool
) -> str | None:
    """What a direct part of the base model is, by identity, type and place; None: unknown."""
    if child is tokens:
        return "tokens"
    if isinstance(child, nn.ModuleList):
        return "blocks"
    if child_name == ROTARY:
        return "rotary"
    if after_blocks:
        return "norm" if _is_norm(child) else None
    if type(child) is nn.Embedding:  # learned positions; a subclass may index otherwise (OPT)
        return "positions"
    if isinstance(child, nn.Dropout):
        return "dropout"
    return None


def sliding_window(name: str, config: Any, index: int) -> int | None:
    """Block `index`'s sliding window, as its model masks it: with `config.layer_types`, the
    config's positive `sliding_window` on the blocks it names "sliding_attention" (Qwen2, Qwen3,
    Qwen2-MoE); without, on every block (Mistral, Mixtral, Phi3); None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    kind = layer_types[index] if layer_types is not None and index < len(layer_types) else None
    if kind is not None and kind not in LAYER_TYPES:
        raise ModelError(
            f"{name}: block {index}'s layer type {kind!r} is not one the split builds masks for "
            f"({', '.join(LAYER_TYPES)})"
        )
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return None
    if layer_types is None or kind == "sliding_attention":
        return window
    return None


@dataclass
class Routing:
    """How an MoE model's router loss is computed: the router modules of each block (whose output
    `index` is the router logits), the model's load-balancing function and its arguments."""

    modules: list[list[str]]  # per block, the routers' names within it
    index: int
    balance: Callable[..., Any]
    experts: int
    top_k: int
    coefficient: float


def routing(model: nn.Module, blocks: nn.ModuleList) -> Routing | None:
    """The router loss's recipe when `model.config.output_router_logits` is set, else None.

    The routers are the modules transformers records router logits from
    (`_can_record_outputs["router_logits"]`, an `OutputRecorder` naming the router class, and
    the index of the logits in its output), the loss is the model module's own
    `load_balancing_loss_func`, with the model's `num_experts`, `num_experts_per_tok` and
    `router_aux_loss_coef`, as its forward calls it."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    name = type(model).__name__
    records = getattr(model, "_can_record_outputs", None) or {}
    entry = records.get("router_logits") if isinstance(records, dict) else None
    target = entry if isinstance(entry, type) else getattr(entry, "target_class", None)
    class_name = getattr(entry, "class_name", None)
    layer_name = getattr(entry, "layer_name", None)
    if target is None and class_name is None:
        raise ModelError(
            f"{name}: its config sets output_router_logits, but it records router logits from no "
            "module (_can_record_outputs['router_logits'])"
        )

    def is_router(qualified: str, module: nn.Module) -> bool:
        if target is not None and not isinstance(module, target):
            return False
        if class_name is not None and not type(module).__name__.endswith(class_name):
            return False
        return layer_name is None or layer_name in qualified

    modules = [[q for q, m in block.named_modules() if is_router(q, m)] for block in blocks]
    balance = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    experts = getattr(model, "num_experts", None)
    if experts is None:
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", getattr(config, "num_experts_per_tok", None))
    coefficient = getattr(model, "router_aux_loss_coef", None)
    if coefficient is None:
        coefficient = getattr(config, "router_aux_loss_coef", None)
    missing = [
        what
        for what, value in (
            ("a router module in its blocks", any(modules) or None),
            ("load_balancing_loss_func in its module", balance),
            ("num_experts", experts),
            ("num_experts_per_tok", top_k),
            ("router_aux_loss_coef", coefficient),
        )
        if value is None
    ]
    if missing or balance is None or experts is None or top_k is None or coefficient is None:
        raise ModelError(
            f"{name}: its config sets output_router_logits, but the split cannot compute its "
            f"router loss: no {', no '.join(missing)}"
        )
    index = getattr(entry, "index", 0)
    return Routing(
        modules=modules,
        index=0 if index is None else int(index),
        balance=balance,
        experts=int(experts),
        top_k=int(top_k),
        coefficient=float(coefficient),
    )
