"""A held-out loss every N committed steps (`Training.evaluation`): the forward half of a step, on
the held-out data, through the plan's pipelines.

The evaluation runs the generation's op order without its backwards, and its point-to-point batches
without their gradient messages. Every worker filters alike, so between any two workers the sends
of one side are still the receives of the other in one order, and a forward never waits for a
backward, so the filtered order runs as the step's does. Evaluation step k reads the held-out
samples [k*B, (k+1)*B) in training's micro-batch layout (B the job's global batch; a `drop` plan
evaluates the micro-batches it trains); each worker sums the per-sample losses of the micro-batches
whose last stage it runs, and the aux losses its layers return (`aux_loss * samples`, as training
adds them), and one all-reduce over the world gives every worker the mean. Layers
run in eval mode (dropout off), without gradients, in the training's precision. A fault during an
evaluation fails the generation as a fault in a step does: the committed step stands, and that
evaluation is not made again. The held-out activations must have the training's structure and
dtypes at every boundary; their shapes may differ (chameleond.worker._activation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch

from chameleond.core.schedule import FORWARD
from chameleond.worker._activation import Structure, run_stage
from chameleond.worker._backend import allreduce_sum, computing
from chameleond.worker._generation import Generation
from chameleond.worker._p2p import Batch, forward_input, forward_output
from chameleond.worker._state import WorkerState
from chameleond.worker._step import StepRunner, _present, _weighted
from chameleond.worker._trainable import to_device
from chameleond.worker.api import Evaluation


def forward_only(gen: Generation) -> Generation:
    """`gen` with its forwards only: the backward ops and the gradient messages left out, each
    batch issued after the same forwards as in the step."""
    kept = [i for i, op in enumerate(gen.ops) if op.kind == FORWARD]
    before = [sum(1 for i in kept if i < n) for n in range(len(gen.ops) + 1)]
    batches = []
    for b in gen.batches:
        ends = tuple(e for e in b.endpoints if e.message.kind == FORWARD)
        if ends:
            batches.append(Batch(before[b.before], ends))
    return dataclasses.replace(gen, ops=[gen.ops[i] for i in kept], batches=batches, idle=[])


class Evaluator(StepRunner):
    def __init__(
        self,
        gen: Generation,
        state: WorkerState,
        outputs: Sequence[Structure],
        evaluation: Evaluation,
    ) -> None:
        super().__init__(forward_only(gen), state, outputs)
        self.evaluation = evaluation
        self.steps = state.model.evaluation_steps()

    def due(self, step: int) -> bool:
        """Whether an evaluation follows committed step `step`."""
        return (step + 1) % self.evaluation.every == 0

    def run_all(self) -> float:
        """The mean per-sample loss over the held-out set, the same on every worker."""
        held = list(self.state.layers.values())
        for layer in held:
            layer.module.eval()
        try:
            with torch.no_grad():
                mine = sum(self._forwards(k) for k in range(self.steps))
        finally:
            for layer in held:
                layer.module.train()
        total = torch.zeros((len(self.gen.world), 1), dtype=torch.float64)
        total[self.gen.rank, 0] = mine
        total = allreduce_sum(self.gen.world_group, total, self.state.device)
        self.gen.check()
        return float(total.sum().item()) / (self.steps * self.gen.plan.global_batch)

    def _forwards(self, k: int) -> float:
        plan, st = self.gen.plan, self.state
        autocast = self.model.autocast(st.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=st.device)
        batches = iter(self.gen.batches)
        batch = next(batches, None)
        try:
            for i, op in enumerate(self.gen.ops):
                while batch is not None and batch.before <= i:
                    self._issue(batch)
                    batch = next(batches, None)
                self._receives.poll()
                stages = plan.pipelines[op.pipeline].stages
                layers = [st.layer(j) for j in stages[op.stage].layers]
                last = op.stage == len(stages) - 1
                data = self._held_out(k, op.micro_batch) if op.stage == 0 or last else None
                if op.stage == 0:
                    x = cast(Any, self.model.inputs(data))
                else:
                    x = self._recv_forward(*_present(forward_input(op)), grad=False)
                with computing(), autocast:
                    out, aux = run_stage([layer.module for layer in layers], x)
                    if aux is not None:
                        loss_sum += _weighted(aux, plan.micro_batch).double()
                    if last:
                        loss_sum += self.model.loss_sum(out, data, plan.micro_batch).double()
                if not last:
                    layer = stages[op.stage].layers[-1]
                    self._send_forward(out, layer, *_present(forward_output(op, len(stages))))
            while batch is not None:
                self._issue(batch)
                batch = next(batches, None)
            for work, _ in self._sent:
                work.wait()
            return float(loss_sum.item())
        finally:
            self._clear()

    def _held_out(self, k: int, micro_batch: int) -> object:
        b = self.gen.plan.micro_batch
        first = k * self.model.training.global_batch + micro_batch * b
        data = self.evaluation.dataset
        samples = [data[i] for i in range(first, first + b)]
        return to_device(self.model.training.collate(samples), self.state.device)
