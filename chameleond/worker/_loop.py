"""The step loop of one generation, and the commit vote that makes each step all-or-nothing.

After the gradient sync, every worker of the plan joins a vote (a SUM all-reduce of one row per
worker, VOTE_COLUMNS wide); only when the vote completes does a worker apply its update, clipped
and (fp16) unscaled or skipped as the vote's totals say (chameleond.worker._commit). The vote also
carries the newest generation anyone has seen, so all workers switch to a newer plan after the
same step.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import torch

from chameleond.events import Profile, Step
from chameleond.protocol import step_reported
from chameleond.worker._backend import allreduce_sum, computing
from chameleond.worker._commit import Commit, overflowed, seed
from chameleond.worker._evaluate import Evaluator
from chameleond.worker._generation import Generation
from chameleond.worker._hooks import WorkerHooks, step_hook, vote_hook
from chameleond.worker._link import PlanWatcher, Reporter
from chameleond.worker._profile import TrainingMeter
from chameleond.worker._saver import Saver
from chameleond.worker._startup import Joined
from chameleond.worker._state import WorkerState
from chameleond.worker._step import StepRunner
from chameleond.worker.api import StepInfo

log = logging.getLogger("chameleon.worker")
# A worker's row of the commit vote: [loss sum, 1 (it voted), newest plan generation it has seen,
# sum of squares of the gradients it counts, tokens, samples read at its first stages, the sum of
# their ids] (chameleond.worker._commit).
VOTE_COLUMNS = 7


class Finished(Exception):
    """The configured number of steps is committed."""


class StepLoop:
    """Trains a generation's steps, commits each by vote, and reports it (a `step` event and
    the training's `on_step`)."""

    def __init__(
        self,
        me: str,
        max_steps: int,
        reporter: Reporter,
        watcher: PlanWatcher,
        hooks: WorkerHooks,
        stop: threading.Event,
        trained_key: str,
        saver: Saver | None,
    ) -> None:
        self.me = me
        self.max_steps = max_steps  # 0: until fenced
        self.reporter = reporter
        self.watcher = watcher
        self.hooks = hooks
        self.stop = stop
        self.trained_key = trained_key  # set at this process's first commit: the job has trained
        self.saver = saver
        self._marked_trained = False
        # A step's gradients are summed and its update has not begun: the layers are still the
        # committed step's, though an update is pending (read when a signal cuts training).
        self.update_due = False

    def run(self, gen: Generation, state: WorkerState, joined: Joined, step: int) -> None:
        """Train from `step` until a vote shows a newer plan; Finished at `max_steps`."""
        plan = gen.plan
        meter = TrainingMeter(
            joined.layers,
            state.device,
            plan.micro_batch,
            joined.host,
            joined.on_host(plan.workers),
            plan.generation,
            gen.me,
            len(plan.members),
        )
        runner = StepRunner(gen, state, joined.outputs, meter)
        evaluation = state.model.training.evaluation
        evaluator = None
        if evaluation is not None:
            evaluator = Evaluator(gen, state, joined.outputs, evaluation)
        owned = plan.owned_layers(gen.me)
        after_vote = vote_hook(self.hooks.kill_at)
        on_op = step_hook(self.hooks.kill_at)
        before_step = self.hooks.before_step
        first = True
        saver = self.saver
        bubble = None if saver is None else saver.bubble
        try:
            while not self.stop.is_set():
                if before_step is not None:
                    before_step(step)
                t0 = time.perf_counter()
                result = runner.run(step, on_op=on_op, bubble=bubble)
                state.mark_pending(step, result.layers)
                self.update_due = True
                ids = state.model.read_ids(step, result.first_stage)
                vote = torch.zeros((len(gen.world), VOTE_COLUMNS), dtype=torch.float64)
                vote[gen.rank] = torch.tensor(
                    [
                        result.loss_sum,
                        1.0,
                        float(self.watcher.newest_generation),
                        result.grad_sq,
                        float(result.tokens),
                        float(len(ids)),
                        float(sum(ids)),
                    ],
                    dtype=torch.float64,
                )
                voted = time.perf_counter()
                vote = allreduce_sum(gen.world_group, vote, state.device)
                gen.check()
                if after_vote is not None:
                    after_vote(step)
                vote_seconds = time.perf_counter() - voted
                meter.vote(vote_seconds)
                grad_sq = float(vote[:, 3].sum().item())
                commit = Commit(
                    step,
                    loss_sum=float(vote[:, 0].sum().item()),
                    grad_sq=grad_sq,
                    tokens=int(vote[:, 4].sum().item()),
                    overflow=overflowed(grad_sq, state.model.training.precision == "fp16"),
                    samples_read=int(vote[:, 5].sum().item()),
                    sample_id_sum=int(vote[:, 6].sum().item()),
                )
                if saver is not None:
                    saver.flush()  # the update changes what it writes: finish it first
                scale = state.loss_scale()  # the step's, before the update moves them
                lr = state.learning_rate()
                meter.begin()
                self.update_due = False
                with computing():
                    state.apply_pending(plan.global_batch, commit)
                meter.update(result.layers)
                seconds = time.perf_counter() - t0
                if first:
                    dropped = state.drop_except(owned)
                    if dropped:
                        log.info("dropped layers %s: their new owners committed a step", dropped)
                eval_loss = None
                if evaluator is not None and evaluator.due(step):
                    eval_loss = evaluator.run_all()
                self._report(
                    gen, state, commit, (scale, lr), seconds, vote_seconds, runner.synced_bytes,
                    ids, eval_loss, first,
                )  # fmt: skip
                if first:
                    meter.restart()  # the first step pays for the generation's warm-up
                    first = False
                elif (profile := meter.step_done()) is not None:
                    if gen.links:
                        profile["links"] = gen.links
                    self.reporter.report(Profile(self.me, profile))
                if not self._marked_trained:
                    self.reporter.set_key(self.trained_key, "1")  # before any later fault report
                    self._marked_trained = True
                if saver is not None:
                    saver.observe(plan.generation, runner.waits, vote_seconds)
                    saver.committed(state, plan.generation, owned, gen.idle)
                step += 1
                if self.max_steps and step >= self.max_steps:
                    raise Finished
                if int(vote[:, 2].max().item()) > plan.generation:
                    return
        finally:
            self.update_due = False
            if saver is not None:
                saver.flush()  # the checkpoint under way is of a committed step: finish it

    def _report(
        self,
        gen: Generation,
        state: WorkerState,
        commit: Commit,
        scale_lr: tuple[float, float],
        seconds: float,
        vote_seconds: float,
        synced_bytes: int,
        sample_ids: tuple[int, ...],
        eval_loss: float | None,
        first: bool,
    ) -> None:
        """The step event (in a large job only every few steps beyond the plan's `first`:
        protocol.step_reported), and the training's `on_step` callback with the same figures."""
        plan = gen.plan
        training = state.model.training
        scale, lr = scale_lr
        state_seed = seed(scale if training.precision == "fp16" else None, plan.global_batch)
        data = state.model.data_stats()
        info = StepInfo(
            step=commit.step,
            generation=plan.generation,
            worker=gen.me,
            rank=gen.rank,
            loss=commit.loss_sum / plan.global_batch,
            grad_norm=commit.grad_norm(plan.global_batch, state_seed),
            learning_rate=lr,
            samples=plan.global_batch,  # trained this step: B, or fewer under a drop plan
            skipped_samples=training.global_batch - plan.global_batch,
            tokens=commit.tokens,
            seconds=seconds,
            overflow=commit.overflow,
            loss_scale=scale,
            synced_bytes=synced_bytes,
            sample_ids=sample_ids,
            step_samples=commit.samples_read,
            step_sample_id_sum=commit.sample_id_sum,
            data_overlap=data["overlap"] if data["prepare_seconds"] > 0 else None,
            eval_loss=eval_loss,
        )
        fp16 = training.precision == "fp16"
        event = Step(
            self.me, plan.generation, info.step, info.samples, seconds, info.loss,
            vote_seconds=vote_seconds, learning_rate=info.learning_rate, tokens=info.tokens,
            skipped_samples=info.skipped_samples, at=time.time(), eval_loss=eval_loss,
            grad_norm=info.grad_norm if math.isfinite(info.grad_norm) else None,
            overflow=fp16 and info.overflow, loss_scale=scale if fp16 else None,
        )  # fmt: skip
        if (
            first
            or eval_loss is not None
            or step_reported(self.me, info.step, len(plan.members), seconds)
        ):
            self.reporter.report(event)
        if training.on_step is not None:
            training.on_step(info)
