"""Structured, variable-shape activations and aux losses (chameleond.worker._activation).

The pure parts (flatten/unflatten, the forward message's header, the aux split), the start-up
check of an activation's structure, and a user's model whose layers pass a dict {"hidden": float,
"mask": bool} through real worker processes, real gloo and a real Redis, on variable-length
batches (each micro-batch padded to its own longest sample), a 3-stage pipeline: its losses are
those of a plain one-process loop over the same micro-batches; with a middle layer returning an
aux_loss, they are those of the loop that adds it, and the first stage's embedding after the
steps is the loop's (so the aux loss's gradient reached the earlier stages).

Run as a script, this file is the user's training script the workers run
(`ACTIVATIONS_AUX=1`: with the aux loss; `ACTIVATIONS_WEIGHTS=path`: the embedding layer writes
its weight there at each forward).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from chameleond.worker import Layers, Training, run
from chameleond.worker._activation import (
    Structure,
    decode_header,
    encode_header,
    flatten,
    header_size,
    run_stage,
    split_aux,
    unflatten,
)
from chameleond.worker._trainable import Trainable
from chameleond.worker._validate import check_model
from chameleond.worker.api import ModelError

CPU = torch.device("cpu")
VOCAB, WIDTH = 24, 8
B, MB, STEPS = 8, 2, 4
AUX_WEIGHT = 0.5
LOSS_ATOL = 1e-5

# The pure parts ----------------------------------------------------------------------------------


def test_flatten_and_unflatten_round_trip_every_kind() -> None:
    h, m = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    for activation in (h, (h, m), [m, h], {"hidden": h, "mask": m}):
        structure, tensors = flatten(activation)
        back = unflatten(structure, tensors)
        assert type(back) is type(activation)
        assert flatten(back) == (structure, tensors)
    structure, _ = flatten({"hidden": h, "mask": m})
    assert structure == Structure("dict", ("hidden", "mask"), (torch.float32, torch.bool))
    assert structure.floating == (0,)
    assert str(structure) == "a dict (hidden: float32, mask: bool)"
    assert flatten((h, m))[0] != flatten((m, h))[0]
    with pytest.raises(ModelError, match=r"layer 3's output holds a int at 'n'"):
        flatten({"h": h, "n": 3}, "layer 3's output")
    with pytest.raises(ModelError, match="is a str: expected a tensor"):
        flatten("x")


def test_the_header_carries_each_dtype_and_shape_in_a_size_fixed_by_the_structure() -> None:
    tensors = [
        torch.zeros(2, 5, 8),
        torch.zeros(2, 5, dtype=torch.bool),
        torch.zeros((), dtype=torch.int64),
    ]
    structure, _ = flatten(tuple(tensors))
    header = encode_header(tensors)
    assert header.dtype == torch.int64 and header.shape == (header_size(structure),)
    assert decode_header(header) == [
        (torch.float32, (2, 5, 8)),
        (torch.bool, (2, 5)),
        (torch.int64, ()),
    ]
    shorter = [torch.zeros(2, 1, 8), torch.zeros(2, 1, dtype=torch.bool), tensors[2]]
    assert encode_header(shorter).shape == header.shape  # shapes change, the size does not
    with pytest.raises(ModelError, match="at most 8 dimensions"):
        encode_header([torch.zeros([1] * 9)])


def test_the_aux_loss_is_split_off_and_summed_over_a_stage() -> None:
    h = torch.randn(2, 3)
    out, aux = split_aux({"hidden": h, "aux_loss": torch.tensor(0.25)})
    assert out == {"hidden": h} and aux is not None and float(aux) == 0.25
    assert split_aux({"logits": h}) == ({"logits": h}, None)
    assert split_aux(h) == (h, None)
    with pytest.raises(ModelError, match="Router returned an aux_loss that is not a scalar"):
        split_aux({"hidden": h, "aux_loss": h}, "Router")

    class WithAux(nn.Module):
        def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"hidden": x["hidden"] * 2, "aux_loss": x["hidden"].sum()}

    out, aux = run_stage([WithAux(), WithAux()], {"hidden": torch.ones(2)})
    assert torch.equal(out["hidden"], torch.full((2,), 4.0))
    assert aux is not None and float(aux) == 2.0 + 4.0


# The wire: two real processes on gloo ---------------------------------------------------------


def _wire_peer(port: int, rank: int, results: Any) -> None:
    """Rank 0 sends forward messages A and B (header, then tensors; B shorter) and gradients C,
    in one batch; rank 1 posts A, B and C in one batch too, then takes B, C and A in that order:
    B's header must wait for A's data receives, C's for B's."""
    from datetime import timedelta

    import torch.distributed as dist

    from chameleond.worker._backend import exchange
    from chameleond.worker._p2p import MessageId
    from chameleond.worker._wire import Receives

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=30))
    opts = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
    opts._timeout = timedelta(seconds=30)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = dist.ProcessGroupGloo(store, rank, 2, opts)
    a = [torch.arange(2 * 5 * 3.0).view(2, 5, 3), torch.ones(2, 5, dtype=torch.bool)]
    b = [torch.full((2, 2, 3), 7.0), torch.zeros(2, 2, dtype=torch.bool)]
    c = [torch.full((2, 5, 3), -1.0)]
    ids = [MessageId(g, 0, 0, kind) for g, kind in ((0, "F"), (1, "F"), (0, "B"))]
    structure = flatten(tuple(a))[0]
    if rank == 0:
        sends = [encode_header(a), *a, encode_header(b), *b, *c]
        for work in exchange(group, [(True, t, 1) for t in sends]):
            work.wait()
        results.put("sent")
        return
    receives = Receives(group, CPU)
    posted = [
        receives.add(ids[0], 0, structure, []),
        receives.add(ids[1], 0, structure, []),
        receives.add(ids[2], 0, None, [(torch.float32, (2, 5, 3))]),
    ]
    counts = [len(p) for p in posted]
    works = exchange(group, [op for p in posted for op in p])
    receives.issued(ids[0], works)
    got_b, got_c, got_a = (receives.take(m)[1] for m in (ids[1], ids[2], ids[0]))
    same = all(
        torch.equal(x, y) for x, y in zip([*got_a, *got_b, *got_c], [*a, *b, *c], strict=True)
    )
    results.put((counts, same, len(receives)))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_receives_are_posted_in_the_senders_order_whatever_the_order_they_are_taken() -> None:
    from chameleond.redis_server import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_wire_peer, args=(port, r, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    got = sorted((results.get(timeout=5) for _ in procs), key=str)
    # Only A's header goes with the batch: B's header and C's gradients wait for A's data.
    assert got == [([1, 0, 0], True, 0), "sent"]


# The user's model: a dict of hidden states and a padding mask ---------------------------------


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        where = os.environ.get("ACTIVATIONS_WEIGHTS")
        if where and torch.is_grad_enabled():
            Path(where).write_text(json.dumps(self.embed.weight.detach().tolist()))
        return {"hidden": self.embed(x["input_ids"]), "mask": x["mask"]}


class Block(nn.Module):
    """Mixes each position with the masked mean of its sequence (padding takes no part)."""

    def __init__(self, aux: bool = False) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.router = nn.Linear(WIDTH, 4) if aux else None
        self.detach_aux = False  # the plain loop's control: no aux gradient to earlier layers

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h, mask = x["hidden"], x["mask"]
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
        out = {"hidden": h + torch.tanh(self.mix(h + pooled)) * m, "mask": mask}
        if self.router is not None:  # a MoE router's balancing loss over the real tokens
            routed = self.router(h.detach() if self.detach_aux else h)
            share = (torch.softmax(routed, -1) * m).sum((0, 1)) / m.sum()
            out["aux_loss"] = AUX_WEIGHT * 4 * (share * share).sum()
        return out


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"logits": self.out(x["hidden"])}


class Texts(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample i: 2 to 7 tokens of a pattern seeded by i."""

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = 3 + (i * 7) % 6
        ids = (i + torch.arange(n) * (1 + i % 3)) % VOCAB
        return {"input_ids": ids[:-1], "labels": ids[1:]}


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pads a micro-batch to its own longest sample."""
    n = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), n, dtype=torch.int64)
    labels = torch.full((len(samples), n), -100, dtype=torch.int64)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
        labels[row, : len(s["labels"])] = s["labels"]
    return {"input_ids": ids, "labels": labels, "mask": labels != -100}


def inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"], "mask": batch["mask"]}


def loss(output: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    assert set(output) == {"logits"}  # the aux loss does not reach the loss function
    per_token = nn.functional.cross_entropy(
        output["logits"].transpose(1, 2), batch["labels"], reduction="none"
    )
    mask = batch["mask"].to(per_token.dtype)
    return (per_token * mask).sum(1) / mask.sum(1)


def build(aux: bool = False) -> Training:
    torch.manual_seed(0)
    modules = [Embed(), Block(), Block(aux), Block(), Head()]
    return Training(
        model=Layers(modules),
        loss=loss,
        dataset=Texts(),
        optimizer=lambda named: torch.optim.SGD([p for _, p in named], lr=0.5),
        global_batch=B,
        micro_batch=MB,
        collate=pad,
        inputs=inputs,
    )


def plain_loop(
    training: Training, steps: int, detach_aux: bool = False
) -> tuple[list[float], torch.Tensor]:
    """The same training in one process, one optimizer, a loop that averages each micro-batch's
    loss plus its aux loss: (each step's mean loss, the embedding after the steps but the last).
    `detach_aux`: the aux loss's gradient stops at its layer."""
    assert isinstance(training.model, Layers)
    modules = [copy.deepcopy(m) for m in training.model.modules]
    for module in modules:
        if isinstance(module, Block):
            module.detach_aux = detach_aux
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.5)
    losses, embedding = [], torch.empty(0)
    data = Texts()
    for step in range(steps):
        if step == steps - 1:
            assert isinstance(modules[0], Embed)
            embedding = modules[0].embed.weight.detach().clone()
        total = 0.0
        for g in range(B // MB):
            batch = pad([data[step * B + g * MB + i] for i in range(MB)])
            x: Any = inputs(batch)
            aux_sum = torch.zeros(())
            for module in modules:
                x = module(x)
                if "aux_loss" in x:
                    aux_sum = aux_sum + x.pop("aux_loss")
            micro = loss(x, batch).mean() + aux_sum
            (micro * MB / B).backward()
            total += float(micro.detach()) * MB
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / B)
    return losses, embedding


