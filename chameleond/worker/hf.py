"""Hugging Face causal LMs as the library's `Layers` (`chameleond.worker.hf`, docs/hf.md).

`split_causal_lm(model)` cuts a `transformers` causal LM into the layers a pipeline stage holds:

    layer 0            the embeddings (token, plus learned positions and dropout where the base
                       model has them)
    layers 1..n        one per decoder block
    layer n + 1        the final norm and the LM head

The parts are found from the model's structure (`_hf_parts`), not from a list of families: the
token embeddings (`get_input_embeddings()`), the head (`get_output_embeddings()`), and among the
base model's direct parts the decoder blocks (its one `nn.ModuleList`), a rotary module
(`rotary_emb`), learned position embeddings and an embedding dropout before the blocks, the final
norm after them. A part it does not know, or one it cannot find, is a ModelError naming the model
class and the part. The layers (`_hf_layers`) pass the library's activations: a plain tensor for
batches without a padding mask, dicts with the padding mask and an MoE model's router logits
otherwise (`causal_lm_inputs` gives layer 0's).

The layers hold the model's own submodules (no copy), except for tied parameters: GPT-2 uses one
matrix as token embedding and LM head; that parameter gets a copy in the head layer, declared as a
`Tie`, and the library keeps the two copies equal (their gradients are summed before the update).
Every parameter of the model ends up in exactly one layer, or in both layers of a declared tie;
`split_causal_lm` checks this and names any parameter it would drop. Splitting reads no tensor
values: a model built on the `meta` device splits as one with weights does.

`pretrained_causal_lm(path)` gives the layers of a `save_pretrained` directory on the `meta` device,
each worker reading only the tensors of the layers it holds; `causal_lm_from_config(config, seed)`
the layers of a randomly initialised model, each initialised where it is held
(`_hf_pretrained`).

`causal_lm_loss(output, batch)` is the per-sample loss the library sums over the global batch: the
shifted next-token cross-entropy, averaged over each sample's labelled tokens.

Needs the `hf` extra (`pip install 'chameleond[hf]'`).
"""

from chameleond.worker._hf_layers import ATTENTION, causal_mask
from chameleond.worker._hf_pretrained import causal_lm_from_config, pretrained_causal_lm
from chameleond.worker._hf_split import (
    IGNORE_INDEX,
    causal_lm_inputs,
    causal_lm_loss,
    split_causal_lm,
    untie,
)

__all__ = [
    "ATTENTION",
    "IGNORE_INDEX",
    "causal_lm_from_config",
    "causal_lm_inputs",
    "causal_lm_loss",
    "causal_mask",
    "pretrained_causal_lm",
    "split_causal_lm",
    "untie",
]
