"""The worker library (chameleond.worker): a user's script with its own model, data, SGD with
momentum and a StepLR schedule and a tied embedding, trained by real worker processes under real
plans; the checks that refuse a malformed model; launch identity from torchrun's environment."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracles.reference import reference_losses
from torch import nn
from worker_harness import TINY_ARCH, Controller, Workers, builtin_model, signed_doc, tiny_spec

from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer
from chameleond.worker import Layers, ModelError, Tie, Training, split
from chameleond.worker import _checkpoint as checkpoint
from chameleond.worker._activation import run_stage
from chameleond.worker._identity import from_env
from chameleond.worker._layer import LayerState
from chameleond.worker._main import EXIT_MODEL, EXIT_SPEC, EXIT_USAGE
from chameleond.worker._profile import profile_model
from chameleond.worker._trainable import Trainable
from chameleond.worker._validate import check_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "sgd_tied.py"
sys.path.insert(0, str(SCRIPT.parent))
import sgd_tied  # noqa: E402 - the user's script, imported for its training and reference

CPU = torch.device("cpu")
LOSS_ATOL = 1e-5
# With these spec numbers the dynamic plan for 5 survivors is two pipelines of 2 and 3 stages, a
# layer migrated (test_worker_training.py).
TIGHT_MEMORY = 1_200_000


def tiny(modules: list[nn.Module], ties: tuple[Tie, ...] = (), loss=None) -> Training:  # type: ignore[no-untyped-def]
    data = [{"input_ids": torch.arange(4) + i, "labels": torch.arange(4)} for i in range(8)]
    return Training(
        model=Layers(modules, ties),
        loss=loss or (lambda out, batch: out.float().mean(dim=(1, 2))),
        dataset=data,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        global_batch=4,
        micro_batch=2,
    )


# Refusals ----------------------------------------------------------------------------------------


def test_a_split_that_drops_parameters_is_refused() -> None:
    whole = nn.Sequential(nn.Embedding(16, 4), nn.Linear(4, 4), nn.Linear(4, 16))
    with pytest.raises(ModelError, match=r"drops parameters 1\.weight, 1\.bias"):
        split(whole, lambda m: [m[0], m[2]])
    assert len(split(whole, lambda m: list(m)).modules) == 3


def test_a_parameter_shared_without_a_tie_is_refused() -> None:
    embed, head = nn.Embedding(16, 4), nn.Linear(4, 16, bias=False)
    head.weight = embed.weight
    with pytest.raises(ModelError, match=r"layer 1's parameter 'weight' is layer 0's 'weight'"):
        Trainable(tiny([embed, head]))
    model = Trainable(tiny([embed, head], (Tie((0, "weight"), (1, "weight")),)))
    assert model.build(0).weight is not model.build(1).weight  # each layer its own copy
    with pytest.raises(ModelError, match="has no parameter 'bias'"):
        Trainable(tiny([embed, head], (Tie((0, "weight"), (1, "bias")),)))


class Growing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.proj(x)[:, : max(1, x.shape[1] - self.calls)]  # shorter on every call


class Trim(nn.Embedding):
    """Deterministic; its output length depends on the data (a variable-length batch)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids)[:, : int(ids[0, 0]) + 1]


