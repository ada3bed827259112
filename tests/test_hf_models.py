"""chameleond.worker.hf on families beyond GPT-2/Llama/Mistral/Qwen2, found from their structure:
Qwen3, Phi3, OLMo2, Gemma, Granite (embedding and logit scales), and the Mixture-of-Experts
Mixtral and Qwen2-MoE with their router loss. Every model is tiny, random and built from a config
(no download); the layers, chained, must compute what the model computes: logits, per-sample
loss, gradients, the router loss and its gradients, on full and right-padded batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from chameleond.worker import ModelError  # noqa: E402
from chameleond.worker.hf import causal_lm_inputs, causal_lm_loss, split_causal_lm  # noqa: E402

VOCAB = 97
SEQ = 12
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip
MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
FAMILIES: dict[str, dict[str, Any]] = {
    "Qwen3Config": dict(head_dim=8),
    "Phi3Config": {},
    "Olmo2Config": {},
    "GemmaConfig": dict(head_dim=8),
    "GraniteConfig": dict(
        embedding_multiplier=3.0, logits_scaling=2.0, residual_multiplier=0.5,
        attention_multiplier=0.3,
    ),
    "MixtralConfig": dict(num_local_experts=4, **MOE),
    "Qwen2MoeConfig": dict(
        num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, **MOE
    ),
}  # fmt: skip


# Tiny matrices: one torch thread is fastest, and fair to a shared machine (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


def build(config_class: str, attention: str = "sdpa", **extra: Any) -> Any:
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**COMMON, **FAMILIES[config_class] | extra)
    cfg._attn_implementation = attention
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def chain(layers: list[torch.nn.Module], x: Any) -> Any:
    """Each layer on the previous one's output, as a pipeline runs them."""
    for m in layers:
        x = m(x)
    return x


