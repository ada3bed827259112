"""One training step of one worker under a plan: its 1F1B ops, then the gradient sync rounds.

Ops run in the generation's order, a linear extension of the step's dependency graph
(chameleond.core.schedule). Messages go out in the generation's batches (chameleond.worker._p2p): an
op's output waits in an outbox until its batch is issued, a receive is posted with its batch and
waited for just before the op that uses it. Under rerouting a worker's op list holds ops of several
pipelines (the failed slot's micro-batches), so activations and gradients cross pipelines;
everything is keyed by (pipeline, stage, micro-batch). A message is an activation
(chameleond.worker._activation: a tensor, a tuple/list or a dict of tensors, of the structure its
boundary's layer has, chameleond.worker._validate, its shapes free) or the gradients of its
floating tensors; it is named by its MessageId (kind, pipeline, stage boundary, micro-batch) here
only: on the wire it is matched by the order of the batches (chameleond.worker._p2p), a forward
message as its header then its tensors (chameleond.worker._wire). Stage 0 reads its micro-batch's
inputs, the last stage the same batch for the user's loss (chameleond.worker._trainable: sample
ids, collate, per-sample losses).

A backward runs `torch.autograd.backward` over the stage's floating outputs that require grad,
with the gradients received, and over its objective: the loss sum at the last stage, plus
`aux_loss * samples` of every layer of the stage that returned an aux loss. The objective is also
added to the step's loss sum, on every stage, so that the division by the global batch weights an
aux loss as a one-process loop averaging each micro-batch's loss does.

Gradients accumulate as SUMs over every micro-batch a worker executes for a layer; each SyncGroup
all-reduces (SUM) its layers' gradients over the owners, in the plan's colouring rounds; then tied
parameters add their two layers' sums (chameleond.worker._ties). The division by the plan's global
batch (the samples its steps train: B, or fewer under a drop plan) happens once, at commit
(LayerState.apply_update), with the clipping factor and the fp16 overflow decision the commit vote
gives every worker alike (chameleond.worker._commit): this step contributes the sum of squares of
the gradients of the layers this worker is the first owner of, and the tokens of its stage-0
micro-batches.

Forwards (layers and loss) run under the training's autocast (bf16, fp16); in fp16 the objective's
backward (loss and aux losses alike) starts from the layers' loss scale over the step's samples
(commit.seed). Only trainable
parameters have gradients: frozen ones (a LoRA model's base weights) are neither synced nor
counted."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from chameleond.core.plan import Plan
from chameleond.core.schedule import BACKWARD, FORWARD, Op
from chameleond.worker._activation import (
    Activation,
    Structure,
    encode_header,
    flatten,
    run_stage,
    unflatten,
)
from chameleond.worker._backend import P2POp, communicating, computing, exchange
from chameleond.worker._generation import Generation, sync_order
from chameleond.worker._p2p import (
    Batch,
    Message,
    MessageId,
    backward_input,
    backward_output,
    forward_input,
    forward_output,
)
from chameleond.worker._profile import TrainingMeter
from chameleond.worker._state import WorkerState
from chameleond.worker._ties import sync_ties
from chameleond.worker._trainable import Trainable
from chameleond.worker._wire import Receives, Spec
from chameleond.worker.api import ModelError


@dataclass
class StepResult:
    loss_sum: float  # SUM over the samples whose last stage this worker executed
    layers: tuple[int, ...]  # layers whose gradients this step produced (and synced)
    grad_sq: float = 0.0  # sum of squares of the gradient sums this worker counts (commit.py)
    tokens: int = 0  # of the micro-batches whose first stage this worker executed
    first_stage: tuple[int, ...] = ()  # those micro-batches' global ids


class StepRunner:
    def __init__(
        self,
        gen: Generation,
        state: WorkerState,
        outputs: Sequence[Structure],
        meter: TrainingMeter | None = None,
    ) -> None:
        self.gen = gen
        self.state = state
        self.model = state.model
        self.meter = meter  # measures each op for the in-training profile
        self._outputs = outputs  # each layer's output structure (chameleond.worker._validate)
        self._structures = _message_structures(gen, outputs)  # of the forwards it receives
        self._outbox: dict[MessageId, list[torch.Tensor]] = {}  # computed, waiting for their batch
        self._receives = Receives(gen.world_group, state.device)  # posted receives
        self._grad_specs: dict[MessageId, list[Spec]] = {}  # gradients it will receive
        self._sent: list[tuple[Any, torch.Tensor]] = []
        self._local: dict[MessageId, list[torch.Tensor]] = {}  # messages to itself
        # Wall seconds the last step waited before each op for its input, then after the last op for
        # its sends and the gradient sync: the bubbles as they really are
        # (chameleond.worker._saver).
        self.waits = [0.0] * (len(gen.ops) + 1)
        self._waiting_since = 0.0
        self.synced_bytes = 0  # gradient bytes all-reduced by the last step's sync
        # The layers whose gradients this worker counts in the step's norm: those it is the first
        # owner of, in the world's order (every owner holds the same sums after the sync).
        plan, me = gen.plan, gen.me
        owners = {w: set(plan.owned_layers(w)) for w in gen.world}
        self._counted = [
            j for j in sorted(owners[me]) if next(w for w in gen.world if j in owners[w]) == me
        ]
        # A tie's second copy holds the first's gradient after sync_ties: counted once.
        self._tie_copies = {t.second for t in state.model.trained_ties}

    # point-to-point ---------------------------------------------------------------------------

    def _send_forward(self, out: Activation, layer: int, peer: str, message: MessageId) -> None:
        """Send layer `layer`'s output: its header, then its tensors."""
        structure, tensors = flatten(out, f"layer {layer}'s output")
        if structure != self._outputs[layer]:
            raise ModelError(
                f"layer {layer} returned {structure} for micro-batch {message.micro_batch}, but "
                f"{self._outputs[layer]} at start-up: an activation's structure and dtypes are "
                "fixed (its shapes may vary)"
            )
        tensors = [t.detach().contiguous() for t in tensors]
        if peer == self.gen.me:
            self._local[message] = tensors
            return
        back = MessageId(message.micro_batch, message.pipeline, message.boundary, BACKWARD)
        self._grad_specs[back] = [
            (t.dtype, tuple(t.shape)) for t in tensors if t.is_floating_point()
        ]
        header = encode_header(tensors).to(self.state.device)
        self._outbox[message] = [header, *tensors]  # sent with its batch

    def _send_grads(self, grads: list[torch.Tensor], peer: str, message: MessageId) -> None:
        tensors = [g.detach().contiguous() for g in grads]
        if peer == self.gen.me:
            self._local[message] = tensors
        else:
            self._outbox[message] = tensors

    def _recv_forward(self, peer: str, message: MessageId, grad: bool = True) -> Activation:
        """The activation received; its floating tensors require grad when `grad`."""
        if peer == self.gen.me:
            structure, tensors = self._structures[message], self._local.pop(message)
        else:
            got, tensors = self._receives.take(message)
            assert got is not None
            structure = got
        if grad:
            for t in tensors:
                if t.is_floating_point():
                    t.requires_grad_()
        return unflatten(structure, tensors)

    def _recv_grads(self, peer: str, message: MessageId) -> list[torch.Tensor]:
        if peer == self.gen.me:
            return self._local.pop(message)
        return self._receives.take(message)[1]

    def _issue(self, batch: Batch) -> None:
        ops: list[P2POp] = []
        posted: list[tuple[bool, MessageId, int]] = []  # (send, message, its ops)
        for end in batch.endpoints:
            peer = self.gen.rank_of(end.peer)
            m = end.message
            if end.send:
                mine = [(True, t, peer) for t in self._outbox.pop(m)]
            elif m.kind == FORWARD:
                mine = self._receives.add(m, peer, self._structures[m], [])
            else:
                mine = self._receives.add(m, peer, None, self._grad_specs.pop(m))
            ops += mine
            posted.append((end.send, m, len(mine)))
        works = exchange(self.gen.world_group, ops)  # in the batch's order: the pair's order
        at = 0
        for send, m, n in posted:
            if send:
                for work, (_, tensor, _) in zip(works[at : at + n], ops[at : at + n], strict=True):
                    self._sent.append((work, tensor))  # the tensor must outlive the send
            elif n:
                self._receives.issued(m, works[at : at + n])
            at += n

    def _clear(self) -> None:
        # Pending transfers hold the group; a failed step must not keep it (and its sockets) open.
        for box in (self._outbox, self._sent, self._local, self._grad_specs, self._receives):
            box.clear()

    # the step ---------------------------------------------------------------------------------

    def run(self, step: int, on_op: Any = None, bubble: Any = None) -> StepResult:
        """`bubble(i)`, if given, is called where the op order's timeline has this worker idle
        before op i (i = number of ops: after the last): once the op's batches are issued, before
        it waits for its input (chameleond.worker._saver)."""
        try:
            return self._run(step, on_op, bubble)
        finally:
            self._clear()

    def _run(self, step: int, on_op: Any, bubble: Any) -> StepResult:
        plan, st = self.gen.plan, self.state
        self._expect(step)
        dev = st.device
        # (pipeline, stage, micro-batch) -> (inputs to send gradients of, outputs, objective)
        stash: dict[tuple[int, int, int], tuple[list[torch.Tensor], list[torch.Tensor], Any]] = {}
        # Summed on the device, in float64 (what Python's float sum of the float32 losses gives),
        # and read once per step: a read per micro-batch would wait for an accelerator each time.
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        first_stage: list[int] = []
        autocast = self.model.autocast(dev)
        seed = st.seed(plan.global_batch)
        batches = iter(self.gen.batches)
        batch = next(batches, None)
        for i, op in enumerate(self.gen.ops):
            if on_op is not None:
                on_op(step, i, len(self.gen.ops))
            while batch is not None and batch.before <= i:
                self._issue(batch)
                batch = next(batches, None)
            self._receives.poll()  # data receives whose headers are in
            if bubble is not None:
                bubble(i)
            if self.meter is not None:
                self.meter.begin()  # after the bubble's work: not the op's
            self._waiting_since = time.perf_counter()
            stages = plan.pipelines[op.pipeline].stages
            layers = [st.layer(j) for j in stages[op.stage].layers]
            last = op.stage == len(stages) - 1
            key = (op.pipeline, op.stage, op.micro_batch)
            if op.kind == FORWARD:
                # A stage that is both first and last (one-stage pipelines) reads the micro-batch
                # once, for its inputs and its loss.
                data = self._batch(op, step) if op.stage == 0 else None
                if data is not None:
                    x = cast(Activation, self.model.inputs(data))
                    first_stage.append(op.micro_batch)
                else:
                    x = self._recv_forward(*_present(forward_input(op)))
                inputs = [t for t in flatten(x)[1] if t.requires_grad]
                self._inputs_ready(i)
                with computing(), autocast:
                    out, aux = run_stage([layer.module for layer in layers], x)
                    objective = None if aux is None else _weighted(aux, plan.micro_batch)
                    if last:
                        if data is None:
                            data = self._batch(op, step)
                        loss = self.model.loss_sum(out, data, plan.micro_batch)
                        objective = loss if objective is None else loss + objective
                    if objective is not None:
                        loss_sum += objective.detach().double()
                outs: list[torch.Tensor] = []
                if not last:
                    layer = stages[op.stage].layers[-1]
                    self._send_forward(out, layer, *_present(forward_output(op, len(stages))))
                    outs = [t for t in flatten(out)[1] if t.is_floating_point()]
                stash[key] = (inputs, outs, objective)
            else:
                inputs, outs, objective = stash.pop(key)
                grad_in = backward_input(op, len(stages))
                grads = [] if grad_in is None else self._recv_grads(*grad_in)  # []: the loss
                roots, seeds = [], []
                for t, g in zip(outs, grads, strict=True):
                    if t.requires_grad:  # not: a first stage whose parameters are all frozen
                        roots.append(t)
                        seeds.append(g)
                if objective is not None and objective.requires_grad:
                    roots.append(objective)
                    seeds.append(torch.full_like(objective, seed))  # fp16: the loss scale
                self._inputs_ready(i)
                with computing():
                    if roots:
                        torch.autograd.backward(roots, seeds)
                grad_out = backward_output(op)
                if grad_out is not None:
                    self._send_grads([_grad_of(t) for t in inputs], *grad_out)
            if self.meter is not None:
                self.meter.op(op.kind == FORWARD, stages[op.stage].layers)
        while batch is not None:
            self._issue(batch)
            batch = next(batches, None)
        if bubble is not None:
            bubble(len(self.gen.ops))
        self._waiting_since = time.perf_counter()
        with communicating():
            for work, _ in self._sent:
                work.wait()
        self._sent.clear()
        if stash or self._outbox or self._receives:
            raise RuntimeError(
                f"step {step}: {len(stash)} forwards without a backward, {len(self._outbox)} "
                f"outputs not sent, {len(self._receives)} messages received for no op"
            )
        self._sync_gradients()
        self._waited(len(self.gen.ops))
        with computing():
            # One read of the device for both sums: each read waits for everything queued.
            total, grad_sq = torch.stack((loss_sum, self._grad_sq(loss_sum))).tolist()
        tokens = self.model.read_tokens(step, first_stage)
        return StepResult(
            total, plan.owned_layers(self.gen.me), grad_sq, tokens, tuple(first_stage)
        )

    def _grad_sq(self, like: torch.Tensor) -> torch.Tensor:
        """The sum of squares of the gradients this worker counts, as clip_grad_norm_ forms the
        norm: each parameter's 2-norm, then their squares summed (in float64), on the device
        (`like`'s), unread."""
        grads = []
        for j in self._counted:
            for name, p in self.state.layer(j).named_params():
                if (j, name) not in self._tie_copies and p.grad is not None:
                    grads.append(p.grad)
        if not grads:
            return torch.zeros_like(like)
        norms = torch._foreach_norm(grads, 2.0)
        return torch.stack(norms).double().square().sum().to(like.device)

    def _waited(self, i: int) -> None:
        self.waits[i] = time.perf_counter() - self._waiting_since

    def _inputs_ready(self, i: int) -> None:
        self._waited(i)
        if self.meter is not None:
            self.meter.inputs_ready()

    def _batch(self, op: Op, step: int) -> Any:
        # Sample ids are laid out by the job's B, not the plan's: a drop plan trains fewer
        # micro-batches of the same steps (chameleond.worker._samples).
        job_batch = self.model.training.global_batch
        return self.model.batch(
            step, op.micro_batch, job_batch, self.gen.plan.micro_batch, self.state.device
        )

    def _expect(self, step: int) -> None:
        """Tells the data prefetcher the micro-batches this worker reads in `step` (if it was not
        told yet) and in the next."""
        expect_reads(self.gen, self.model, (step, step + 1))

    def _sync_gradients(self) -> None:
        """All-reduce SUM of each of this worker's SyncGroups, in round order."""
        self.synced_bytes = 0
        for index, group in sync_order(self.gen.plan):
            pg = self.gen.sync_groups.get(index)
            if pg is None:
                continue
            params = [p for j in group.layers for p in self.state.layer(j).params()]
            if not params:  # layers without parameters (every member holds the same ones)
                continue
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            self.synced_bytes += flat.numel() * flat.element_size()
            with communicating():
                pg.allreduce([flat]).wait()
            off = 0
            for p in params:
                assert p.grad is not None
                n = p.numel()
                p.grad.copy_(flat[off : off + n].view_as(p.grad))
                off += n
        sync_ties(self.gen, self.state)