class Pair(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:  # type: ignore[override]
        return super().forward(x), "x"


def test_layers_that_cannot_be_pipelined_are_refused_naming_the_layer() -> None:
    def check(modules: list[nn.Module], **kw: object) -> None:
        check_model(Trainable(tiny(modules, **kw)), 2, CPU)  # type: ignore[arg-type]

    with pytest.raises(ModelError, match=r"layer 1 \(Growing\) changed its output shape"):
        check([nn.Embedding(16, 4), Growing(), nn.Linear(4, 16)])
    check([Trim(16, 4), nn.Linear(4, 16)])  # shapes may differ between micro-batches
    with pytest.raises(ModelError, match=r"the output of layer 1 \(Pair\) holds a str at 1"):
        check([nn.Embedding(16, 4), Pair(4, 4), nn.Linear(4, 16)])
    with pytest.raises(ModelError, match=r"one loss per sample \(shape \[2\]\)"):
        check([nn.Embedding(16, 4), nn.Linear(4, 16)], loss=lambda out, batch: out.sum())
    check([nn.Embedding(16, 4), nn.Linear(4, 16)])


def test_a_layer_without_parameters_trains_and_moves() -> None:
    model = Trainable(tiny([nn.Embedding(16, 4), nn.GELU(), nn.Linear(4, 16)]))
    check_model(model, 2, CPU)
    assert len(reference_losses(model, 2)) == 2
    layer = LayerState(model, 1, CPU)
    layer.apply_update(4, 0)
    copy = LayerState(model, 1, CPU)
    copy.load_buffer(layer.state_buffer(), 0)
    assert copy.version == 0 and copy.params() == []


def test_the_example_refuses_its_malformed_variant() -> None:
    with pytest.raises(ModelError, match=r"layer 2 \(Shifty\) changed its output shape"):
        check_model(Trainable(sgd_tied.build("shape")), 2, CPU)


# The user's optimizer --------------------------------------------------------------------------


def test_a_moved_layer_carries_momentum_and_schedule_exactly() -> None:
    model = Trainable(sgd_tied.build())
    original = [LayerState(model, i, CPU) for i in range(model.n_layers)]

    def train(layers: list[LayerState], step: int) -> float:
        batch = model.batch(step, 0, 12, 12, CPU)
        out, _ = run_stage([layer.module for layer in layers], model.inputs(batch))
        loss = model.loss_sum(out, batch, 12)
        loss.backward()
        for layer in layers:
            layer.apply_update(12, step)
        return loss.item()

    for step in range(4):
        train(original, step)
    moved = []
    for layer in original:
        copy = LayerState(model, layer.index, CPU)
        copy.load_buffer(layer.state_buffer(), layer.version)
        moved.append(copy)
    assert moved[1].scheduler.last_epoch == 4 and moved[1].optimizer.param_groups[0]["lr"] < 0.1
    assert all("momentum_buffer" in s for s in moved[1].optimizer.state.values())
    for step in range(4, 8):
        assert train(original, step) == train(moved, step)


def test_the_profile_counts_the_users_optimizer_state() -> None:
    sgd = profile_model(Trainable(sgd_tied.build()), 2, CPU)["layers"]
    assert all(lay["optimizer_bytes"] == lay["param_bytes"] > 0 for lay in sgd)  # momentum: 1x
    assert [lay["output_bytes"] for lay in sgd] == [2 * 8 * 16 * 4] * 5 + [0]
    adamw = profile_model(builtin_model(TINY_ARCH, 12, 2), 2, CPU)["layers"]
    assert all(lay["optimizer_bytes"] >= 2 * lay["param_bytes"] for lay in adamw)  # AdamW: 2x


# Launch identity -------------------------------------------------------------------------------


def test_a_script_without_a_training_is_a_usage_error(tmp_path: Path) -> None:
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    for path, why in ((script, "defines no `training`"), (tmp_path / "gone.py", "No such file")):
        r = subprocess.run(
            [sys.executable, "-m", "chameleond.worker._main", "--script", str(path),
             "--worker-id", "w0",
             "--redis-url", "redis://127.0.0.1:1/0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == EXIT_USAGE and why in r.stderr, r.stderr


def test_identity_comes_from_the_launchers_environment() -> None:
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1"}
    assert from_env(torchrun, cuda=True).worker_id == "w3"
    assert from_env(torchrun, cuda=True).device == "cuda:1"
    assert from_env(torchrun, cuda=False).device == "cpu"
    slurm = {"SLURM_PROCID": "7", "SLURM_LOCALID": "0", "CHAMELEON_JOB": "j"}
    assert (from_env(slurm, cuda=True).worker_id, from_env(slurm, cuda=True).job) == ("w7", "j")
    ours = {**torchrun, "CHAMELEON_WORKER_ID": "gpu-a", "CHAMELEON_DEVICE": "cpu"}
    assert (from_env(ours, cuda=True).worker_id, from_env(ours, cuda=True).device) == (
        "gpu-a",
        "cpu",
    )
    assert from_env({}, cuda=False).worker_id is None


# Real workers ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_user_script_survives_repartition_with_its_optimizer_state(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """SGD with momentum + StepLR + a tied embedding, 6 workers; w3 is killed (SIGKILL) after step
    4, the dynamic plan re-partitions into 2 + 3 stages and migrates layers with their momentum
    and schedule: every step's loss equals the single-process run's, and the tied copies, held by
    different workers, are equal in the final checkpoint."""
    steps = 16
    spec = tiny_spec("u", global_batch=12, micro_batch=2, memory_bytes=TIGHT_MEMORY)
    controller = Controller(redis_server.url, spec, policy="dynamic", measured=False).start()
    ckpt = tmp_path / "ckpt"
    workers = Workers(
        redis_server.url, "u", tmp_path, command=[sys.executable, str(SCRIPT)],
        extra_args=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "5"],
    )  # fmt: skip
    try:
        workers.start([f"w{i}" for i in range(6)], max_steps=steps)
        controller.wait_steps(4, timeout=150)
        workers.kill("w3")
        controller.wait_steps(steps, timeout=150)
        plans = controller.record.plans
        assert [p.policy for p in plans] == ["initial", "dynamic"]
        assert sorted(len(p.stages) for p in plans[1].pipelines) == [2, 3]
        assert plans[1].migration, "the dynamic plan moves no state"
        for w in plans[1].workers:
            workers.procs[w].wait(timeout=60)
            assert workers.procs[w].returncode == 0, workers.log(w)[-3000:]
    finally:
        workers.stop()
        controller.stop()
    committed = controller.record.committed()
    assert sorted(committed) == list(range(steps))
    ref = reference_losses(sgd_tied.build(), steps)
    worst = max(abs(committed[s] - ref[s]) for s in range(steps))
    assert worst <= LOSS_ATOL, [(committed[s], ref[s]) for s in range(steps)]
    # The tied copies: layer 0's embedding and the head's weight, at the last checkpoint.
    model = Trainable(sgd_tied.build())
    step = checkpoint.covering_step(ckpt, model)
    assert step == steps - 1  # the checkpoint each worker writes as training finishes
    held: dict[int, LayerState] = {}
    for path in sorted(ckpt.glob(f"*-{step:09d}.safetensors")):
        for i, saved in checkpoint.read(path).layers.items():
            held.setdefault(i, LayerState(model, i, CPU)).load_state_tensors(saved, step)
    first, last = held[0].module.weight, held[model.n_layers - 1].module.out.weight
    assert torch.equal(first, last)
    assert not torch.equal(first, model.build(0).weight)  # trained, not the initial copy
    print(f"\nuser script, dynamic: max abs loss error {worst:.2e}")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "command",
    [[str(SCRIPT)], ["-m", "chameleond.worker._main", "--script", str(SCRIPT)]],
    ids=["the script", "chameleon-worker --script"],
)
def test_a_malformed_model_is_refused_at_start(
    redis_server: RedisServer, tmp_path: Path, command: list[str]
) -> None:
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.set(
        Keys("m").spec, signed_doc("spec", "m", tiny_spec("m", global_batch=12, micro_batch=2))
    )
    env = {**os.environ, "SGD_TIED_MALFORMED": "shape"}
    r = subprocess.run(
        [sys.executable, *command, "--redis-url", redis_server.url, "--job", "m",
         "--worker-id", "w0"],
        capture_output=True, text=True, timeout=100, env=env,
    )  # fmt: skip
    assert r.returncode == EXIT_MODEL, r.stderr
    assert "layer 2 (Shifty) changed its output shape" in r.stderr
    assert "Traceback" not in r.stderr
    assert not client.xlen(Keys("m").events)  # refused before it registered
    client.close()


def test_an_optimizer_state_no_migration_can_load_is_refused_at_start(
    redis_server: RedisServer,
) -> None:
    """A user's object in the optimizer's state: a migration would fail to load it on every
    worker it moved to. The worker says so at start, naming the layer and the type, exit 8."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.set(
        Keys("s").spec, signed_doc("spec", "s", tiny_spec("s", global_batch=12, micro_batch=2))
    )
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--redis-url", redis_server.url, "--job", "s",
         "--worker-id", "w0"],
        capture_output=True, text=True, timeout=100,
        env={**os.environ, "SGD_TIED_MALFORMED": "state"},
    )  # fmt: skip
    assert r.returncode == EXIT_MODEL, r.stderr
    assert "layer 0 (Embedding): its state holds __main__.Visits" in r.stderr
    assert "Traceback" not in r.stderr
    assert not client.xlen(Keys("s").events)  # refused before it registered
    client.close()


