"""The worker's life: join the job (startup.py: spec, profile, register), then follow the plans
generation by generation.

    join -> (heartbeat, plan watch) -> for each plan including this worker:
      run its generation (build.py: groups, migration, ready; loop.py: steps until a newer plan)
    a fault in a generation -> discard the step, report the dead peer, wait for a newer plan
      (nobody dead: build the same generation again, attempt 2, 3, ...; attribution.py)
    this worker's own computation failed -> report itself, DeviceFailed (exit 7)
    fenced (excluded by a plan) -> ack stopped, Ending.FENCED (exit 9 under `run`)
    finished (max_steps) or stopped -> with --checkpoint-dir, a checkpoint of the last committed
      step unless written already (`final_checkpoint`)
    left out, not excluded (a drop plan's pipelines, spares) -> wait on standby for a plan

A step commits on every worker or on none (loop.py, the commit vote).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from chameleond.core.plan import Plan
from chameleond.events import Ack, AckPhase
from chameleond.protocol import Keys, heartbeat_seconds
from chameleond.worker import _checkpoint as checkpoint
from chameleond.worker._attribution import FAULTS, Attribution
from chameleond.worker._backend import wait_retired
from chameleond.worker._build import GenerationRunner, PlanRejected
from chameleond.worker._config import WorkerConfig
from chameleond.worker._hooks import WorkerHooks
from chameleond.worker._link import Heartbeat, PlanWatcher, Reporter
from chameleond.worker._liveness import PeerNotices
from chameleond.worker._loop import Finished, StepLoop
from chameleond.worker._migrate import StateLost
from chameleond.worker._rendezvous import BuiltWithoutMe, GenerationAbandoned
from chameleond.worker._saver import Saver, Written
from chameleond.worker._startup import Joined, join
from chameleond.worker._state import WorkerState
from chameleond.worker.api import DeviceFailed, Ending, Training, TrainingOf, TrainingResult

log = logging.getLogger("chameleon.worker")
DRAIN_SECONDS = 5.0  # at exit, how long kept events may wait for Redis
# A generation that failed with nobody gone is built again after a pause: 0.1 s, doubling to 5 s.
RETRY_FIRST_SECONDS = 0.1
RETRY_MAX_SECONDS = 5.0


class WorkerRuntime:
    """One worker process in its job: joins, follows the plans, and leaves; `hooks` are the test
    and bench hooks (none under `train`), `stop` ends it after the step under way."""

    def __init__(
        self,
        cfg: WorkerConfig,
        client: redis.Redis,
        training: Training | TrainingOf,
        hooks: WorkerHooks,
        stop: threading.Event,
    ) -> None:
        self.cfg = cfg
        self.training = training
        self.redis = client
        self.hooks = hooks
        self.stop = stop  # set: leave the job after the step under way
        self.keys = Keys(cfg.job)
        self.reporter = Reporter(client, cfg.job, cfg.worker_id, cfg.keyring)
        notices = PeerNotices(cfg.job, cfg.keyring)
        self.watcher = PlanWatcher(client, cfg.job, cfg.keyring, self.reporter.refused, notices)
        self.heartbeat = Heartbeat(self.reporter)
        self.attribution = Attribution(notices, cfg.worker_id, cfg.device, self.reporter)
        # Set at this process's first commit: the job has trained (see migrate.plan_moves).
        self.trained_key = self.keys.prefix + "workers:trained"

    def run(self) -> TrainingResult:
        cfg = self.cfg
        joined = join(
            self.redis, self.keys, self.reporter, cfg.device, cfg.bind_address,
            cfg.spec_timeout_seconds, self.training,
        )  # fmt: skip
        self.heartbeat.period = heartbeat_seconds(len(joined.spec.workers))
        self.heartbeat.start()
        self.watcher.start()
        state = WorkerState(joined.model, cfg.device.torch_device)
        saver = None
        if cfg.checkpoint_dir is not None:
            checkpoint.load(cfg.checkpoint_dir, cfg.worker_id, state)
            if cfg.checkpoint_every:
                saver = Saver(
                    cfg.checkpoint_dir, cfg.worker_id, cfg.checkpoint_every,
                    self._checkpoint_written, cfg.checkpoint_mode, cfg.checkpoint_keep,
                )  # fmt: skip
        steps = StepLoop(
            cfg.worker_id, cfg.max_steps, self.reporter, self.watcher, self.hooks, self.stop,
            self.trained_key, saver,
        )  # fmt: skip
        generations = GenerationRunner(
            cfg, self.redis, self.reporter, self.watcher, self.attribution, self.hooks, steps
        )
        try:
            ending = self.follow_plans(state, joined, generations)
            if ending in (Ending.FINISHED, Ending.STOPPED):
                self.final_checkpoint(state, generations.member_of)
        except BaseException:
            # A signal handler's exception (chameleon-worker's SIGTERM) stops training where it
            # is, after setting `stop`.
            if self.stop.is_set():
                # An update may have been under way unless the step loop says it had not begun.
                unsafe = state.pending_step is not None and not steps.update_due
                self.final_checkpoint(state, generations.member_of, unsafe=unsafe)
            raise
        finally:
            if self.stop.is_set() and generations.following:
                # Stopped: tell the daemon this worker left the plan it was in (or building), so
                # it is taken out of the plans without being declared failed.
                left = Ack(cfg.worker_id, generations.following, AckPhase.STOPPED, reason="left")
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
        return TrainingResult(ending, state.committed_step, generations.member_of)

    def follow_plans(
        self, state: WorkerState, joined: Joined, generations: GenerationRunner
    ) -> Ending:
        """Run each newer plan that includes this worker. A generation that failed with nobody
        gone (a connection reset between live workers, a peer that gave the step up) brings no
        newer plan, since there is no one to exclude: it is built again (attempt 2, 3, ...,
        each on a fresh store prefix, after a short pause that doubles up to RETRY_MAX_SECONDS)
        until it trains or a newer plan supersedes it. Every member fails such a generation,
        since the failing worker's groups close, so they all meet in the same attempt."""
        me = self.cfg.worker_id
        blame = self.attribution
        seen, attempt = 0, 1
        retry: Plan | None = None
        while not self.stop.is_set():
            if retry is not None:
                pause = min(RETRY_FIRST_SECONDS * 2 ** (attempt - 1), RETRY_MAX_SECONDS)
                newer = self.watcher.wait_newer(retry.generation, timeout=pause)
                plan, attempt = (newer, 1) if newer is not None else (retry, attempt + 1)
                retry = None
            else:
                found = self.watcher.wait_newer(seen, timeout=0.5)
                if found is None:
                    blame.overdue(self.watcher.newest_generation)
                    continue
                plan, attempt = found, 1
            seen = plan.generation
            # Fencing applies to a process that took part in an earlier generation. A new process
            # (a restart) finding itself excluded is a rejoin: its registration asks the daemon
            # to take it back, so it waits for a plan that includes it. So does a live worker a
            # plan leaves out without excluding it (a drop plan's dropped pipelines, a dynamic
            # plan's spares): the daemon keeps it on standby, and a later plan may take it back.
            if generations.took_part and me in plan.excluded:
                self.reporter.report(Ack(me, plan.generation, AckPhase.STOPPED))
                log.info("fenced by generation %d: stopping", plan.generation)
                return Ending.FENCED
            if me not in plan.workers or me in plan.excluded:
                log.info("generation %d leaves %s out: waiting on standby", plan.generation, me)
                continue
            try:
                generations.run(plan, state, joined, attempt)
            except Finished:
                done = Ack(me, plan.generation, AckPhase.STOPPED, reason="finished")
                self.reporter.report(done)
                log.info("step %d committed: finished", state.committed_step)
                return Ending.FINISHED
            except GenerationAbandoned as e:
                if (
                    isinstance(e, BuiltWithoutMe)
                    or self.watcher.newest_generation > plan.generation
                ):
                    log.info("generation %d: %s", plan.generation, e)
                elif not blame.fault(plan, state, e):
                    retry = plan
                    blame.name_absent(plan, e.absent)
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
                blame.own_failure(plan, e)
                raise
            except FAULTS as e:
                if not blame.fault(plan, state, e):
                    retry = plan
        return Ending.STOPPED

    def final_checkpoint(self, state: WorkerState, generation: int, unsafe: bool = False) -> None:
        """Training ended (finished or stopped): with a checkpoint directory, write the layers
        held at the last committed step, now, unless that step's file is written already, and
        report it (a `checkpoint` event). Only layers whose state is that step's are written;
        nothing when no step has committed, nor when `unsafe`: training was cut (a signal) while
        an update may have been under way, leaving a layer half updated."""
        directory, step = self.cfg.checkpoint_dir, state.committed_step
        if directory is None or step < 0:
            return
        if unsafe:
            log.warning("stopped while an update may have been under way: no final checkpoint")
            return
        if checkpoint.checkpoint_path(directory, self.cfg.worker_id, step).exists():
            return
        layers = tuple(i for i in sorted(state.layers) if state.layers[i].version == step)
        if not layers:
            return
        t0 = time.perf_counter()
        try:
            out, pieces = checkpoint.open_layers(
                directory, self.cfg.worker_id, state, layers, self.cfg.checkpoint_keep
            )
        except (OSError, ValueError) as e:
            log.error("final checkpoint of step %d not begun: %s", step, e)
            return
        try:
            for piece in pieces:
                out.write(piece)
            out.commit()
        except OSError as e:
            out.abort()
            log.error("final checkpoint of step %d not written: %s", step, e)
            return
        log.info("wrote the final checkpoint of step %d: layers %s", step, list(layers))
        seconds = time.perf_counter() - t0
        self._checkpoint_written(Written(step, generation, layers, out.nbytes, 0.0, seconds))

    def _checkpoint_written(self, written: Written) -> None:
        self.reporter.report(written.event(self.cfg.worker_id))
