"""Cutting a Hugging Face causal LM into the library's layers, and its loss: what
`chameleond.worker.hf` (the public module, docs/hf.md) gives."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from chameleond.worker import Layers, ModelError, Tie, split
from chameleond.worker._hf_layers import (
    ATTENTION,
    DecoderBlock,
    Embeddings,
    LMHead,
    refused_attention,
)
from chameleond.worker._hf_parts import find_parts, routing, sliding_window

IGNORE_INDEX = -100  # the label Hugging Face models skip in their loss


def split_causal_lm(model: PreTrainedModel | nn.Module) -> Layers:
    """`model`'s layers: embeddings, each decoder block, final norm + head (see the module doc).

    The layers take over the model's submodules; tied parameters are untied (a copy in the later
    layer, declared as a `Tie`), so use the layers, not `model`, from here on. Raises ModelError
    for a model whose parts it cannot find or does not know, an attention implementation whose
    mask it does not build, or a parameter no layer would hold."""
    name = type(model).__name__
    parts = find_parts(model)  # first: it refuses a model without a config
    config: Any = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ATTENTION:
        raise ModelError(f"{name}: {refused_attention(implementation)}")
    router = routing(model, parts.blocks)
    multiplier = getattr(config, "embedding_multiplier", None)
    embeddings = Embeddings(
        parts.tokens,
        (parts.tokens_name, parts.positions_name, parts.dropout_name),
        parts.positions,
        parts.dropout,
        None if multiplier is None else float(multiplier),
    )
    decoders = [
        DecoderBlock(
            block,
            config,
            copy.deepcopy(parts.rotary),
            sliding_window(name, config, i),
            router.modules[i] if router else None,
            router.index if router else 0,
        )
        for i, block in enumerate(parts.blocks)
    ]
    scaling = getattr(config, "logits_scaling", None)
    head = LMHead(
        parts.norm,
        parts.head,
        None if scaling is None else float(scaling),
        router.balance if router else None,
        (router.experts, router.top_k) if router else (0, 0),
        router.coefficient if router else 0.0,
    )
    modules: list[nn.Module] = [embeddings, *decoders, head]
    ties = untie(modules)
    # `split` refuses a cut that leaves a parameter of the model in no layer, naming it.
    layers = split(model, lambda _: modules, ties)
    # What a checkpoint records for `chameleonctl export --hf`: the class and its config.
    meta = {"hf_class": type(model).__name__, "hf_config": config.to_json_string()}
    return dataclasses.replace(layers, meta=meta)


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


def causal_lm_inputs(batch: Mapping[str, Any]) -> torch.Tensor | dict[str, torch.Tensor]:
    """Layer 0's input for `batch` (`Training.inputs`): its input ids alone when it has no
    attention mask (every layer then passes plain tensors), else {"input_ids",
    "attention_mask"} (the 2-D padding mask, nonzero at real tokens)."""
    mask = batch.get("attention_mask")
    if mask is None:
        ids: torch.Tensor = batch["input_ids"]
        return ids
    return {"input_ids": batch["input_ids"], "attention_mask": mask}


def causal_lm_loss(
    output: torch.Tensor | Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Per-sample next-token cross-entropy, [samples]: logits at position t predict label t + 1
    (labels unshifted, as Hugging Face models take them), averaged over each sample's tokens whose
    label is not -100 (pads included, where the collate marks them so). `output` is the logits,
    or a dict holding them under "logits". With every token labelled, the mean over samples is
    `model(...).loss`."""
    logits = output if isinstance(output, torch.Tensor) else output["logits"]
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
