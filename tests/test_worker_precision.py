"""The training loop's arithmetic, in one process: the commit's clipping factor against
`clip_grad_norm_`, the loss scale against `torch.amp.GradScaler`, named parameters, frozen
parameters (LoRA), and what a layer's state carries when it moves."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from chameleond.worker import Layers, ModelError, Training, split
from chameleond.worker._commit import Commit, LossScale, overflowed
from chameleond.worker._layer import LayerState
from chameleond.worker._state import WorkerState
from chameleond.worker._trainable import Trainable

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 16)


def data() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": (torch.arange(5) + i) % 16} for i in range(16)]


SEEN: list[list[str]] = []  # the names each optimizer was built with, in order


def training(model: Layers, **kw: object) -> Training:
    SEEN.clear()
    seen = SEEN

    def adamw(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        seen.append([n for n, _ in named])
        decay = [(n, p) for n, p in named if not n.endswith("bias") and "norm" not in n]
        rest = [(n, p) for n, p in named if n.endswith("bias") or "norm" in n]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        # Per layer, a group can be empty (the embedding has no bias): torch refuses those.
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=0.01)

    return Training(
        model=model,
        loss=lambda out, batch: out.float().pow(2).mean(dim=(1, 2)),
        dataset=data(),
        optimizer=adamw,
        global_batch=4,
        micro_batch=2,
        **kw,  # type: ignore[arg-type]
    )


def net_layers() -> Layers:
    torch.manual_seed(0)
    net = Net()
    return split(net, lambda m: [m.embed, *m.blocks, m.head])


# the commit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 100.0])
def test_the_commit_clips_as_clip_grad_norm_does(max_norm: float) -> None:
    torch.manual_seed(1)
    B, scale = 8, 1024.0
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    # The plain loop: mean-loss gradients, clipped in place.
    plain = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(plain, grads, strict=True):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(plain, max_norm)
    # The library: gradient SUMS over B samples, scaled by the loss scale, split among workers.
    sums = [g * B * scale for g in grads]
    rows = [
        sum(float(s.double().pow(2).sum()) for s in sums[:2]),
        float(sums[2].double().pow(2).sum()),
    ]
    commit = Commit(0, 0.0, sum(rows), 0, overflow=False)
    assert commit.grad_norm(B, scale) == pytest.approx(float(norm), rel=1e-6)
    factor = commit.factor(B, scale, max_norm)
    for s, p in zip(sums, plain, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(s / B * factor, p.grad, rtol=1e-6, atol=1e-7)


def test_the_loss_scale_moves_as_grad_scalers_does() -> None:
    p = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    mine = LossScale()
    mine.GROWTH_INTERVAL = 3
    for overflow in [True, False, False, False, True, False, False, False, False, True]:
        scaler.scale(torch.ones(1))
        p.grad = torch.full((1,), math.inf if overflow else 1.0)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        mine.update(overflow)
        assert mine.scale == scaler.get_scale()
    assert overflowed(math.inf, fp16=True) and overflowed(math.nan, fp16=True)
    assert not overflowed(math.inf, fp16=False) and not overflowed(3.0, fp16=True)


def test_an_overflowing_fp16_step_is_skipped_and_halves_the_scale() -> None:
    model = Trainable(training(net_layers(), precision="fp16"))
    state = WorkerState(model, CPU)
    layer = state.build_from_seed(1)
    before = {n: p.detach().clone() for n, p in layer.module.named_parameters()}
    for p in layer.params():
        p.grad = torch.full_like(p, math.inf)
    state.mark_pending(0, [1], global_batch=4)
    state.apply_pending(commit=Commit(0, 1.0, math.inf, 0, overflow=True))
    for n, p in layer.module.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None
    assert layer.scale == 2.0**15
    assert state.committed_step == 0 and layer.version == 0
    with pytest.raises(RuntimeError, match="need the step's commit"):
        state.mark_pending(1, [1], global_batch=4)
        state.apply_pending()


# names and frozen parameters ----------------------------------------------------------------------


def test_the_optimizer_gets_the_models_own_names() -> None:
    model = Trainable(training(net_layers()))
    for i in range(model.n_layers):
        LayerState(model, i, CPU)
    assert SEEN == [
        ["embed.weight"],
        ["blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.up.weight", "blocks.0.up.bias"],
        ["blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.up.weight", "blocks.1.up.bias"],
        ["head.weight", "head.bias"],
    ]
    # A plain list of layers is named as nn.Sequential would name it.
    plain = Trainable(training(Layers([nn.Linear(2, 2), nn.Linear(2, 2)])))
    LayerState(plain, 1, CPU)
    assert SEEN == [["1.weight", "1.bias"]]
    groups = LayerState(Trainable(training(net_layers())), 1, CPU).optimizer.param_groups
    assert groups[0]["param_names"] == ["blocks.0.up.weight"]
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0


def test_frozen_parameters_get_no_gradient_state_or_update() -> None:
    layers = net_layers()
    for m in layers.modules:
        for name, p in m.named_parameters():
            p.requires_grad_(name.startswith("up."))  # only the blocks' `up` trains
    model = Trainable(training(layers))
    layer = LayerState(model, 1, CPU)
    assert [n for n, _ in layer.named_params()] == ["up.weight", "up.bias"]
    assert SEEN[-1] == ["blocks.0.up.weight", "blocks.0.up.bias"]
    frozen = {
        n: p.detach().clone() for n, p in layer.module.named_parameters() if n.startswith("norm")
    }
    x = torch.randn(2, 5, 4)
    layer.module(x).sum().backward()
    assert all(p.grad is None for n, p in layer.module.named_parameters() if n.startswith("norm"))
    for _ in range(3):  # AdamW with weight decay: frozen weights must not decay
        layer.module(x).sum().backward()
        layer.apply_update(2, 0)
    for n, p in layer.module.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    state = layer.state_dict()
    assert sorted(state["module"]) == ["up.bias", "up.weight"]  # what moves: the trained ones
    assert len(state["optimizer"]["state"]) == 2
    # A layer that arrives takes its frozen weights from its build and the rest from the buffer.
    arrived = LayerState(model, 1, CPU)
    arrived.load_buffer(layer.state_buffer(), 0)
    for (n, a), (_, b) in zip(
        arrived.module.named_parameters(), layer.module.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), n
    # A layer whose first stage is frozen whole sends no gradient upstream to need.
    embed = LayerState(model, 0, CPU)
    assert embed.params() == [] and embed.state_dict()["module"] == {}


def test_the_loss_scale_moves_with_the_layer() -> None:
    model = Trainable(training(net_layers(), precision="fp16"))
    sender = LayerState(model, 2, CPU)
    assert sender.loss_scale is not None
    sender.loss_scale.update(overflow=True)
    sender.loss_scale.update(overflow=False)
    arrived = LayerState(model, 2, CPU)
    arrived.load_buffer(sender.state_buffer(), 0)
    assert arrived.loss_scale is not None
    assert arrived.loss_scale.state_dict() == {"scale": 2.0**15, "growth_tracker": 1}


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ModelError, match="precision must be one of fp32, bf16, fp16, got 'fp8'"):
        Trainable(training(net_layers(), precision="fp8"))
    with pytest.raises(ModelError, match="max_grad_norm must be > 0"):
        Trainable(training(net_layers(), max_grad_norm=0.0))
    model = Trainable(training(net_layers(), precision="bf16"))
    with pytest.raises(ModelError, match="precision 'bf16' is not supported on device meta"):
        model.check_precision(torch.device("meta"))
    model.check_precision(CPU)
