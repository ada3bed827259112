"""Layers on the meta device: a worker materialises only the layers it builds, from a pretrained
directory (reading only those layers' tensors) or an init function, and holds no more memory than
those layers need."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from chameleond.protocol import Keys  # noqa: E402
from chameleond.worker._hf_pretrained import (  # noqa: E402
    causal_lm_from_config,
    pretrained_causal_lm,
)
from chameleond.worker._startup import agree_on_weights  # noqa: E402
from chameleond.worker._trainable import Trainable  # noqa: E402
from chameleond.worker.api import Layers, ModelError, Tie, Training, split  # noqa: E402
from chameleond.worker.hf import causal_lm_loss, split_causal_lm  # noqa: E402

VOCAB = 97
SEQ = 16
ROOT = Path(__file__).resolve().parent.parent


def llama_config(**overrides: int) -> object:
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaConfig(**{**fields, **overrides})


def gpt2_config() -> object:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip


def saved(directory: Path, model: nn.Module, shard: str = "50GB") -> Path:
    model.save_pretrained(directory, max_shard_size=shard)
    return directory


def training(model: Layers) -> Training:
    data = [{"input_ids": torch.zeros(SEQ, dtype=torch.long)} for _ in range(2)]
    return Training(
        model=model,
        loss=causal_lm_loss,
        dataset=data,
        optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
        global_batch=2,
        micro_batch=1,
        prefetch=0,
    )


def trainable(model: Layers) -> Trainable:
    t = Trainable(training(model))
    t.close()
    return t


def chained(t: Trainable, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        for i in range(t.n_layers):
            x = t.build(i).eval()(x)
    return x


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


# (a) pretrained directories --------------------------------------------------------------------


def test_each_layer_is_the_saved_models_and_chained_they_give_its_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    layers = pretrained_causal_lm(saved(tmp_path / "llama", model))
    assert all(p.is_meta for m in layers.modules for p in m.parameters())
    t = trainable(layers)
    state = model.state_dict()
    for i in range(t.n_layers):
        module = t.build(i)
        for local, p in module.named_parameters():
            torch.testing.assert_close(
                p.detach(), state[t.param_names(i, module)[local]], atol=0, rtol=0
            )
    rotary = t.build(1).rotary
    torch.testing.assert_close(rotary.inv_freq, model.model.rotary_emb.inv_freq, atol=0, rtol=0)
    with torch.no_grad():
        expected = model(ids()).logits
    torch.testing.assert_close(chained(t, ids()), expected, atol=0, rtol=0)
    assert t.meta["hf_class"] == "LlamaForCausalLM"
    assert json.loads(t.meta["hf_config"])["num_hidden_layers"] == 3


def test_a_layer_reads_only_its_own_shards(tmp_path: Path) -> None:
    """Each block is saved in shards of its own; once the Trainable exists, every shard holding no
    tensor of layer i is deleted: layer i still builds, and a layer whose shard is gone cannot."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    source = saved(tmp_path / "source", model, shard="20KB")
    weight_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    state = model.state_dict()
    n = len(pretrained_causal_lm(source).modules)
    for i in range(n):
        directory = Path(shutil.copytree(source, tmp_path / f"layer{i}"))
        layers = pretrained_causal_lm(directory)
        t = trainable(layers)
        own = {weight_map[name] for name in layers.names[i].values()}
        others = set(weight_map.values()) - own
        assert others, "every shard holds a tensor of this layer: the test would show nothing"
        for f in others:
            (directory / f).unlink()
        module = t.build(i)
        for local, p in module.named_parameters():
            torch.testing.assert_close(
                p.detach(), state[t.param_names(i, module)[local]], atol=0, rtol=0
            )
        other = (i + 1) % n
        with pytest.raises(ModelError, match=f"layer {other}: cannot read"):
            t.build(other)


def test_a_tied_head_reads_its_ties_source(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config()).eval()
    directory = saved(tmp_path / "gpt2", model)
    layers = pretrained_causal_lm(directory)
    t = trainable(layers)  # the tie check: both copies start equal
    head = t.build(t.n_layers - 1)
    torch.testing.assert_close(
        head.get_parameter("lm_head.weight").detach(), model.transformer.wte.weight, atol=0, rtol=0
    )
    with torch.no_grad():
        expected = model(ids()).logits
    torch.testing.assert_close(chained(t, ids()), expected, atol=0, rtol=0)


# (b) memory -----------------------------------------------------------------------------------

