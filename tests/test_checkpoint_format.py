"""Checkpoint files as the model's named tensors (chameleond.worker._checkpoint), keep-last-N, the
checkpoint a worker writes when training ends, and `chameleonctl export --hf`. Real layers of
real transformers models, real optimizer steps, real files; the readers are the `safetensors`
package and `transformers` themselves."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from chameleond.cli.ctl import main as ctl  # noqa: E402
from chameleond.worker import Layers, Training, WorkerConfig  # noqa: E402
from chameleond.worker import _checkpoint as checkpoint  # noqa: E402
from chameleond.worker._config import config_error  # noqa: E402
from chameleond.worker._layer import LayerState  # noqa: E402
from chameleond.worker._saver import Saver  # noqa: E402
from chameleond.worker._state import WorkerState  # noqa: E402
from chameleond.worker._trainable import Trainable  # noqa: E402
from chameleond.worker.hf import causal_lm_loss, split_causal_lm  # noqa: E402

CPU = torch.device("cpu")
VOCAB, SEQ = 64, 8


def gpt2() -> Any:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def llama() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def layers_of(model: Any) -> Layers:
    """`split_causal_lm(model)`, recording the Hugging Face class and config (hf_class,
    hf_config) if the split does not already."""
    layers = split_causal_lm(model)
    if "hf_class" in layers.meta:
        return layers
    meta = {"hf_class": type(model).__name__, "hf_config": model.config.to_json_string()}
    return dataclasses.replace(layers, meta=meta)


def adamw(named: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(named, lr=1e-2)


def trained(
    layers: Layers,
    optimizer: Callable[[Any], torch.optim.Optimizer] = adamw,
    scheduler: Any = None,
    steps: int = 1,
) -> WorkerState:
    """Every layer, after `steps` real optimizer steps on one batch (tied gradients summed, as
    the runtime sums them)."""
    data = [{"input_ids": torch.zeros(SEQ, dtype=torch.long)} for _ in range(2)]
    model = Trainable(
        Training(
            model=layers, loss=causal_lm_loss, dataset=data, optimizer=optimizer,
            scheduler=scheduler, global_batch=2, micro_batch=2,
        )
    )  # fmt: skip
    state = WorkerState(model, CPU)
    for i in range(model.n_layers):
        state.build_from_seed(i)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        causal_lm_loss(forward(state, x), {"labels": x}).sum().backward()
        for tie in model.ties:
            a = dict(state.layer(tie.first[0]).module.named_parameters())[tie.first[1]]
            b = dict(state.layer(tie.second[0]).module.named_parameters())[tie.second[1]]
            assert a.grad is not None and b.grad is not None
            a.grad, b.grad = a.grad + b.grad, a.grad + b.grad
        state.mark_pending(step, range(model.n_layers))
        state.apply_pending(2)
    return state


def forward(state: WorkerState, x: torch.Tensor) -> torch.Tensor:
    for i in sorted(state.layers):
        x = state.layer(i).module(x)
    return x


def save_split(state: WorkerState, directory: Path) -> None:
    """The layers in two workers' files, as a two-stage pipeline writes them."""
    n = state.model.n_layers
    checkpoint.save(directory, "w0", state, tuple(range(n // 2)))
    checkpoint.save(directory, "w1", state, tuple(range(n // 2, n)))


def test_a_checkpoint_is_the_models_state_dict_by_name(tmp_path: Path) -> None:
    model = gpt2()
    names = dict(model.named_parameters(remove_duplicate=False))
    state = trained(layers_of(model))
    path = checkpoint.save(tmp_path, "w0", state, tuple(range(state.model.n_layers)))
    tensors = safetensors_torch.load_file(str(path))
    for i, layer in state.layers.items():
        for local, p in layer.module.named_parameters():
            name = layer.names[local]
            assert name in names, f"layer {i}'s {local} is {name}, not a name of the model"
            assert tensors[name].dtype == p.dtype and torch.equal(tensors[name], p.detach())
            opt = layer.optimizer.state[p]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(tensors[f"optimizer.{name}.{key}"], opt[key]), (name, key)
    assert {n for n in tensors if not n.startswith("optimizer.")} == set(model.state_dict())
    # GPT-2's tied pair: both names, equal values.
    assert torch.equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert (meta["step"], meta["worker"], meta["model"]) == ("0", "w0", state.model.fingerprint)
    assert meta["hf_class"] == "GPT2LMHeadModel"
    assert json.loads(meta["hf_config"])["n_layer"] == 2
    groups = json.loads(json.loads(meta["layer.1"])["rest"])["param_groups"]
    assert groups[0]["lr"] == 1e-2 and groups[0]["betas"] == {"__tuple__": [0.9, 0.999]}


def step_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def tensor_lr_sgd(named: Any) -> torch.optim.Optimizer:
    """An optimizer whose param_groups hold a tensor: not JSON, kept as a state.{i} tensor."""
    return torch.optim.SGD(named, lr=torch.tensor(0.05), momentum=0.9)


@pytest.mark.parametrize(
    ("optimizer", "scheduler", "in_tensor"),
    [(adamw, step_lr, False), (tensor_lr_sgd, None, True)],
    ids=["adamw+steplr (json)", "sgd with a tensor lr (torch.save)"],
)
def test_a_checkpoint_loads_back_bit_for_bit(
    tmp_path: Path, optimizer: Any, scheduler: Any, in_tensor: bool
) -> None:
    state = trained(layers_of(llama()), optimizer, scheduler, steps=2)
    n = state.model.n_layers
    save_split(state, tmp_path)
    tensors = safetensors_torch.load_file(str(checkpoint.checkpoint_path(tmp_path, "w0", 1)))
    assert ("state.0" in tensors) == in_tensor
    back = WorkerState(state.model, CPU)
    assert checkpoint.load(tmp_path, "w1", back) == 1
    assert sorted(back.layers) == list(range(n // 2, n))
    restored = WorkerState(state.model, CPU)
    checkpoint.restore(tmp_path, restored, 1, tuple(range(n)))
    for i in range(n):
        before, after = state.layer(i), restored.layer(i)
        assert after.version == 1
        # Module, optimizer, scheduler: the very bytes a migration would send.
        assert torch.equal(after.state_buffer(), before.state_buffer()), f"layer {i}"
        if scheduler is not None:
            assert after.scheduler.state_dict() == before.scheduler.state_dict()
        assert after.optimizer.param_groups[0]["lr"] == before.optimizer.param_groups[0]["lr"]
    # And it trains on from there exactly as the original does.
    x = torch.randint(0, VOCAB, (2, SEQ))
    for s in (state, restored):
        causal_lm_loss(forward(s, x), {"labels": x}).sum().backward()
        s.mark_pending(2, range(n))
        s.apply_pending(2)
    for i in range(n):
        assert torch.equal(restored.layer(i).state_buffer(), state.layer(i).state_buffer())


def test_a_layer_state_round_trips_through_its_tensors() -> None:
    state = trained(layers_of(gpt2()))
    layer = state.layer(3)
    saved = layer.state_tensors()
    assert set(saved.module.values()) == {"transformer.ln_f.weight", "transformer.ln_f.bias",
                                          "lm_head.weight"}  # fmt: skip
    other = LayerState(state.model, 3, CPU)
    other.load_state_tensors(saved, 0)
    assert torch.equal(other.state_buffer(), layer.state_buffer())
    del saved.tensors["lm_head.weight"]
    with pytest.raises(ValueError, match="layer 3: unusable checkpoint state"):
        other.load_state_tensors(saved, 0)


def test_frozen_parameters_are_left_out(tmp_path: Path) -> None:
    layers = layers_of(llama())
    layers.modules[1].block.mlp.requires_grad_(False)  # type: ignore[union-attr]
    state = trained(layers)
    path = checkpoint.save(tmp_path, "w0", state, (1,))
    names = set(safetensors_torch.load_file(str(path)))
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "optimizer.model.layers.0.self_attn.q_proj.weight.exp_avg" in names
    assert not [n for n in names if ".mlp." in n]
    back = LayerState(state.model, 1, CPU)  # frozen weights from its build, the rest read
    back.load_state_tensors(checkpoint.read(path).layers[1], 0)
    assert torch.equal(back.state_buffer(), state.layer(1).state_buffer())


def test_keep_last_n_keeps_n(tmp_path: Path) -> None:
    state = trained(layers_of(llama()))
    for step in range(6):
        state.committed_step = step
        checkpoint.save(tmp_path, "w0", state, (0, 1), keep=3)
    assert checkpoint.written(tmp_path) == {"w0": {3, 4, 5}}
    saver = Saver(tmp_path / "s", "w0", 1, lambda w: None, keep=1)
    for step in range(3):
        state.committed_step = step
        saver.committed(state, 1, (0,), [1.0])
        saver.flush()
        assert checkpoint.written(tmp_path / "s") == {"w0": {step}}
    cfg = WorkerConfig(redis_url="redis://127.0.0.1:1/0", job="j", worker_id="w0")
    assert config_error(dataclasses.replace(cfg, checkpoint_keep=0)) == (
        "checkpoint_keep 0: expected an integer >= 1"
    )


def test_checkpoint_keep_below_1_is_a_usage_error(tmp_path: Path) -> None:
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "chameleond.worker._main", "--redis-url", "redis://127.0.0.1:1/0",
         "--worker-id", "w0", "--checkpoint-dir", str(tmp_path), "--checkpoint-keep", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "--checkpoint-keep must be >= 1, got 0" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("build", [gpt2, llama])
def test_export_writes_a_model_transformers_loads_with_the_same_logits(
    tmp_path: Path, build: Callable[[], Any], capsys: pytest.CaptureFixture[str]
) -> None:
    state = trained(layers_of(build()), steps=2)
    directory, out = tmp_path / "ckpt", tmp_path / "hf"
    save_split(state, directory)
    state.committed_step = 5  # a newer step only w0 wrote: not every layer, not exported
    checkpoint.save(directory, "w0", state, (0,))
    assert ctl(["export", "--checkpoint", str(directory), "--hf", str(out)]) == 0
    assert "exported step 1" in capsys.readouterr().out
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))
    for layer in state.layers.values():
        layer.module.eval()
    with torch.no_grad():
        want = forward(state, x)
        got = exported(x).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (out / "model.safetensors").exists()


def run_export(
    capsys: pytest.CaptureFixture[str], directory: Path, out: Path, *more: str
) -> tuple[int, str]:
    """`chameleonctl export` through its main function: the exit code, and what it printed to
    stderr."""
    code = ctl(["export", "--checkpoint", str(directory), "--hf", str(out), *more])
    return code, capsys.readouterr().err.strip()


def test_export_errors_name_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    (tmp_path / "empty").mkdir()
    code, err = run_export(capsys, tmp_path / "empty", out)
    assert code == 2 and err == f"chameleonctl export: {tmp_path / 'empty'}: no checkpoint files " \
        "(*-STEP.safetensors)"  # fmt: skip
    model = gpt2()
    state = trained(layers_of(model))
    partial = tmp_path / "partial"
    checkpoint.save(partial, "w0", state, (0, 1))
    code, err = run_export(capsys, partial, out)
    assert code == 2 and "no step has readable checkpoint files that together hold every" in err
    assert len(err.splitlines()) == 1
    complete = tmp_path / "complete"
    save_split(state, complete)
    code, err = run_export(capsys, complete, out, "--step", "7")
    assert code == 2 and "no checkpoint of step 7" in err
    # A config that does not fit the tensors: one block more, one block fewer.
    for n_layer, message in ((3, "expects tensor transformer.h.2."), (1, "tensor transformer.h.1")):
        config = transformers.GPT2Config(**{**model.config.to_dict(), "n_layer": n_layer})
        meta = {"hf_class": "GPT2LMHeadModel", "hf_config": config.to_json_string()}
        wrong = tmp_path / f"wrong{n_layer}"
        save_split(trained(dataclasses.replace(layers_of(gpt2()), meta=meta)), wrong)
        code, err = run_export(capsys, wrong, out)
        assert code == 2 and message in err, err
        assert len(err.splitlines()) == 1
    assert not out.exists()


def test_export_of_a_model_not_from_hf_says_so(tmp_path: Path) -> None:
    """Run as the operator runs it: the `chameleonctl` command, exit status 2 and one line."""
    import shutil
    import subprocess

    plain = dataclasses.replace(layers_of(gpt2()), meta={})
    save_split(trained(plain), tmp_path / "plain")
    command = shutil.which("chameleonctl", path=str(Path(sys.executable).parent))
    assert command is not None
    r = subprocess.run(
        [command, "export", "--checkpoint", str(tmp_path / "plain"), "--hf", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "no hf_class/hf_config" in r.stderr
    assert "chameleond.worker.hf" in r.stderr and not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_finished_worker_writes_its_last_committed_step(
    redis_server: Any, tmp_path: Path
) -> None:
    """Two workers (one pipeline of two stages, the built-in model) train 3 steps with a
    checkpoint every 2 and `--checkpoint-keep 1`: the checkpoint of step 1, then, as training
    finishes, one of step 2 (not an every-th step), which replaces it; its files hold every
    layer at step 2, and each worker reports it."""
    from worker_harness import Controller, Workers, builtin_model, tiny_spec

    spec = tiny_spec("fin", workers=2, stages=2)
    directory = tmp_path / "ckpt"
    controller = Controller(redis_server.url, spec, policy="reroute").start()
    workers = Workers(
        redis_server.url, "fin", tmp_path,
        extra_args=["--checkpoint-dir", str(directory), "--checkpoint-every", "2",
                    "--checkpoint-keep", "1"],
    )  # fmt: skip
    try:
        workers.start(["w0", "w1"], max_steps=3)
        for w in ("w0", "w1"):
            assert workers.procs[w].wait(timeout=200) == 0, workers.log(w)[-3000:]
    finally:
        workers.stop()
        controller.stop()
    assert checkpoint.written(directory) == {"w0": {2}, "w1": {2}}
    reported = sorted((e["worker"], int(e["step"])) for e in controller.record.of("checkpoint"))
    assert reported == [("w0", 1), ("w0", 2), ("w1", 1), ("w1", 2)]
    model = builtin_model(spec["model"]["arch"], 12, 2)
    assert checkpoint.covering_step(directory, model) == 2
    for w in ("w0", "w1"):
        state = WorkerState(model, CPU)
        assert checkpoint.load(directory, w, state) == 2
        assert state.layers and all(layer.version == 2 for layer in state.layers.values())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stopped_worker_writes_its_last_committed_step(redis_server: Any, tmp_path: Path) -> None:
    """Both workers are stopped (SIGTERM) mid-training, with no periodic checkpoint: each writes
    its layers at its last committed step as it leaves, and together they cover the model. The
    step gate (chameleond/worker/_gate.py) holds them before step 3, and each is signalled once
    its gate record shows step 2 ended, so that the signal comes between two steps: one that
    lands during an optimizer update leaves no final checkpoint, by design (a layer may be half
    updated). A committed step alone does not say so: one worker's step event can arrive while
    the other still applies that step's update."""
    import signal

    from worker_harness import Controller, Workers, builtin_model, tiny_spec, wait_until

    from chameleond.worker._gate import GATE_ENV, read_record

    spec = tiny_spec("stop", workers=2, stages=2)
    directory = tmp_path / "ckpt"
    gate = tmp_path / "gate"
    gate.write_text("0 3\n")  # a library worker may not start step 3
    controller = Controller(redis_server.url, spec, policy="reroute").start()
    workers = Workers(
        redis_server.url, "stop", tmp_path, extra_args=["--checkpoint-dir", str(directory)]
    )
    try:
        workers.start(["w0", "w1"], env={w: {GATE_ENV: str(gate)} for w in ("w0", "w1")})
        controller.wait_steps(3, timeout=150)
        for w in ("w0", "w1"):
            record = gate.with_name(f"{gate.name}.{w}")
            wait_until(lambda r=record: 2 in read_record(r), 60, f"{w} at the gate")
            workers.procs[w].send_signal(signal.SIGTERM)
        for w in ("w0", "w1"):
            assert workers.procs[w].wait(timeout=60) == 0, workers.log(w)[-3000:]
    finally:
        workers.stop()
        controller.stop()
    last = max(controller.record.committed())
    assert last == 2  # steps 0, 1 and 2: the gate held step 3
    logs = workers.log("w0")[-3000:]
    assert checkpoint.written(directory) == {"w0": {last}, "w1": {last}}, logs
    model = builtin_model(spec["model"]["arch"], 12, 2)
    assert checkpoint.covering_step(directory, model) == last