# The start-up check ----------------------------------------------------------------------------


class Switching(nn.Module):
    """Its output's keys depend on the data: a structure no boundary can carry."""

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = "hidden" if x["input_ids"].shape[1] > 3 else "states"
        return {key: x["input_ids"].float()}


def test_the_structures_found_at_start_up_and_a_switching_layer_refused() -> None:
    model = Trainable(build(aux=True))
    found = check_model(model, MB, CPU)
    boundary = Structure("dict", ("hidden", "mask"), (torch.float32, torch.bool))
    assert found == [boundary] * 4 + [Structure("dict", ("logits",), (torch.float32,))]
    lengths = {model.batch(0, g, B, MB, CPU)["input_ids"].shape[1] for g in range(2)}
    assert len(lengths) == 2  # the two micro-batches checked differ in length
    switching = build()
    assert isinstance(switching.model, Layers)
    layers = Layers([Switching(), *switching.model.modules[1:]])
    with pytest.raises(
        ModelError, match=r"layer 0 \(Switching\) returned a dict \((hidden|states)"
    ):
        check_model(Trainable(dataclasses.replace(switching, model=layers)), MB, CPU)

    class Ints(nn.Module):
        def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {"hidden": x["input_ids"], "mask": x["mask"]}

    layers = Layers([Ints(), *switching.model.modules[1:]])
    with pytest.raises(
        ModelError, match=r"layer 0 \(Ints\) returns a dict .* at least one floating"
    ):
        check_model(Trainable(dataclasses.replace(switching, model=layers)), MB, CPU)