def batch(padded: bool) -> dict[str, torch.Tensor]:
    """3 samples of SEQ tokens; padded: right-padded to lengths 12, 8, 5, labels -100 at pads."""
    ids = torch.randint(1, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    if not padded:
        return {"input_ids": ids, "labels": ids.clone()}
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def logits_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output["logits"]


def is_moe(model: Any) -> bool:
    return bool(getattr(model.config, "output_router_logits", False))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_layers_compute_the_models_logits_and_per_sample_loss(
    family: str, padded: bool, attention: str
) -> None:
    model = build(family, attention)
    b = batch(padded)
    mask = b.get("attention_mask")
    with torch.no_grad():
        expected = model(b["input_ids"], attention_mask=mask)
        layers = list(split_causal_lm(model).modules)
        out = chain(layers, causal_lm_inputs(b))
    assert isinstance(out, dict) == is_moe(model)
    # Every position: the real tokens, and the pads, whose queries see only the real keys.
    torch.testing.assert_close(logits_of(out), expected.logits, atol=1e-5, rtol=0)
    # The per-sample loss is the model's own loss on that sample alone (its CE part for an MoE).
    per_sample = causal_lm_loss(out, b)
    for i in range(3):
        with torch.no_grad():
            alone = model(
                b["input_ids"][i : i + 1],
                attention_mask=None if mask is None else mask[i : i + 1],
                labels=b["labels"][i : i + 1],
                **({"output_router_logits": False} if is_moe(model) else {}),
            )
        torch.testing.assert_close(per_sample[i], alone.loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("family", ["Qwen3Config", "GraniteConfig", "MixtralConfig"])
def test_layer_gradients_are_the_models(family: str, padded: bool) -> None:
    """The objective the library builds (mean per-sample loss, plus the router loss, which the
    runtime adds once per sample and divides by the batch) has the model's gradients."""
    b = batch(padded)
    mask = b.get("attention_mask")
    reference = build(family)
    out = reference(b["input_ids"], attention_mask=mask)
    objective = causal_lm_loss(out.logits, b).mean()
    if is_moe(reference):
        objective = objective + reference.config.router_aux_loss_coef * out.aux_loss
    objective.backward()
    model = build(family)
    layers = split_causal_lm(model)
    got = chain(list(layers.modules), causal_lm_inputs(b))
    mine = causal_lm_loss(got, b).mean() + (got["aux_loss"] if is_moe(model) else 0)
    mine.backward()
    assert not layers.ties
    for name, p in reference.named_parameters():
        g = model.get_parameter(name).grad
        assert p.grad is not None and g is not None, name
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("family", ["MixtralConfig", "Qwen2MoeConfig"])
def test_router_loss_and_its_router_gradients_are_the_models(family: str, padded: bool) -> None:
    b = batch(padded)
    mask = b.get("attention_mask")
    reference = build(family)
    out = reference(b["input_ids"], attention_mask=mask, output_router_logits=True)
    coef = reference.config.router_aux_loss_coef
    (coef * out.aux_loss).backward()
    model = build(family)
    layers = list(split_causal_lm(model).modules)
    after_block = chain(layers[:2], causal_lm_inputs(b))
    assert after_block["router_logits"].shape == (3 * SEQ, 4)  # one MoE block so far
    got = chain(layers[2:], after_block)
    assert set(got) == {"logits", "aux_loss"} and got["aux_loss"].shape == ()
    torch.testing.assert_close(got["aux_loss"], coef * out.aux_loss, atol=1e-6, rtol=0)
    got["aux_loss"].backward()
    routers = [n for n, _ in reference.named_parameters() if ".gate.weight" in n]
    assert len(routers) == 2
    for name in routers:
        g = model.get_parameter(name).grad
        assert g is not None and g.abs().max() > 0, name
        torch.testing.assert_close(g, reference.get_parameter(name).grad, atol=1e-7, rtol=1e-5)


def test_without_output_router_logits_an_moe_model_passes_plain_tensors() -> None:
    model = build("MixtralConfig", output_router_logits=False)
    x = batch(False)["input_ids"]
    layers = list(split_causal_lm(model).modules)
    with torch.no_grad():
        for i in range(len(layers)):
            x = layers[i](x)
            assert isinstance(x, torch.Tensor), i
        torch.testing.assert_close(x, model(batch(False)["input_ids"]).logits, atol=1e-5, rtol=0)


def test_a_model_built_on_the_meta_device_splits() -> None:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**COMMON, **FAMILIES["MixtralConfig"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    layers = split_causal_lm(model)
    assert len(layers.modules) == 4
    assert all(p.is_meta for m in layers.modules for p in m.parameters())


class Blockless(transformers.PreTrainedModel):
    """A PreTrainedModel with an embedding and a head but no decoder blocks."""

    config_class = transformers.PretrainedConfig
    base_model_prefix = "body"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.body = torch.nn.Module()
        self.body.embed = torch.nn.Embedding(VOCAB, 8)
        self.body.get_input_embeddings = lambda: self.body.embed  # type: ignore[method-assign]
        self.head = torch.nn.Linear(8, VOCAB)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_a_model_without_decoder_blocks_is_refused_naming_it() -> None:
    model = Blockless(transformers.PretrainedConfig())
    with pytest.raises(ModelError, match=r"^Blockless: cannot find its decoder blocks"):
        split_causal_lm(model)


def test_a_non_causal_model_is_refused_naming_it() -> None:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64,
    )  # fmt: skip
    with pytest.raises(ModelError, match=r"^BertForMaskedLM: part 'cls'"):
        split_causal_lm(transformers.BertForMaskedLM(cfg))
    t5 = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_ff=32, num_layers=1, num_heads=2)
    with pytest.raises(ModelError, match=r"^T5ForConditionalGeneration: not a decoder-only"):
        split_causal_lm(transformers.T5ForConditionalGeneration(t5))


def test_soft_capped_logits_are_refused_naming_the_setting() -> None:
    cfg = transformers.Gemma2Config(**COMMON, head_dim=8)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelError, match=r"^Gemma2ForCausalLM: .*final_logit_softcapping"):
        split_causal_lm(model)
