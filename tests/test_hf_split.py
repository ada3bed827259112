"""chameleond.worker.hf: a Hugging Face causal LM cut into layers computes what the model
computes, on full and on right-padded batches (tests/test_hf_models.py: more families, MoE)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from chameleond.worker import ModelError  # noqa: E402
from chameleond.worker.hf import (  # noqa: E402
    causal_lm_inputs,
    causal_lm_loss,
    split_causal_lm,
)

VOCAB = 97
SEQ = 16


# Tiny matrices: one torch thread is fastest, and fair to a shared machine (conftest).
pytestmark = pytest.mark.usefixtures("one_thread")


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def rotary(config_class: str):
    """A Llama-shaped model of another family (Mistral, Qwen2)."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = getattr(transformers, config_class)(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()

    build.__name__ = config_class
    return build


def ids(batch: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def run(layers: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for m in layers:
        x = m(x)
    return x


@pytest.mark.parametrize("build", [gpt2, llama, rotary("MistralConfig"), rotary("Qwen2Config")])
def test_layers_compute_the_models_logits(build) -> None:
    model = build()
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
        layers = split_causal_lm(model)
        got = run(list(layers.modules), x)
    assert len(layers.modules) == model.config.num_hidden_layers + 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_kept_mask_serves_the_next_batch_of_its_shape_only(attention: str) -> None:
    """Each block builds its causal mask once per input shape (a real mask tensor under eager
    attention) and keeps it: later batches, and a batch of another shape, still compute the
    model's own logits."""
    model = llama()
    model.config._attn_implementation = attention
    layers = list(split_causal_lm(model).modules)
    with torch.no_grad():
        for batch, seq in ((3, SEQ), (3, SEQ), (2, SEQ // 2), (3, SEQ)):
            x = ids(batch)[:, :seq]
            torch.testing.assert_close(run(layers, x), model(x).logits, atol=1e-5, rtol=0)
    block = layers[1]
    assert block._shape_key == ((3, SEQ), torch.float32, torch.device("cpu"), attention)
    if attention == "eager":
        assert isinstance(block._kept[1], torch.Tensor)


def windowed(config_class: str, **window):
    """A Mistral or Qwen2 model whose attention window (4) is shorter than its sequences (16)."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = getattr(transformers, config_class)(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0, sliding_window=4, **window,
        )  # fmt: skip
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()

    build.__name__ = config_class
    return build


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "build",
    [
        windowed("MistralConfig"),  # every block's attention is windowed
        windowed("Qwen2Config", use_sliding_window=True, max_window_layers=1),  # block 1 only
    ],
)
def test_sliding_window_blocks_see_only_their_window(build, attention: str) -> None:
    """A block whose model gives it a sliding-window mask gets the same one from its layer: the
    logits are the model's, and differ from a full causal attention's."""
    model = build()
    model.config._attn_implementation = attention
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
        layers = list(split_causal_lm(model).modules)
        got = run(layers, x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    windows = [layer.window for layer in layers[1:-1]]
    assert windows == ([4, 4] if model.config.model_type == "mistral" else [None, 4])
    for layer in layers[1:-1]:
        layer.window, layer._kept = None, None  # full causal attention
    with torch.no_grad():
        assert (run(layers, x) - expected).abs().max() > 1e-3


def test_an_attention_implementation_without_a_built_mask_is_refused() -> None:
    model = llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ModelError, match="LlamaForCausalLM: attention implementation 'flex_at"):
        split_causal_lm(model)


@pytest.mark.parametrize("build", [gpt2, llama])
def test_every_parameter_is_in_one_layer_or_a_declared_tie(build) -> None:
    model = build()
    before = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    distinct_before = len(list(model.parameters()))
    layers = split_causal_lm(model)
    owners: dict[int, int] = {}
    for i, m in enumerate(layers.modules):
        for p in m.parameters():
            assert owners.setdefault(id(p), i) == i, "a parameter object is in two layers"
    # The layers hold the model's parameters and nothing else; each tie added one copy.
    assert set(owners) == {id(p) for p in model.parameters()}
    assert len(owners) == distinct_before + len(layers.ties)
    for pname, p in model.named_parameters(remove_duplicate=False):
        torch.testing.assert_close(p.detach(), before[pname], atol=0, rtol=0)


def test_gpt2_tied_embedding_becomes_two_equal_copies_declared_as_a_tie() -> None:
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    layers = split_causal_lm(model)
    last = len(layers.modules) - 1
    [tie] = layers.ties
    assert tie.first == (0, "wte.weight")
    assert tie.second == (last, "lm_head.weight")
    a = layers.modules[0].get_parameter("wte.weight")
    b = layers.modules[last].get_parameter("lm_head.weight")
    assert a is not b
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_untied_llama_has_no_tie() -> None:
    assert not split_causal_lm(llama()).ties


@pytest.mark.parametrize("build", [gpt2, llama])
def test_layer_gradients_are_the_models_with_tie_copies_summed(build) -> None:
    x = ids()
    reference = build()
    reference(x, labels=x).loss.backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    model = build()
    layers = split_causal_lm(model)
    causal_lm_loss(run(list(layers.modules), x), {"labels": x}).mean().backward()
    for t in layers.ties:
        g = layers.modules[t.second[0]].get_parameter(t.second[1]).grad
        layers.modules[t.first[0]].get_parameter(t.first[1]).grad += g
    for n, g in expected.items():  # a tie's copy is not among the reference's parameters
        torch.testing.assert_close(model.get_parameter(n).grad, g, atol=1e-5, rtol=1e-4, msg=n)


def test_per_sample_loss_averages_to_the_models_loss() -> None:
    model = gpt2()
    x = ids(4)
    with torch.no_grad():
        out = model(x, labels=x)
        per_sample = causal_lm_loss(out.logits, {"input_ids": x, "labels": x})
    assert per_sample.shape == (4,)
    torch.testing.assert_close(per_sample.mean(), out.loss, atol=1e-6, rtol=0)
    # Each sample's loss is its own: changing sample 3 leaves samples 0-2 alone.
    y = x.clone()
    y[3] = (y[3] + 1) % VOCAB
    with torch.no_grad():
        other = causal_lm_loss(model(y).logits, {"labels": y})
    torch.testing.assert_close(other[:3], per_sample[:3], atol=1e-6, rtol=0)


def test_ignored_labels_do_not_count() -> None:
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    masked = labels.clone()
    masked[1, 3:] = -100
    full = causal_lm_loss(logits, {"labels": labels})
    part = causal_lm_loss(logits, {"labels": masked})
    assert part[0] == full[0]
    expected = torch.nn.functional.cross_entropy(logits[1, :2], labels[1, 1:3])
    torch.testing.assert_close(part[1], expected)


def test_a_model_with_parts_it_does_not_know_is_refused_naming_the_class_and_part() -> None:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, is_decoder=True,
    )  # fmt: skip
    model = transformers.BertLMHeadModel(cfg)
    with pytest.raises(ModelError, match=r"^BertLMHeadModel: part 'cls' \(BertOnlyMLMHead\)"):
        split_causal_lm(model)


def test_an_unknown_part_of_the_base_model_is_refused_naming_it() -> None:
    model = llama()
    model.model.extra = torch.nn.Linear(4, 4)
    with pytest.raises(ModelError, match=r"LlamaForCausalLM: .* LlamaModel .* 'extra' \(Linear\)"):
        split_causal_lm(model)


def padded(batch: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (pad 0) and their padding mask: lengths SEQ, SEQ - 5, 4, ..."""
    x = ids(batch)
    mask = torch.ones_like(x)
    for i in range(1, batch):
        mask[i, (SEQ - 5 if i == 1 else 4) :] = 0
    return x.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "build",
    [
        gpt2,
        llama,
        rotary("MistralConfig"),
        rotary("Qwen2Config"),
        windowed("MistralConfig"),
        windowed("Qwen2Config", use_sliding_window=True, max_window_layers=1),
    ],
)
def test_right_padded_batches_get_the_models_logits_at_real_tokens(build, attention: str) -> None:
    model = build()
    model.config._attn_implementation = attention
    layers = list(split_causal_lm(model).modules)
    x, mask = padded()
    labels = x.masked_fill(mask == 0, -100)
    batch = {"input_ids": x, "attention_mask": mask, "labels": labels}
    inputs = causal_lm_inputs(batch)
    assert set(inputs) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        expected = model(x, attention_mask=mask).logits
        hidden = layers[0](inputs)
        assert set(hidden) == {"hidden_states", "attention_mask"}
        got = run(layers[1:], hidden)
        unpadded = run(layers, x)
    assert isinstance(got, torch.Tensor)
    # At the real tokens (which never see the pads after them) and at the pads too, whose
    # queries see only the real keys: without the padding mask they see pads, other logits.
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    pads = mask == 0
    torch.testing.assert_close(unpadded[~pads], expected[~pads], atol=1e-5, rtol=0)
    assert (unpadded[pads] - expected[pads]).abs().max() > 1e-3
    per_sample = causal_lm_loss(got, batch)
    for i in range(len(x)):
        with torch.no_grad():
            alone = model(x[i : i + 1], attention_mask=mask[i : i + 1], labels=labels[i : i + 1])
        torch.testing.assert_close(per_sample[i], alone.loss, atol=1e-5, rtol=0)


def test_a_padded_batch_builds_its_mask_each_time() -> None:
    """Two padded batches of one shape but other pads each get their own mask; an unpadded
    batch (every mask entry 1) gets the model's unpadded logits."""
    model = llama()
    model.config._attn_implementation = "eager"
    layers = list(split_causal_lm(model).modules)
    x, mask = padded()
    for m in (mask, mask.flip(0), torch.ones_like(mask)):
        with torch.no_grad():
            got = run(layers, {"input_ids": x, "attention_mask": m})
            expected = model(x, attention_mask=m).logits
        torch.testing.assert_close(got[m.bool()], expected[m.bool()], atol=1e-5, rtol=0)


def test_layer_gradients_on_a_padded_batch_are_the_models() -> None:
    x, mask = padded()
    batch = {"input_ids": x, "attention_mask": mask, "labels": x.masked_fill(mask == 0, -100)}
    reference = gpt2()
    causal_lm_loss(reference(x, attention_mask=mask).logits, batch).mean().backward()
    model = gpt2()
    layers = split_causal_lm(model)
    causal_lm_loss(run(list(layers.modules), causal_lm_inputs(batch)), batch).mean().backward()
    [t] = layers.ties
    g = layers.modules[t.second[0]].get_parameter(t.second[1]).grad
    layers.modules[t.first[0]].get_parameter(t.first[1]).grad += g
    for n, p in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(n).grad, p.grad, atol=1e-5, rtol=1e-4)


def test_inputs_without_an_attention_mask_are_the_input_ids() -> None:
    x = ids()
    assert causal_lm_inputs({"input_ids": x, "labels": x}) is x
    assert causal_lm_inputs({"input_ids": x, "attention_mask": None}) is x
    assert causal_lm_loss({"logits": torch.zeros(3, SEQ, VOCAB)}, {"labels": x}).shape == (3,)


def test_a_parameter_used_twice_by_a_later_layer_gets_one_copy_and_one_tie() -> None:
    from chameleond.worker.hf import untie

    first = torch.nn.Embedding(5, 3)
    later = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 5, bias=False)})
    later["b"] = torch.nn.Linear(3, 5, bias=False)
    later["a"].weight = first.weight
    later["b"].weight = first.weight
    ties = untie([first, later])
    assert len(ties) == 1 and ties[0].first == (0, "weight")
    assert later["a"].weight is later["b"].weight
    assert later["a"].weight is not first.weight
    torch.testing.assert_close(later["a"].weight, first.weight, atol=0, rtol=0)
