"""The layer modules of a split Hugging Face causal LM (`chameleond.worker.hf`, docs/hf.md).

Activations between the layers follow the library's convention: a plain tensor where the batch
has no padding mask and the model no router loss (the hidden states), else a dict. With a padding
mask, the embeddings layer takes {"input_ids", "attention_mask"} and every later boundary carries
{"hidden_states", "attention_mask"}; a Mixture-of-Experts model whose config asks for the router
loss (`output_router_logits`) adds "router_logits", every MoE block's router logits concatenated
along dim 0 in block order, from which the head computes the model's load-balancing loss and
returns it as "aux_loss" beside the logits.

Each decoder block's wrapper builds what its block gets from the model besides the hidden states:
the position ids of a training forward (0..seq-1, padding or not), the 4-D attention mask of its
attention implementation (causal or sliding-window, and the padding mask), and for rotary models
the position embeddings, from the layer's own copy of the model's rotary module (buffers only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from chameleond.worker.api import ModelError

# The attention implementations (config._attn_implementation) whose mask the split builds, as
# the model gives them for sequences without cache. Flex attention's BlockMask, and the masks of
# hub kernels, are not built here: such a model is refused.
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
HIDDEN, MASK, ROUTER = "hidden_states", "attention_mask", "router_logits"
Activation = torch.Tensor | dict[str, torch.Tensor]


def refused_attention(implementation: object) -> str:
    return (
        f"attention implementation {implementation!r} is not one the split builds masks for "
        f"({', '.join(ATTENTION)}): load the model with attn_implementation='sdpa'"
    )


def unpack(x: Activation) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The hidden states and what travels beside them (the padding mask, router logits)."""
    if isinstance(x, torch.Tensor):
        return x, {}
    rest = {k: v for k, v in x.items() if k != HIDDEN}
    return x[HIDDEN], rest


def pack(hidden: torch.Tensor, rest: dict[str, torch.Tensor]) -> Activation:
    return {HIDDEN: hidden, **rest} if rest else hidden


