"""One training step of one worker under a plan: its 1F1B ops, then the gradient sync rounds.

Ops run in the generation's order, a linear extension of the step's dependency graph
(chameleond.core.schedule). Messages go out in the generation's batches (chameleond.worker._p2p): an
op's output waits in an outbox until its batch is issued, a receive is posted with its batch and
waited for just before the op that uses it. Under rerouting a worker's op list holds ops of several
pipelines (the failed slot's micro-batches), so activations and gradients cross pipelines;
everything is keyed by (pipeline, stage, micro-batch). Each message has the fixed shape and dtype of
the output of its boundary's layer (chameleond.worker._validate) and is named by its MessageId
(kind, pipeline, stage boundary, micro-batch) here only: on the wire it is matched by the order of
the batches (chameleond.worker._p2p). Stage 0 reads its micro-batch's inputs, the last stage the
same batch for the user's loss (chameleond.worker._trainable: sample ids, collate, per-sample
losses).

Gradients accumulate as SUMs over every micro-batch a worker executes for a layer; each SyncGroup
all-reduces (SUM) its layers' gradients over the owners, in the plan's colouring rounds; then tied
parameters add their two layers' sums (chameleond.worker._ties). The division by the plan's global
batch (the samples its steps train: B, or fewer under a drop plan) happens once, at commit
(LayerState.apply_update), with the clipping factor and the fp16 overflow decision the commit vote
gives every worker alike (chameleond.worker._commit): this step contributes the sum of squares of
the gradients of the layers this worker is the first owner of, and the tokens of its stage-0
micro-batches.

Forwards (layers and loss) run under the training's autocast (bf16, fp16); in fp16 the loss sum's
backward starts from the layers' loss scale over the step's samples (commit.seed). Only trainable
parameters have gradients: frozen ones (a LoRA model's base weights) are neither synced nor
counted."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chameleond.core.plan import Plan
from chameleond.core.schedule import FORWARD, Op
from chameleond.worker._backend import P2POp, communicating, computing, exchange
from chameleond.worker._generation import Generation, sync_order
from chameleond.worker._layer import run_layers
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
from chameleond.worker._validate import Output


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
        outputs: Sequence[Output],
        meter: TrainingMeter | None = None,
    ) -> None:
        self.gen = gen
        self.state = state
        self.model = state.model
        self.meter = meter  # measures each op for the in-training profile
        self._shapes = _message_shapes(gen, outputs)
        self._outbox: dict[MessageId, torch.Tensor] = {}  # computed, waiting for their batch
        self._inbox: dict[MessageId, tuple[Any, torch.Tensor]] = {}  # posted receives
        self._sent: list[tuple[Any, torch.Tensor]] = []
        self._local: dict[MessageId, torch.Tensor] = {}  # messages to itself
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

    def _send(self, tensor: torch.Tensor, peer: str, message: MessageId) -> None:
        t = tensor.detach().contiguous()
        if peer == self.gen.me:
            self._local[message] = t
        else:
            self._outbox[message] = t  # sent with its batch

    def _recv(self, peer: str, message: MessageId) -> torch.Tensor:
        if peer == self.gen.me:
            return self._local.pop(message)
        posted = self._inbox.pop(message, None)
        if posted is None:
            raise RuntimeError(f"receive of {message} from {peer} is in no batch before it")
        work, buf = posted
        with communicating():
            work.wait()
        return buf

    def _issue(self, batch: Batch) -> None:
        ops: list[P2POp] = []
        for end in batch.endpoints:
            if end.send:
                tensor = self._outbox.pop(end.message)
            else:
                shape, dtype = self._shapes[end.message]
                tensor = torch.empty(shape, dtype=dtype, device=self.state.device)
            ops.append((end.send, tensor, self.gen.rank_of(end.peer)))
        works = exchange(self.gen.world_group, ops)  # in the batch's order: the pair's order
        for end, (_, tensor, _), work in zip(batch.endpoints, ops, works, strict=True):
            if end.send:
                self._sent.append((work, tensor))  # the tensor must outlive the send
            else:
                self._inbox[end.message] = (work, tensor)

    # the step ---------------------------------------------------------------------------------

    def run(self, step: int, on_op: Any = None, bubble: Any = None) -> StepResult:
        """`bubble(i)`, if given, is called where the op order's timeline has this worker idle
        before op i (i = number of ops: after the last): once the op's batches are issued, before
        it waits for its input (chameleond.worker._saver)."""
        try:
            return self._run(step, on_op, bubble)
        finally:
            # Pending transfers hold the group; a failed step must not keep it (and its sockets)
            # open.
            for box in (self._outbox, self._inbox, self._sent, self._local):
                box.clear()

    def _run(self, step: int, on_op: Any, bubble: Any) -> StepResult:
        plan, st = self.gen.plan, self.state
        self._expect(step)
        dev = st.device
        stash: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
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
                    x = self.model.inputs(data)
                    first_stage.append(op.micro_batch)
                else:
                    x = self._recv(*_present(forward_input(op))).requires_grad_()
                self._inputs_ready(i)
                with computing(), autocast:
                    out = run_layers(layers, x)
                    if last:
                        if data is None:
                            data = self._batch(op, step)
                        out = self.model.loss_sum(out, data, plan.micro_batch)
                        loss_sum += out.detach().double()
                if not last:
                    self._send(out, *_present(forward_output(op, len(stages))))
                stash[key] = (x, out)
            else:
                x, out = stash.pop(key)
                grad_in = backward_input(op, len(stages))
                grad = None if grad_in is None else self._recv(*grad_in)  # None: from the loss
                if grad is None and seed != 1.0:
                    grad = torch.full_like(out, seed)  # fp16: the scaled loss's backward
                self._inputs_ready(i)
                with computing():
                    if out.requires_grad:  # not: a first stage whose parameters are all frozen
                        out.backward(grad)
                grad_out = backward_output(op)
                if grad_out is not None:
                    assert x.grad is not None
                    self._send(x.grad, *grad_out)
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
        if stash or self._outbox or self._inbox:
            raise RuntimeError(
                f"step {step}: {len(stash)} forwards without a backward, {len(self._outbox)} "
                f"outputs not sent, {len(self._inbox)} messages received for no op"
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


def _message_shapes(
    gen: Generation, outputs: Sequence[Output]
) -> dict[MessageId, tuple[tuple[int, ...], torch.dtype]]:
    """message -> (shape, dtype) of every message this worker receives in a step: an activation, or
    its gradient, at the boundary after stage s is the output of stage s's last layer."""
    shapes = {}
    for op in gen.ops:
        stages = gen.plan.pipelines[op.pipeline].stages
        if op.kind == FORWARD:
            got, boundary = forward_input(op), op.stage - 1
        else:
            got, boundary = backward_input(op, len(stages)), op.stage
        if got is not None:
            out = outputs[stages[boundary].layers[-1]]
            shapes[got[1]] = (out.shape, out.dtype)
    return shapes


def _present(message: Message | None) -> Message:
    assert message is not None
    return message