def test_a_moved_state_that_cannot_load_is_a_model_error_not_a_fault() -> None:
    """A state buffer holding a user's type (sent by a worker that never checked it) fails its
    receiver with a ModelError naming the layer and the type: the worker exits 8 at once
    instead of failing the generation, to be retried on every worker it moves to."""
    from chameleond.worker._attribution import FAILS_GENERATION

    model = Trainable(sgd_tied.build("state"))
    sender = LayerState(model, 1, CPU)
    x = torch.randn(2, sgd_tied.SEQ, sgd_tied.WIDTH)
    sender.module(x).sum().backward()
    sender.apply_update(2, 0)
    with pytest.raises(ModelError, match=r"layer 1 \(Block\): its state holds .*Visits") as e:
        LayerState(model, 1, CPU).load_buffer(sender.state_buffer(), 0)
    assert not isinstance(e.value, FAILS_GENERATION)
    with pytest.raises(ModelError, match=r"layer 1 \(Block\)"):
        sender.check_movable()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_documented_script_trains(redis_server: RedisServer, tmp_path: Path) -> None:
    """The complete script of docs/worker-api.md, as written there, trains as two workers."""
    doc = (ROOT / "docs" / "worker-api.md").read_text()
    script = tmp_path / "train.py"
    script.write_text(doc.split("```python\n", 1)[1].split("```", 1)[0])
    steps = 4
    spec = tiny_spec("d", workers=2, stages=2, arch={**TINY_ARCH, "blocks": 1})  # 3 layers
    spec["training"] = {"global_batch": 12, "micro_batch": 2}
    controller = Controller(redis_server.url, spec, policy="reroute").start()
    workers = Workers(redis_server.url, "d", tmp_path, command=[sys.executable, str(script)])
    try:
        workers.start(["w0", "w1"], max_steps=steps)
        controller.wait_steps(steps, timeout=150)
        for w in ("w0", "w1"):
            assert workers.procs[w].wait(timeout=200) == 0, workers.log(w)[-3000:]
    finally:
        workers.stop()
        controller.stop()
    assert sorted(controller.record.committed()) == list(range(steps))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("script", "spec_kw", "message"),
    [
        (False, {"arch": {**TINY_ARCH, "heads": 3}}, "heads (3) must divide d_model (32)"),
        (True, {"global_batch": 8}, "training.global_batch is 8, the script's 12"),
        (True, {"arch": {**TINY_ARCH, "blocks": 3}}, "[model] has 5 layers, the script's model 6"),
    ],
    ids=["built-in arch", "batch", "layer count"],
)
def test_a_training_the_spec_disagrees_with_is_refused(
    redis_server: RedisServer, script: bool, spec_kw: dict[str, object], message: str
) -> None:
    import redis

    spec = tiny_spec("s", **{"global_batch": 12, "micro_batch": 2, **spec_kw})  # type: ignore[arg-type]
    client = redis.Redis.from_url(redis_server.url)
    client.set(Keys("s").spec, signed_doc("spec", "s", spec))
    client.close()
    command = [str(SCRIPT)] if script else ["-m", "chameleond.worker._main"]
    r = subprocess.run(
        [sys.executable, *command, "--redis-url", redis_server.url, "--job", "s",
         "--worker-id", "w0"],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert r.returncode == EXIT_SPEC and message in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages", [2, 1], ids=["tie across workers", "tie within a worker"])
def test_torchrun_starts_workers_named_by_rank(
    redis_server: RedisServer, tmp_path: Path, stages: int
) -> None:
    """Two ranks of torchrun become w0 and w1. With two stages the tied layers (the first and the
    last) are on different workers; with one stage each worker holds both and adds the two
    gradients itself before the data-parallel sum. Either way the losses are the single-process
    run's."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not Path(torchrun).exists():
        pytest.fail("torchrun is part of torch: it must be installed next to python")
    steps = 6
    spec = tiny_spec("tr", workers=2, stages=stages, global_batch=12, micro_batch=2)
    controller = Controller(redis_server.url, spec, policy="reroute").start()
    env = {**os.environ, "CHAMELEON_REDIS_URL": redis_server.url, "CHAMELEON_JOB": "tr"}
    env.pop("CHAMELEON_WORKER_ID", None)
    try:
        r = subprocess.run(
            [torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPT),
             "--max-steps", str(steps)],
            capture_output=True, text=True, timeout=200, env=env, cwd=tmp_path,
        )  # fmt: skip
    finally:
        controller.stop()
    assert r.returncode == 0, r.stderr[-3000:]
    assert {e["worker"] for e in controller.record.of("register")} == {"w0", "w1"}
    committed = controller.record.committed()
    ref = reference_losses(sgd_tied.build(), steps)
    assert sorted(committed) == list(range(steps))
    assert max(abs(committed[s] - ref[s]) for s in range(steps)) <= LOSS_ATOL