# Through real workers ----------------------------------------------------------------------------


def train_workers(url: str, tmp: Path, job: str, aux: bool) -> tuple[dict[int, float], Any, Path]:
    from worker_harness import Controller, Workers, tiny_spec

    spec = tiny_spec(job, workers=3, stages=3, global_batch=B, micro_batch=MB)
    spec["model"]["layers"][0]["count"] = 5
    controller = Controller(url, spec, policy="reroute").start()
    (tmp / job).mkdir()
    workers = Workers(url, job, tmp / job, command=[sys.executable, __file__])
    weights = tmp / job / "embedding.json"
    env = {"ACTIVATIONS_WEIGHTS": str(weights), "ACTIVATIONS_AUX": "1" if aux else ""}
    ids = ["w0", "w1", "w2"]
    try:
        workers.start(ids, dict.fromkeys(ids, env), max_steps=STEPS)
        controller.wait_steps(STEPS, timeout=240)
        for w in ids:
            assert workers.procs[w].wait(timeout=60) == 0, workers.log(w)[-3000:]
    finally:
        workers.stop()
        controller.stop()
    assert not controller.errors, controller.errors
    return controller.record.committed(), controller.record.plans[0], weights


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("aux", [False, True], ids=["mask", "mask+aux"])
def test_a_dict_with_a_mask_trains_on_variable_lengths_as_a_plain_loop(
    aux: bool, redis_server: Any, tmp_path: Path
) -> None:
    committed, plan, weights = train_workers(redis_server.url, tmp_path, f"act-{aux:d}", aux)
    stages = [s.layers for s in plan.pipelines[0].stages]
    assert len(stages) == 3, stages  # messages cross two boundaries
    expected, embedding = plain_loop(build(aux), STEPS)
    assert sorted(committed) == list(range(STEPS))
    worst = max(abs(committed[s] - expected[s]) for s in range(STEPS))
    assert worst <= LOSS_ATOL, [(committed[s], expected[s]) for s in range(STEPS)]
    trained = torch.tensor(json.loads(weights.read_text()))
    assert torch.allclose(trained, embedding, atol=1e-6), (trained - embedding).abs().max()
    if aux:
        assert 2 not in stages[0] and 2 not in stages[-1], stages  # the aux layer in the middle
        # Where the aux loss's gradient stops at its layer, the loop trains another embedding.
        _, stopped = plain_loop(build(aux), STEPS, detach_aux=True)
        assert (stopped - embedding).abs().max() > 1e-3
    print(f"\n{'mask+aux' if aux else 'mask'}: max |loss - plain loop| {worst:.2e}")


if __name__ == "__main__":
    sys.exit(run(lambda job: build(bool(os.environ.get("ACTIVATIONS_AUX")))))