def resume_step(plan: Plan, committed_step: int, attempt: int) -> int:
    """The step a worker expects to train first in a generation it builds: the one after its
    committed step, or after the checkpoint a restore plan loads (on the plan's first attempt: a
    later one finds the job past it). Its data is read while the generation builds."""
    if plan.restore_step is not None and attempt == 1:
        return plan.restore_step + 1
    return committed_step + 1


def expect_reads(gen: Generation, model: Trainable, steps: Sequence[int]) -> None:
    """Tells the data prefetcher the micro-batches `gen`'s worker reads in each of `steps`: one
    read per forward of a first stage (its inputs) or of a last stage (the loss's batch; a
    one-stage pipeline reads once)."""
    plan = gen.plan
    reads = [
        op.micro_batch
        for op in gen.ops
        if op.kind == FORWARD
        and (op.stage == 0 or op.stage == len(plan.pipelines[op.pipeline].stages) - 1)
    ]
    for s in steps:
        model.expect(s, reads, model.training.global_batch, plan.micro_batch)


def _message_structures(
    gen: Generation, outputs: Sequence[Structure]
) -> dict[MessageId, Structure]:
    """message -> structure of every activation this worker receives in a step: at the boundary
    after stage s, the output of stage s's last layer."""
    structures = {}
    for op in gen.ops:
        got = forward_input(op) if op.kind == FORWARD else None
        if got is not None:
            stages = gen.plan.pipelines[op.pipeline].stages
            structures[got[1]] = outputs[stages[op.stage - 1].layers[-1]]
    return structures


def _weighted(aux: torch.Tensor, samples: int) -> torch.Tensor:
    """An aux loss's share of the loss sum: aux * samples, in at least float32 (as adding it to
    a float32 loss in a one-process loop)."""
    return aux.to(torch.promote_types(aux.dtype, torch.float32)) * samples


def _grad_of(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t) if t.grad is None else t.grad


def _present(message: Message | None) -> Message:
    assert message is not None
    return message
