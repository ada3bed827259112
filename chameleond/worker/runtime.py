"""The worker's life: join the job (startup.py: spec, profile, register), then follow the plans
generation by generation.

    join -> (heartbeat, plan watch) -> for each plan including this worker:
      world group -> reconcile + migrate -> sync groups -> ack ready -> steps until a newer plan
    a fault in a generation -> discard the step, report the dead peer, wait for a newer plan
      (nobody dead: build the same generation again, attempt 2, 3, ...)
    this worker's own computation failed -> report itself, exit 7
    fenced (excluded by a plan) -> ack stopped, exit 0
    left out, not excluded (a drop plan's pipelines, spares) -> wait on standby for a plan

A step commits on every worker or on none: after the gradient sync, every worker of the plan joins
a vote (a SUM all-reduce of [loss, 1, newest plan generation seen, gradient sum of squares,
tokens]); only when the vote completes does a worker apply its update, clipped and (fp16)
unscaled or skipped as the vote's totals say (chameleond.worker.commit). The vote also carries
the newest generation anyone has seen, so all workers switch to a newer plan after the same step.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import redis
import torch

from chameleond.auth import Keyring
from chameleond.core.plan import Plan, check_batch
from chameleond.events import Ack, AckPhase, Profile, Step
from chameleond.protocol import Keys
from chameleond.worker import checkpoint
from chameleond.worker.absence import ABSENT_ATTEMPTS, Absences
from chameleond.worker.api import StepInfo, Training, TrainingOf
from chameleond.worker.backend import (
    CollectiveFailed,
    DeviceChoice,
    DeviceFailed,
    allreduce_sum,
    check_device_health,
    computing,
    wait_retired,
)
from chameleond.worker.commit import Commit, overflowed, seed
from chameleond.worker.evaluate import Evaluator
from chameleond.worker.events import (
    Heartbeat,
    PeerWatch,
    PlanWatcher,
    Reporter,
    dead_peers,
    gone,
    live_incarnations,
)
from chameleond.worker.gate import StepGate
from chameleond.worker.generation import Generation, GenerationAborted
from chameleond.worker.hooks import migration_hook, step_hook, vote_hook
from chameleond.worker.migrate import StateLost, reconcile
from chameleond.worker.outbox import OUTAGE_ERRORS, RedisUnreachable, through_outage
from chameleond.worker.profile import TrainingMeter
from chameleond.worker.rendezvous import BuiltWithoutMe, GenerationAbandoned
from chameleond.worker.saver import BUBBLE, Saver, Written
from chameleond.worker.startup import Joined, join
from chameleond.worker.state import WorkerState
from chameleond.worker.step import StepRunner, expect_reads, resume_step
from chameleond.worker.store import StoreAborted

log = logging.getLogger("chameleon.worker")
DRAIN_SECONDS = 5.0  # at exit, how long kept events may wait for Redis
# A generation that failed with nobody gone is built again after a pause: 0.1 s, doubling to 5 s.
RETRY_FIRST_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0
# The errors that mean a peer, a process group or Redis failed during a generation: the worker
# names the dead peers, or builds the generation again. Anything else is a bug (the worker's or
# the user's training) and ends the worker with its traceback instead of being retried forever.
FAULTS: tuple[type[BaseException], ...] = (
    CollectiveFailed,  # a collective, a point-to-point op or a group's set-up (backend.py)
    torch.distributed.DistError,  # torch's own: backend, network and store errors
    GenerationAborted,  # the groups were aborted: a peer is gone
    StoreAborted,
    RedisUnreachable,  # longer than a rendezvous may wait
)
# Those, and the ones follow_plans answers apart, that end a generation (their time is noted).
FAILS_GENERATION: tuple[type[BaseException], ...] = (*FAULTS, GenerationAbandoned, DeviceFailed)
# A worker's row of the commit vote: [loss sum, 1 (it voted), newest plan generation it has seen,
# sum of squares of the gradients it counts, tokens, samples read at its first stages, the sum of
# their ids] (chameleond.worker.commit).
VOTE_COLUMNS = 7


@dataclass(frozen=True)
class WorkerConfig:
    redis_url: str
    job: str
    worker_id: str
    device: DeviceChoice
    bind_address: str = "127.0.0.1"
    group_timeout: timedelta = timedelta(seconds=10)
    spec_timeout_seconds: float = 300.0
    # Test hook (docs/worker.md): "step:N" kills this process (SIGKILL) in the middle of step N,
    # "migration:G" in the middle of generation G's migration.
    kill_at: str = ""
    incarnation: str = ""  # this process among all processes of worker_id (events.py)
    max_steps: int = 0  # stop after committing step max_steps - 1; 0: train until fenced
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # steps between checkpoints; 0: none
    checkpoint_mode: str = BUBBLE  # record them in pipeline bubbles, or stop and write (SYNC)
    keyring: Keyring | None = None  # signs events, verifies plans and the spec (None: insecure)


class Fenced(Exception):
    """This worker must stop: the plans no longer include it."""


class PlanRejected(RuntimeError):
    """This worker cannot run the plan (it breaks a limit of the runtime, or gives this worker
    layers it cannot hold). Building it again would fail the same way, so the worker says so in a
    fault naming itself, and the daemon plans without it."""


class Finished(Exception):
    """The configured number of steps is committed."""


class WorkerRuntime:
    def __init__(
        self, cfg: WorkerConfig, client: redis.Redis, training: Training | TrainingOf
    ) -> None:
        self.cfg = cfg
        self.training = training
        self.redis = client
        self.keys = Keys(cfg.job)
        self.reporter = Reporter(client, cfg.job, cfg.worker_id, cfg.keyring)
        self.watcher = PlanWatcher(client, cfg.job, cfg.keyring, self.reporter.refused)
        self.heartbeat = Heartbeat(self.reporter)
        self.stopping = False
        self._last_liveness_check = 0.0
        self._failed_at = 0.0
        self._took_part = False  # some generation's rendezvous completed with this process
        self._member_of = 0  # the last generation whose rendezvous completed with this process
        self._peers: dict[str, str | None] = {}  # the current generation's members (incarnations)
        # Set at this process's first commit: the job has trained (see migrate.plan_moves).
        self.trained_key = self.keys.prefix + "workers:trained"
        self._marked_trained = False
        self._restored = 0  # the last `restore` plan whose checkpoint this process loaded
        self.absences = Absences()  # peers missing from the rendezvous (chameleond.worker.absence)
        self.saver: Saver | None = None  # with --checkpoint-every, once the model is known
        self.gate = StepGate.from_env(cfg.worker_id)  # `chameleonctl bench worker` only

    def run(self) -> int:
        cfg = self.cfg
        joined = join(
            self.redis, self.keys, self.reporter, cfg.device, cfg.bind_address,
            cfg.spec_timeout_seconds, self.training,
        )  # fmt: skip
        self.heartbeat.start()
        self.watcher.start()
        state = WorkerState(joined.model, cfg.device.torch_device)
        if cfg.checkpoint_dir is not None:
            checkpoint.load(cfg.checkpoint_dir, cfg.worker_id, state)
            if cfg.checkpoint_every:
                self.saver = Saver(
                    cfg.checkpoint_dir, cfg.worker_id, cfg.checkpoint_every,
                    self._checkpoint_written, cfg.checkpoint_mode,
                )  # fmt: skip
        try:
            code = self.follow_plans(state, joined)
        finally:
            if self.stopping and self._took_part:
                # Stopped by a signal: tell the daemon this worker left, so it is taken out of
                # the plans without being declared failed.
                left = Ack(cfg.worker_id, self._member_of, AckPhase.STOPPED, reason="left")
                self.reporter.report(left)
            joined.model.close()  # the data prefetch thread
            wait_retired(DRAIN_SECONDS)  # the last generation's groups, torn down
            self.heartbeat.stop()
            self.watcher.stop()
            for thread in (self.heartbeat, self.watcher):
                if thread.is_alive():
                    thread.join(timeout=2)
            unsent = self.reporter.close(DRAIN_SECONDS)
        if unsent:
            raise redis.ConnectionError(f"{unsent} events unsent after {DRAIN_SECONDS:g} s")
        return code

    # plans --------------------------------------------------------------------------------------

    def follow_plans(self, state: WorkerState, joined: Joined) -> int:
        """Run each newer plan that includes this worker. A generation that failed with nobody
        gone (a connection reset between live workers, a peer that gave the step up) brings no
        newer plan, since there is no one to exclude: it is built again (attempt 2, 3, ...,
        each on a fresh store prefix, after a short pause that doubles up to RETRY_MAX_SECONDS)
        until it trains or a newer plan supersedes it. Every member fails such a generation,
        since the failing worker's groups close, so they all meet in the same attempt."""
        me = self.cfg.worker_id
        seen, attempt = 0, 1
        retry: Plan | None = None
        while not self.stopping:
            if retry is not None:
                pause = min(RETRY_FIRST_SECONDS * 2 ** (attempt - 1), RETRY_MAX_SECONDS)
                newer = self.watcher.wait_newer(retry.generation, timeout=pause)
                plan, attempt = (newer, 1) if newer is not None else (retry, attempt + 1)
                retry = None
            else:
                found = self.watcher.wait_newer(seen, timeout=0.5)
                if found is None:
                    continue
                plan, attempt = found, 1
            seen = plan.generation
            # Fencing applies to a process that took part in an earlier generation. A new process
            # (a restart) finding itself excluded is a rejoin: its registration asks the daemon
            # to take it back, so it waits for a plan that includes it. So does a live worker a
            # plan leaves out without excluding it (a drop plan's dropped pipelines, a dynamic
            # plan's spares): the daemon keeps it on standby, and a later plan may take it back.
            if self._took_part and me in plan.excluded:
                self.reporter.report(Ack(me, plan.generation, AckPhase.STOPPED))
                log.info("fenced by generation %d: stopping", plan.generation)
                return 0
            if me not in plan.workers:
                log.info("generation %d leaves %s out: waiting on standby", plan.generation, me)
                continue
            try:
                self.run_generation(plan, state, joined, attempt)
            except Finished:
                done = Ack(me, plan.generation, AckPhase.STOPPED, reason="finished")
                self.reporter.report(done)
                log.info("step %d committed: finished", state.committed_step)
                return 0
            except GenerationAbandoned as e:
                if (
                    isinstance(e, BuiltWithoutMe)
                    or self.watcher.newest_generation > plan.generation
                ):
                    log.info("generation %d: %s", plan.generation, e)
                elif not self.on_fault(plan, state, e):
                    retry = plan
                    self.name_absent(plan, e.absent)
            except checkpoint.Unrestorable as e:
                log.error("generation %d cannot restore: %s", plan.generation, e)
                cause = str(e)[:500]
                lost = Ack(me, plan.generation, AckPhase.UNRESTORABLE, step=e.step, cause=cause)
                self.reporter.report(lost)
            except StateLost as e:
                log.error("generation %d cannot start: %s", plan.generation, e)
            except PlanRejected as e:
                log.error("generation %d: this worker cannot run the plan: %s", plan.generation, e)
                self.reporter.fault(
                    me, f"PlanRejected: {e}", generation=plan.generation, at=time.time()
                )
            except DeviceFailed as e:
                self.on_own_failure(plan, e)
                raise
            except FAULTS as e:
                if not self.on_fault(plan, state, e):
                    retry = plan
        return 0

    def on_own_failure(self, plan: Plan, error: DeviceFailed) -> None:
        """This worker's computation failed: nobody else is to blame. Its peers see only a
        broken group; this report names the worker and the real cause, and the worker leaves
        (its state is suspect), so the peers also find it gone."""
        detected = self._failed_at or time.time()
        log.error("generation %d: this worker's computation failed: %s", plan.generation, error)
        self.reporter.fault(self.cfg.worker_id, str(error), generation=plan.generation, at=detected)

    def on_fault(self, plan: Plan, state: WorkerState, error: BaseException) -> bool:
        """Discard the step and name the generation's dead peers in faults; False when none
        is found (the generation is then built again, see follow_plans). First make sure the
        error was not this worker's own device's, surfacing outside its computation."""
        try:
            check_device_health(self.cfg.device.torch_device)
        except DeviceFailed as own:
            self.on_own_failure(plan, own)
            raise
        detected = self._failed_at or time.time()
        self._failed_at = 0.0
        if state.pending_step is None:
            state.discard_step()
        peers = self._peers or {w: None for w in plan.workers if w != self.cfg.worker_id}
        t_close = time.time()
        dead = dead_peers(self.redis, self.cfg.job, peers)
        log.info(
            "groups closed %.3fs after the error; dead peers found in %.3fs",
            t_close - detected,
            time.time() - t_close,
        )
        cause = f"{type(error).__name__}: {error}"
        log.warning("generation %d failed (%s); dead peers: %s", plan.generation, cause, dead)
        for w in dead:
            self.reporter.fault(w, cause, generation=plan.generation, at=detected)
        if not dead:
            log.warning("no dead peer found: building generation %d again", plan.generation)
        return bool(dead)

    def name_absent(self, plan: Plan, absent: tuple[str, ...]) -> None:
        """Report the peers absent from ABSENT_ATTEMPTS attempts in a row of this generation."""
        me = self.cfg.worker_id
        peers = [w for w in plan.workers if w != me]
        for w in self.absences.abandoned(plan.generation, peers, absent):
            cause = (
                f"absent from {ABSENT_ATTEMPTS} rendezvous attempts of generation "
                f"{plan.generation} in a row: alive but not building it (hung?)"
            )
            log.warning("naming %s: %s", w, cause)
            self.reporter.fault(w, cause, generation=plan.generation, at=time.time())

    def _gone(self, gen: Generation) -> list[str]:
        """Members without a live process, checked at most every 0.1 s (one CLIENT LIST)."""
        now = time.monotonic()
        if now - self._last_liveness_check < 0.1:
            return []
        self._last_liveness_check = now
        try:
            return gone(live_incarnations(self.redis, self.cfg.job), gen.peers())
        except redis.exceptions.NoPermissionError as e:
            log.warning(
                "CLIENT LIST denied by the Redis ACL (%s): a failed peer is found by "
                "--group-timeout instead; allow +client|list (docs/worker.md)", e,
            )  # fmt: skip
            self._last_liveness_check = math.inf  # never asked again
            return []
        except OUTAGE_ERRORS:  # Redis away: no evidence against anyone
            return []

    def run_generation(
        self, plan: Plan, state: WorkerState, joined: Joined, attempt: int = 1
    ) -> None:
        cfg, me = self.cfg, self.cfg.worker_id
        t0 = time.perf_counter()
        self._peers = {}  # an earlier generation's peers are no evidence in this one
        try:
            problems = check_batch(plan, joined.spec.training)
            if problems:
                raise ValueError(f"plan generation {plan.generation}: {'; '.join(problems)}")
            gen = Generation.for_plan(plan, me, cfg.device, cfg.incarnation, attempt)
        except ValueError as e:
            raise PlanRejected(str(e)) from e
        # The data of the step this worker expects to resume at, read while the generation builds.
        expect_reads(gen, state.model, (resume_step(plan, state.committed_step, attempt),))

        def abort() -> None:
            gone_now = self._gone(gen)
            if gone_now:
                raise StoreAborted(f"peer(s) {', '.join(gone_now)} gone during rendezvous")

        def give_up() -> str | None:
            newest = self.watcher.newest_generation
            if newest > plan.generation:
                return f"superseded by generation {newest}"
            gone_now = self._gone(gen)
            return f"peer(s) {', '.join(gone_now)} gone" if gone_now else None

        connect = functools.partial(
            gen.connect, self.redis, bind_address=cfg.bind_address, timeout=cfg.group_timeout,
            abort=abort, give_up=give_up,
        )  # fmt: skip
        watch = None
        if cfg.device.backend != "gloo":  # see PeerWatch
            watch = PeerWatch(
                lambda: self._gone(gen),
                lambda peers: gen.abort(f"peer(s) {', '.join(peers)} gone"),
            )
            watch.start()
        try:
            connect(sync=False)
            self.absences.built(plan.generation)
            self._took_part = True
            self._member_of = plan.generation
            t_world = time.perf_counter()
            self._restore(plan, state)
            rec = reconcile(
                gen,
                state,
                job_trained=self._job_trained(),
                on_round=migration_hook(self.cfg.kill_at, plan.generation),
            )
            if rec.applied_pending is not None:
                # No step event: the step's loss is known only to the workers whose vote
                # completed, and they reported it.
                log.info(
                    "step %d committed late (generation %d)", rec.applied_pending, plan.generation
                )
            t_migrated = time.perf_counter()
            connect(sync=True)
            build = time.perf_counter() - t0
            ready = Ack(
                self.cfg.worker_id, plan.generation, AckPhase.READY, attempt,
                build_seconds=build, migration_seconds=t_migrated - t_world,
                world_seconds=t_world - t0, moves=len(rec.moves),
            )  # fmt: skip
            self.reporter.report(ready)
            log.info(
                "generation %d ready in %.3fs (%d layer moves), resuming at step %d%s",
                plan.generation,
                build,
                len(rec.moves),
                rec.committed_step + 1,
                f" (attempt {attempt})" if attempt > 1 else "",
            )
            if self.cfg.max_steps and rec.committed_step + 1 >= self.cfg.max_steps:
                raise Finished
            self._train(gen, state, joined, rec.committed_step + 1)
        except FAILS_GENERATION:
            self._failed_at = time.time()  # before the groups are torn down
            self._peers = gen.peers()
            raise
        finally:
            if watch is not None:
                watch.stop()
            gen.close()

    def _restore(self, plan: Plan, state: WorkerState) -> None:
        """A `restore` plan: load this worker's layers from the checkpoint it names, once per
        process (a later attempt of the same generation finds the job past that step; the
        reconciliation then brings this worker along like any other)."""
        if plan.restore_step is None or plan.generation == self._restored:
            return
        if self.cfg.checkpoint_dir is None:
            raise checkpoint.Unrestorable(
                plan.restore_step, "a restore plan needs the job's checkpoints: no --checkpoint-dir"
            )
        owned = plan.owned_layers(self.cfg.worker_id)
        checkpoint.restore(self.cfg.checkpoint_dir, state, plan.restore_step, owned)
        self._restored = plan.generation

    def _checkpoint_written(self, written: Written) -> None:
        self.reporter.report(written.event(self.cfg.worker_id))

    def _job_trained(self) -> bool:
        seconds = self.cfg.group_timeout.total_seconds()
        found = through_outage(lambda: self.redis.exists(self.trained_key), seconds, "reconcile")
        return bool(found)

    def _train(self, gen: Generation, state: WorkerState, joined: Joined, step: int) -> None:
        plan = gen.plan
        meter = TrainingMeter(
            joined.layers,
            state.device,
            plan.micro_batch,
            joined.host,
            joined.on_host(plan.workers),
            plan.generation,
        )
        runner = StepRunner(gen, state, joined.outputs, meter)
        evaluation = state.model.training.evaluation
        evaluator = None
        if evaluation is not None:
            evaluator = Evaluator(gen, state, joined.outputs, evaluation)
        owned = plan.owned_layers(gen.me)
        after_vote = vote_hook(self.cfg.kill_at)
        on_op = step_hook(self.cfg.kill_at)
        first = True
        saver = self.saver
        bubble = None if saver is None else saver.bubble
        try:
            while not self.stopping:
                if self.gate is not None:
                    self.gate.before(step)
                t0 = time.perf_counter()
                result = runner.run(step, on_op=on_op, bubble=bubble)
                state.mark_pending(step, result.layers)
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
                self._report_step(
                    gen, state, commit, (scale, lr), seconds, vote_seconds, runner.synced_bytes,
                    ids, eval_loss,
                )  # fmt: skip
                if first:
                    meter.restart()  # the first step pays for the generation's warm-up
                    first = False
                elif (profile := meter.step_done()) is not None:
                    self.reporter.report(Profile(self.cfg.worker_id, profile))
                if not self._marked_trained:
                    self.reporter.set_key(self.trained_key, "1")  # before any later fault report
                    self._marked_trained = True
                if saver is not None:
                    saver.observe(plan.generation, runner.waits, vote_seconds)
                    saver.committed(state, plan.generation, owned, gen.idle)
                step += 1
                if self.cfg.max_steps and step >= self.cfg.max_steps:
                    raise Finished
                if int(vote[:, 2].max().item()) > plan.generation:
                    return
        finally:
            if saver is not None:
                saver.flush()  # the checkpoint under way is of a committed step: finish it

    def _report_step(
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
    ) -> None:
        """The step event, and the training's `on_step` callback with the same figures."""
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
            self.cfg.worker_id, plan.generation, info.step, info.samples, seconds, info.loss,
            vote_seconds=vote_seconds, learning_rate=info.learning_rate, tokens=info.tokens,
            skipped_samples=info.skipped_samples, at=time.time(), eval_loss=eval_loss,
            grad_norm=info.grad_norm if math.isfinite(info.grad_norm) else None,
            overflow=fp16 and info.overflow, loss_scale=scale if fp16 else None,
        )  # fmt: skip
        self.reporter.report(event)
        if training.on_step is not None:
            training.on_step(info)
