"""One plan generation on one worker: build its groups, bring the layers where the plan puts
them, say it is ready, then train its steps.

    world group -> restore (a `restore` plan) -> reconcile + migrate -> sync groups
      -> link probe (chameleond.worker._linkprobe) -> ack ready
      -> the step loop (chameleond.worker._loop) until a newer plan

A generation that fails notes when and with whom (chameleond.worker._attribution) before its
groups are torn down; the plan follower (chameleond.worker._runtime) decides what follows.
"""

from __future__ import annotations

import functools
import logging
import time

import redis

from chameleond.core.plan import Plan, check_batch
from chameleond.events import Ack, AckPhase
from chameleond.worker import _checkpoint as checkpoint
from chameleond.worker._attribution import FAILS_GENERATION, Attribution
from chameleond.worker._config import WorkerConfig
from chameleond.worker._generation import Generation
from chameleond.worker._hooks import WorkerHooks, migration_hook
from chameleond.worker._link import PlanWatcher, Reporter
from chameleond.worker._linkprobe import probe_links
from chameleond.worker._liveness import PeerWatch
from chameleond.worker._loop import Finished, StepLoop
from chameleond.worker._migrate import reconcile
from chameleond.worker._outbox import through_outage
from chameleond.worker._startup import Joined
from chameleond.worker._state import WorkerState
from chameleond.worker._step import expect_reads, resume_step
from chameleond.worker._store import StoreAborted

log = logging.getLogger("chameleon.worker")


class PlanRejected(RuntimeError):
    """This worker cannot run the plan (it breaks a limit of the runtime, or gives this worker
    layers it cannot hold). Building it again would fail the same way, so the worker says so in a
    fault naming itself, and the daemon plans without it."""


class GenerationRunner:
    """Runs the generations of one worker process, one at a time."""

    def __init__(
        self,
        cfg: WorkerConfig,
        client: redis.Redis,
        reporter: Reporter,
        watcher: PlanWatcher,
        attribution: Attribution,
        hooks: WorkerHooks,
        steps: StepLoop,
    ) -> None:
        self.cfg = cfg
        self.redis = client
        self.reporter = reporter
        self.watcher = watcher
        self.attribution = attribution
        self.hooks = hooks
        self.steps = steps
        self.took_part = False  # some generation's rendezvous completed with this process
        self.member_of = 0  # the last generation whose rendezvous completed with this process
        self.following = 0  # the newest generation this process set out to build
        self._restored = 0  # the last `restore` plan whose checkpoint this process loaded

    def run(self, plan: Plan, state: WorkerState, joined: Joined, attempt: int = 1) -> None:
        """Build `plan`'s generation (its attempt `attempt`) and train in it until a newer plan;
        Finished at the configured steps, PlanRejected when this worker cannot run it."""
        cfg, me = self.cfg, self.cfg.worker_id
        t0 = time.perf_counter()
        self.following = plan.generation
        self.attribution.started()
        try:
            problems = check_batch(plan, joined.spec.training)
            if problems:
                raise ValueError(f"plan generation {plan.generation}: {'; '.join(problems)}")
            gen = Generation.for_plan(plan, me, cfg.device, cfg.incarnation, attempt)
        except ValueError as e:
            raise PlanRejected(str(e)) from e
        # The data of the step this worker expects to resume at, read while the generation builds.
        expect_reads(gen, state.model, (resume_step(plan, state.committed_step, attempt),))
        gone = self.attribution.gone

        def abort() -> None:
            gone_now = gone(gen)
            if gone_now:
                raise StoreAborted(f"peer(s) {', '.join(gone_now)} gone during rendezvous")

        def give_up() -> str | None:
            newest = self.watcher.newest_generation
            if newest > plan.generation:
                return f"superseded by generation {newest}"
            gone_now = gone(gen)
            return f"peer(s) {', '.join(gone_now)} gone" if gone_now else None

        connect = functools.partial(
            gen.connect, self.redis, bind_address=cfg.bind_address, timeout=cfg.group_timeout,
            abort=abort, give_up=give_up,
        )  # fmt: skip
        watch = None
        if cfg.device.backend != "gloo":  # see PeerWatch
            watch = PeerWatch(
                lambda: gone(gen),
                lambda peers: gen.abort(f"peer(s) {', '.join(peers)} gone"),
            )
            watch.start()
        try:
            connect(sync=False)
            self.attribution.absences.built(plan.generation)
            self.took_part = True
            self.member_of = plan.generation
            t_world = time.perf_counter()
            self._restore(plan, state)
            rec = reconcile(
                gen,
                state,
                job_trained=self._job_trained(),
                on_round=migration_hook(self.hooks.kill_at, plan.generation),
            )
            if rec.applied_pending is not None:
                # No step event: the step's loss is known only to the workers whose vote
                # completed, and they reported it.
                log.info(
                    "step %d committed late (generation %d)", rec.applied_pending, plan.generation
                )
            t_migrated = time.perf_counter()
            connect(sync=True)
            gen.links = probe_links(gen)
            build = time.perf_counter() - t0
            ready = Ack(
                me, plan.generation, AckPhase.READY, attempt,
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
            if cfg.max_steps and rec.committed_step + 1 >= cfg.max_steps:
                raise Finished
            self.steps.run(gen, state, joined, rec.committed_step + 1)
        except FAILS_GENERATION:
            self.attribution.failed(gen)  # before the groups are torn down
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

    def _job_trained(self) -> bool:
        seconds = self.cfg.group_timeout.total_seconds()
        key = self.steps.trained_key
        found = through_outage(lambda: self.redis.exists(key), seconds, "reconcile")
        return bool(found)