class Embeddings(nn.Module):
    """The base model's first part: token embeddings, times the config's `embedding_multiplier`
    where it has one (Granite), plus learned position embeddings where the base has them
    (GPT-2's wpe, at positions 0..seq-1), then its embedding dropout if any.

    Takes the input ids, or {"input_ids", "attention_mask"}; returns the hidden states, or
    {"hidden_states", "attention_mask"} (the padding mask passed on as it came)."""

    def __init__(
        self,
        tokens: nn.Module,
        names: tuple[str, str | None, str | None],
        positions: nn.Module | None = None,
        dropout: nn.Module | None = None,
        multiplier: float | None = None,
    ) -> None:
        super().__init__()
        # Registered under the base model's own attribute names (wte, wpe, drop / embed_tokens),
        # so the layer's parameter names are the model's less the base prefix.
        self._names = names
        self.add_module(names[0], tokens)
        if positions is not None and names[1] is not None:
            self.add_module(names[1], positions)
        if dropout is not None and names[2] is not None:
            self.add_module(names[2], dropout)
        self.multiplier = multiplier

    def forward(self, x: Activation) -> Activation:
        if isinstance(x, torch.Tensor):
            input_ids, rest = x, {}
        else:
            input_ids, rest = x["input_ids"], {MASK: x[MASK]}
        tokens, positions, dropout = self._names
        hidden: torch.Tensor = getattr(self, tokens)(input_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if positions is not None and hasattr(self, positions):
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            hidden = hidden + getattr(self, positions)(position_ids)
        if dropout is not None and hasattr(self, dropout):
            hidden = getattr(self, dropout)(hidden)
        return pack(hidden, rest)


class DecoderBlock(nn.Module):
    """One decoder block, activation -> activation (see the module doc).

    Without a padding mask, the mask and the position ids depend only on the input's shape, dtype
    and device and the attention implementation: they are built once and kept for the next
    micro-batch of the same shape (the model builds them at each forward, once for all blocks).
    With one, the position ids are kept the same way and the mask is built at each call.

    `routers` names the block's router modules (within `block`) whose output `router_index` is
    their router logits (an MoE block's gate); when set, the block appends the logits it captures
    from them (a forward hook for the call) to the activation's "router_logits"."""

    def __init__(
        self,
        block: nn.Module,
        config: Any,
        rotary: nn.Module | None,
        window: int | None,
        routers: list[str] | None = None,
        router_index: int = 0,
    ) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary
        self.config = config
        self.window = window  # the block's sliding window, None for full causal attention
        self._routers = routers or []
        self._router_index = router_index
        self._shape_key: tuple[Any, ...] | None = None
        self._kept: tuple[torch.Tensor, torch.Tensor | None] | None = None  # position ids, mask

    def _positions_and_mask(
        self, hidden: torch.Tensor, padding: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        implementation = self.config._attn_implementation
        key = (tuple(hidden.shape[:2]), hidden.dtype, hidden.device, implementation)
        if self._kept is None or key != self._shape_key:
            batch, seq = hidden.shape[:2]
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
            mask = causal_mask(implementation, batch, seq, self.window, hidden.dtype, hidden.device)
            self._shape_key, self._kept = key, (position_ids, mask)
        position_ids, mask = self._kept
        if padding is not None:
            mask = padded_mask(implementation, padding, self.window, hidden.dtype, mask)
        return position_ids, mask

    def forward(self, x: Activation) -> Activation:
        hidden, rest = unpack(x)
        position_ids, mask = self._positions_and_mask(hidden, rest.get(MASK))
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": position_ids}
        if self.rotary is not None:
            kwargs["position_embeddings"] = self.rotary(hidden, position_ids=position_ids)
        captured: list[torch.Tensor] = []
        hooks = [
            self.block.get_submodule(r).register_forward_hook(self._capture(captured))
            for r in self._routers
        ]
        try:
            out = self.block(hidden, use_cache=False, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        # transformers 5 blocks return the hidden states; older ones a tuple led by them.
        hidden = out[0] if isinstance(out, tuple) else out
        if captured:
            earlier = [rest[ROUTER]] if ROUTER in rest else []
            rest[ROUTER] = torch.cat([*earlier, *captured], dim=0)
        return pack(hidden, rest)

    def _capture(self, into: list[torch.Tensor]) -> Callable[..., None]:
        index = self._router_index

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            into.append(output[index] if isinstance(output, tuple | list) else output)

        return hook


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
    signature changed four times within transformers 5 (docs/hf.md): what the model gives each
    implementation has not. sdpa and flash attention get no mask when it would be plain causal
    (the kernel's own `is_causal`; flash attention also applies the window itself); sdpa
    otherwise a boolean mask [batch, 1, seq, seq], True where a key is seen; eager always an
    additive one of `dtype`, 0 where a key is seen and dtype's minimum elsewhere."""
    if implementation not in ATTENTION:
        raise ModelError(refused_attention(implementation))
    if window is not None and window > seq:
        window = None  # longer than the sequence: plain causal (transformers' rule for sdpa)
    if implementation.startswith("flash_attention") or (
        implementation == "sdpa" and window is None
    ):
        return None
    seen = _seen(seq, window, device).expand(batch, 1, seq, seq)
    return seen if implementation == "sdpa" else _additive(seen, dtype)


def padded_mask(
    implementation: str,
    padding: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
    unpadded: torch.Tensor | None,
) -> torch.Tensor | None:
    """The mask the model gives a block for a batch with the 2-D padding mask `padding` ([batch,
    seq], nonzero at the real tokens): the causal (or windowed) rule and, besides, keys at pads
    unseen. As transformers does, sdpa and flash attention get the unpadded mask when no token
    is padded (a read of the mask's values, at each call); flash attention otherwise the 2-D
    padding mask (boolean), from which the kernel takes the sequence lengths."""
    seen_keys = padding.to(torch.bool)
    if implementation != "eager" and bool(seen_keys.all()):
        return unpadded
    if implementation.startswith("flash_attention"):
        return seen_keys
    seq = seen_keys.shape[1]
    if window is not None and window > seq:
        window = None
    seen = _seen(seq, window, seen_keys.device).unsqueeze(0) & seen_keys[:, None, None, :]
    return seen if implementation == "sdpa" else _additive(seen, dtype)


def _seen(seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[1, seq, seq]: True where query q sees key k under the causal (and window) rule."""
    query = torch.arange(seq, device=device).unsqueeze(1)
    key = torch.arange(seq, device=device).unsqueeze(0)
    seen = key <= query
    if window is not None:
        seen &= key > query - window
    return seen.unsqueeze(0)


def _additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), device=seen.device, dtype=dtype)
    return torch.where(seen, zero, torch.finfo(dtype).min)


class LMHead(nn.Module):
    """Final norm, then the LM head (divided by the config's `logits_scaling` where it has one:
    Granite): hidden states -> logits.

    With router logits in its input (an MoE model asking for its router loss) it returns
    {"logits", "aux_loss"}: `aux_loss` is `coefficient * balance(per-block router logits, ...)`,
    the model's own load-balancing function on the same router logits and padding mask."""

    def __init__(
        self,
        norm: nn.Module,
        lm_head: nn.Module,
        scaling: float | None = None,
        balance: Callable[..., Any] | None = None,
        experts: tuple[int, int] = (0, 0),
        coefficient: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.scaling = scaling
        self._balance = balance
        self._experts = experts  # (number of experts, experts per token)
        self.coefficient = coefficient

    def forward(self, x: Activation) -> Activation:
        hidden, rest = unpack(x)
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        if self.scaling is not None:
            logits = logits / self.scaling
        if ROUTER not in rest or self._balance is None:
            return logits
        # One [batch * seq, experts] tensor per MoE block, as the model collects them.
        routers = tuple(rest[ROUTER].split(hidden.shape[0] * hidden.shape[1], dim=0))
        experts, top_k = self._experts
        aux = self._balance(routers, experts, top_k, rest.get(MASK))
        return {"logits": logits, "aux_loss": self.coefficient * aux}
