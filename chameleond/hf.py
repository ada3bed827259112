"""Hugging Face causal LMs for the worker library (docs/hf.md): `split_causal_lm(model)` cuts a
`transformers` causal LM into `Layers` (embeddings, each decoder block, final norm + head; tied
embeddings as a `Tie`), `causal_lm_loss` is its per-sample loss.

Needs the `hf` extra (`pip install 'chameleond[hf]'`); nothing in the daemon imports this module.
"""

from __future__ import annotations

from chameleond.worker.hf import FAMILIES, causal_lm_loss, split_causal_lm

__all__ = ["FAMILIES", "causal_lm_loss", "split_causal_lm"]