CHILD = r"""
import json, resource, sys
import torch, transformers
from chameleond.worker._hf_pretrained import pretrained_causal_lm
from chameleond.worker._trainable import Trainable
from chameleond.worker.api import Training
from chameleond.worker.hf import causal_lm_loss

torch.set_num_threads(1)
transformers.LlamaForCausalLM  # its module is imported before the limit


def data_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024


directory, budget = sys.argv[1], int(sys.argv[2])
limit = data_bytes() + budget
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
data = [{"input_ids": torch.zeros(8, dtype=torch.long)}] * 2
t = Trainable(Training(
    model=pretrained_causal_lm(directory), loss=causal_lm_loss, dataset=data,
    optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.1),
    global_batch=2, micro_batch=1, prefetch=0,
))
built, held = 0, None
for i in range(t.n_layers):
    module = t.build(i)  # the previous layer is still held meanwhile: two at most
    held = module
    built += 1
del held, module
try:
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    whole = "built"
except (RuntimeError, MemoryError) as e:
    whole = str(e)
print(json.dumps({"layers": t.n_layers, "built": built, "whole": whole}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_a_worker_builds_every_layer_within_a_limit_the_whole_model_exceeds(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = llama_config(
        vocab_size=256, hidden_size=384, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=6, num_key_value_heads=6,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    directory = saved(tmp_path / "llama", model, shard="8MB")
    del model
    budget = whole // 2  # the process's data beyond its imports: half the model's parameters
    assert 3 * block < budget
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), str(budget)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["built"] == out["layers"] == 18
    assert "can't allocate memory" in out["whole"], out["whole"]


# (c) the weights' digest ---------------------------------------------------------------------


def test_directories_differing_in_one_tensor_have_different_digests(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    a = pretrained_causal_lm(saved(tmp_path / "a", model)).weights_digest
    again = pretrained_causal_lm(saved(tmp_path / "again", model)).weights_digest
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.add_(1.0)
    b = pretrained_causal_lm(saved(tmp_path / "b", model)).weights_digest
    assert a == again  # the same weights saved twice
    assert a != b


def test_a_worker_with_other_weights_stops(redis_client: redis.Redis) -> None:
    keys = Keys("weights")
    agree_on_weights(redis_client, keys, "")  # nothing to check: nothing recorded
    assert redis_client.get(keys.weights) is None
    agree_on_weights(redis_client, keys, "aaaa")
    agree_on_weights(redis_client, keys, "aaaa")
    with pytest.raises(ModelError, match=r"digest bbbb but .* digest aaaa: .*same pretrained"):
        agree_on_weights(redis_client, keys, "bbbb")
    assert redis_client.get(keys.weights) == "aaaa"


# (d) a materialize that leaves a tensor unwritten --------------------------------------------


def meta_layers(fill) -> Layers:
    with torch.device("meta"):
        modules = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4))]
    return Layers(modules, materialize=fill)


def test_a_tensor_left_on_meta_is_refused() -> None:
    def fill(index: int, module: nn.Module) -> None:
        for p in module.parameters():
            p.fill_(0.5)
        if index == 1:
            with torch.device("meta"):
                module[0] = nn.Linear(4, 4)

    model = meta_layers(fill)
    layers = [m for m in model.modules]
    t = trainable(model)
    assert torch.equal(t.build(0).weight, torch.full((4, 4), 0.5))
    with pytest.raises(ModelError, match=r"layer 1 .*'0.weight' on the meta device"):
        t.build(1)
    assert all(p.is_meta for m in layers for p in m.parameters())  # the meta modules stay meta


def test_a_tensor_left_uninitialised_is_refused() -> None:
    def fill(index: int, module: nn.Module) -> None:
        linear = module if index == 0 else module[0]
        linear.weight.fill_(1.0)
        if index == 0:
            linear.bias.fill_(1.0)
        else:
            linear.bias[:2] = 1.0  # half of it

    model = meta_layers(fill)
    t = trainable(model)
    t.build(0)
    with pytest.raises(ModelError, match=r"layer 1 \(Sequential\): .*'0.bias'"):
        t.build(1)


# names and random initialisation ---------------------------------------------------------------


def test_tied_parameters_get_the_names_of_their_own_positions() -> None:
    model = transformers.GPT2LMHeadModel(gpt2_config())
    layers = split_causal_lm(model)
    assert layers.names[0]["wte.weight"] == "transformer.wte.weight"
    assert layers.names[-1]["lm_head.weight"] == "lm_head.weight"


class Embed(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb


class Head(nn.Module):
    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head


def test_a_tie_copy_made_before_the_split_is_named_by_its_suffix() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight  # one object, two names

    model = Tied()
    copy_head = nn.Linear(4, 5, bias=False)
    copy_head.weight = nn.Parameter(model.emb.weight.detach().clone())  # not in the model
    tie = Tie(first=(0, "emb.weight"), second=(1, "head.weight"))
    layers = split(model, lambda m: [Embed(m.emb), Head(copy_head)], [tie])
    assert layers.names[0] == {"emb.weight": "emb.weight"}
    assert layers.names[1] == {"head.weight": "head.weight"}


def test_random_layers_are_reproducible_per_seed_and_ties_start_equal() -> None:
    config = gpt2_config()
    config.architectures = ["GPT2LMHeadModel"]
    t = trainable(causal_lm_from_config(config, seed=3))  # refuses ties that start unequal
    again = trainable(causal_lm_from_config(config, seed=3))
    other = trainable(causal_lm_from_config(config, seed=4))
    for i in range(t.n_layers):
        a, b, c = (x.build(i).state_dict() for x in (t, again, other))
        for name, value in a.items():
            torch.testing.assert_close(value, b[name], atol=0, rtol=0)
        assert any(not torch.equal(value, c[name]) for name, value in a.items())
    block = t.build(1).block
    std = config.initializer_range
    assert abs(block.mlp.c_fc.weight.std().item() - std) < 0.2 * std
    assert abs(block.attn.c_proj.weight.std().item() - std / 2) < 0.2 * std  # GPT-2's scaling
    torch.testing.assert_close(block.ln_1.weight, torch.ones(32), atol=0, rtol=0)
