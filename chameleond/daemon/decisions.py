"""The decision flow: state machine -> planner -> plan -> one atomic commit.

`Decisions.maybe_decide()` is called after every batch of events is handled (before its commit: the
planner searches while the batch commits) and every housekeeping tick; it
starts at most one task at a time: the initial plan (every worker registered), a decision (the
machine has faults or joins to answer), or the switch to a prepared follow-up (the reroute plan
it follows trains), or a decision on a worker that became slow or recovered (while the job trains),
or, with nothing else to do, the search for the likeliest next faults, whose tables and results
the next fault's decision reads (`_prepare`).
The planner runs in a thread; everything that moves the machine's generation
happens under the commit lock together with the commit that publishes it, so no other commit
ever sees a generation Redis does not hold yet.

A fault decision waits, up to GATHER_SECONDS after its first fault, for the faults naming the
other workers of the plan that the connection watch announced gone (`gathering`): a host's
workers die together, their survivors name them one report after another, and a decision
started on the first would be superseded by each next one (at 8,192 workers each decision takes
seconds). A worker announced gone that nobody names delays the decision by GATHER_SECONDS at
most; the announcement alone never fails anybody.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

from chameleond.core.decide import DecisionError, decide, initial_plan, prepare, prepared_for
from chameleond.core.decision import (
    Decision,
    decision_to_dict,
    join_not_taken,
    prepared_switch,
    same_layout,
)
from chameleond.core.holdings import of_plan
from chameleond.core.machine import DecisionRequest, DecisionResult, PolicyMachine
from chameleond.core.plan import Plan
from chameleond.core.policy import Policy
from chameleond.daemon.commits import Committer
from chameleond.daemon.config import Config
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.views import refresh_gauges
from chameleond.jobstate.change import SNAPSHOT, recorded
from chameleond.jobstate.job import Job
from chameleond.jobstate.records import FollowUp
from chameleond.records import DecisionRecord

log = logging.getLogger("chameleond")
decisions_log = logging.getLogger("chameleond.decisions")
GATHER_SECONDS = 2.0
# A plan's search tables are looked at again (and prepared again if its spec moved) this often.
PREPARE_SPACING_SECONDS = 10.0
T = TypeVar("T")


def gathering(machine: PolicyMachine, announced: frozenset[str], now: float) -> bool:
    """Whether the pending faults wait for more: some worker of the plan was announced gone
    (`announced`), is named by no pending fault and not failed yet, and the first pending fault
    is under GATHER_SECONDS old. Pure."""
    since = machine.pending_since
    if machine.in_flight is not None or not machine.pending_faults or since is None:
        return False
    if now - since >= GATHER_SECONDS:
        return False
    named = machine.pending_faults.keys() | machine.failed
    return any(machine.member(w) and w not in named for w in announced)


def nobody_announced(now: float) -> frozenset[str]:
    return frozenset()


class Decisions:
    def __init__(
        self,
        job: Job,
        cfg: Config,
        committer: Committer,
        metrics: Metrics,
        announced: Callable[[float], frozenset[str]] = nobody_announced,
    ) -> None:
        self.job = job
        self.cfg = cfg
        self.committer = committer
        self.metrics = metrics
        self.announced = announced  # the workers the connection watch announced gone lately
        self.task: asyncio.Task[None] | None = None
        # The plan search under way on the executor's thread (None: none): the event loop's
        # reading gives way to it (Ingest.process), as they share the interpreter's lock.
        self.planning: asyncio.Future[Any] | None = None
        self.closed = False  # draining: no new decision starts
        self._wake: asyncio.TimerHandle | None = None  # the end of a gathering
        # The plan and what its preparation was computed from (core.decide `prepared_for`) when
        # last prepared, and when it was, or last found unchanged.
        self._prepared: tuple[int, tuple[object, ...] | None] | None = None
        self._prepared_at = -PREPARE_SPACING_SECONDS

    def maybe_decide(self) -> None:
        """Start the decision that is due, unless one is running. Raises if the last one failed
        (a bug or a second daemon on the job): the service then stops."""
        task = self.task
        if self.closed or (task is not None and not task.done()):
            return
        if task is not None and not task.cancelled() and task.exception() is not None:
            raise RuntimeError("a decision failed") from task.exception()
        job = self.job
        if job.initial_due(self.cfg.min_workers):
            self.task = asyncio.create_task(self._initial(), name="initial")
            return
        now = time.time()
        if gathering(job.machine, self.announced(now), now):
            self._wake_at(job.machine.pending_since or now)
            return
        request, transitions = job.machine.next_request(now)
        self.committer.note(recorded(transitions))
        if request is not None:
            self.task = asyncio.create_task(self._decide(request), name="decide")
            return
        self.committer.note(job.drop_stale_follow_up())
        follow_up = job.switch_due()
        if follow_up is not None:
            self.task = asyncio.create_task(self._switch(follow_up), name="switch")
            return
        if job.slow_due and job.machine.running():
            self.task = asyncio.create_task(self._slow(), name="slow")
            return
        if self._prepare_due():
            self.task = asyncio.create_task(self._prepare(), name="prepare")

    async def _off_loop(self, search: Callable[[], T]) -> T:
        """`search` (a plan search: pure, from copies) on the executor's thread, `planning` while
        it runs."""
        future = asyncio.get_running_loop().run_in_executor(None, search)
        self.planning = future
        try:
            return await future
        finally:
            self.planning = None

    def quiet(self) -> bool:
        """Nothing being decided, due or waited for: no decision running, nothing pending, and
        every worker of the current plan has acknowledged it."""
        m = self.job.machine
        pending = m.pending_faults or m.pending_joins or m.pending_unrestorable
        running = self.task is not None and not self.task.done()
        return not (running or pending or m.in_flight is not None or m.awaiting_ready)

    async def drain(self, timeout: float) -> None:
        """Let a running decision commit (bounded), and start no other."""
        self.closed = True
        if self.task is not None and not self.task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.task), timeout=timeout)
            except (TimeoutError, asyncio.CancelledError):
                log.warning("a decision did not commit within %.0f s: dropped", timeout)
                self.task.cancel()
            except Exception as e:  # its entries stay pending: the next leader answers them
                log.warning("the running decision failed: %r", e)

    def _wake_at(self, since: float) -> None:
        """Decide once the gathering that began at `since` ends, if no event decides first."""
        loop = asyncio.get_running_loop()
        if self._wake is None or self._wake.when() <= loop.time():  # none pending
            delay = max(0.0, since + GATHER_SECONDS - time.time())
            self._wake = loop.call_later(delay, self.maybe_decide)

    def _soon(self) -> None:
        # Runs once the current task has ended, so maybe_decide sees it done.
        asyncio.get_running_loop().call_soon(self.maybe_decide)

    # ---- the initial plan ----------------------------------------------------------------------

    async def _initial(self) -> None:
        job, now = self.job, time.time()
        spec, generation, mtbf = job.spec, job.machine.generation + 1, job.mtbf(now)
        try:
            plan = await self._off_loop(lambda: initial_plan(spec, generation, mtbf_seconds=mtbf))
        except DecisionError as e:
            await self._no_initial_plan(str(e))
            return
        async with self.committer.lock:
            now = time.time()
            job.started = now
            job.follow_up = None
            note = self.committer.note
            note(recorded(job.machine.initial(generation, plan.workers, now, of_plan(plan))))
            waits = job.act_from(now)
            workers = frozenset(plan.workers)
            for w in spec.workers:
                if w.id in workers and not job.workers[w.id].registered:
                    cause = "not registered when the initial plan was made"
                    note(recorded(job.machine.fault(w.id, cause, now)[1]))
                elif w.id not in workers and job.workers[w.id].registered:
                    note(recorded(job.machine.join(w.id, now)[1]))
            record = DecisionRecord(generation, Policy.INITIAL, "initial plan", now,
                                    step_seconds=plan.estimates.step_seconds)  # fmt: skip
            published = await self.committer.publish(plan, record, [])
        for seconds in waits.values():
            self.metrics.fault_waiting_seconds.observe(seconds)
        self._published(published, "initial plan", None)

    async def _no_initial_plan(self, error: str) -> None:
        """The spec's layout does not fit: a recorded transition to unrecoverable, no plan."""
        job = self.job
        reason = f"no initial plan: {error}"
        log.error("%s", reason)
        async with self.committer.lock:
            now = time.time()
            self.committer.note(recorded(job.machine.unrecoverable(reason, now)))
            job.last_decision = {"cause": "initial plan", "at": now, "unrecoverable": reason,
                                 "selected": None, "candidates": []}  # fmt: skip
            self.committer.note(SNAPSHOT)
            record = DecisionRecord(0, "", "initial plan", now, unrecoverable=reason)
            await self.committer.record([record], job.acks_for(None))

    # ---- a decision ----------------------------------------------------------------------------

    async def _decide(self, request: DecisionRequest) -> None:
        job = self.job
        spec, current, force = job.spec, job.plan, job.force()
        assert current is not None  # next_request asks only once a plan exists
        now = time.time()
        mtbf, window = job.mtbf(now), job.window(now)
        # A copy: handlers move on while it plans. A restore some worker could not load leaves
        # no copy that counts: the others loaded a step the job does not go back to after all.
        holdings = {} if request.unrestorable else dict(job.machine.holdings.held)
        checkpoint = job.checkpoints.newest(len(spec.layers))
        decision: Decision | None = None
        error = None
        try:
            decision = await self._off_loop(
                lambda: decide(
                    spec, current, request.failed, mtbf_seconds=mtbf, window_seconds=window,
                    generation=request.generation, joined=request.joined,
                    force=force, cause=request.cause, holdings=holdings,
                    checkpoint_step=checkpoint,
                ),
            )  # fmt: skip
        except DecisionError as e:
            error = f"decision failed: {e}"
        if self.cfg.decision_delay_seconds:
            await asyncio.sleep(self.cfg.decision_delay_seconds)
        published: Plan | None = None
        async with self.committer.lock:
            now = time.time()
            plan = decision.plan if decision is not None else None
            joins_only = not request.faults and not request.unrestorable
            if plan is not None and join_not_taken(current, plan, joins_only=joins_only):
                plan = None  # a join the planner does not take: keep the current plan
            result = DecisionResult(
                generation=plan.generation if plan is not None else None,
                policy=decision.selected if plan is not None and decision is not None else None,
                workers=plan.workers if plan is not None else (),
                unrecoverable=error or (decision.unrecoverable if decision is not None else None),
                layers=of_plan(plan) if plan is not None else {},
            )
            commit, transitions = job.machine.decided(request, result, now)
            self.committer.note(recorded(transitions))
            self.committer.note(recorded(job.finish_if_done(now)))
            if not commit:
                decisions_log.info("superseded generation=%d cause=%s", request.generation,
                                   request.cause)  # fmt: skip
            else:
                used = decision.mtbf_seconds if decision is not None else window
                record = self._record(request, decision, plan, result, error, used, now)
                acks = job.acks_for(request)
                if plan is None:
                    if result.unrecoverable is not None:
                        job.follow_up = None
                    self.committer.note(SNAPSHOT)  # the last decision, at least
                    await self.committer.record([record], acks)
                    decisions_log.warning("no new plan cause=%s reason=%s", request.cause,
                                          result.unrecoverable or "current plan kept")  # fmt: skip
                else:
                    job.follow_up = _follow_up(decision, plan, force)
                    if plan.restore_step is not None:
                        job.checkpoints.restored(plan.generation, plan.restore_step)
                    published = await self.committer.publish(plan, record, acks)
        if published is not None:
            seconds = time.time() - request.first_event_at if request.faults else None
            self._published(published, request.cause, seconds)
        self._soon()

    def _record(
        self,
        request: DecisionRequest,
        decision: Decision | None,
        plan: Plan | None,
        result: DecisionResult,
        error: str | None,
        mtbf: float,
        now: float,
    ) -> DecisionRecord:
        """The decision record (the candidates, the D they were scored over) and the status's
        last decision."""
        job = self.job
        summary: dict[str, Any] = decision_to_dict(decision) if decision is not None else {}
        summary.update(
            cause=request.cause, at=now, failed=sorted(request.failed),
            faults=sorted(request.faults), joined=sorted(request.joined), error=error,
            unrestorable=dict(request.unrestorable), detail=dict(request.details),
            decision_seconds=now - request.first_event_at,
        )  # fmt: skip
        job.last_decision = summary
        return DecisionRecord(
            generation=request.generation if plan is not None else job.machine.generation,
            selected=(decision.selected or "") if plan is not None and decision else "",
            cause=request.cause,
            at=now,
            unrecoverable=result.unrecoverable or "",
            mtbf_seconds=mtbf,
            failed=tuple(sorted(request.failed)),
            faults=tuple(sorted(request.faults)),
            joined=tuple(sorted(request.joined)),
            unrestorable=tuple(sorted(request.unrestorable)),
            candidates=tuple(summary.get("candidates", [])),
            search_seconds=summary.get("search_seconds", 0.0),
            decision_seconds=now - request.first_event_at,
            step_seconds=plan.estimates.step_seconds if plan is not None else None,
            detail=dict(request.details),  # the raw errors the faults' causes shorten
            note=decision.note if decision is not None else "",
        )

    # ---- reroute first, switch later -----------------------------------------------------------

    async def _switch(self, follow_up: FollowUp) -> None:
        """Publish the prepared plan once the reroute plan trains, if the switch still pays: under
        the Poisson model the expected remaining window is the window to the next fault or
        return itself, re-estimated now."""
        job, m = self.job, self.job.machine
        async with self.committer.lock:
            if job.switch_due() is not follow_up:
                return  # a fault arrived meanwhile: a decision answers it instead
            now = time.time()
            window = job.window(now)
            job.follow_up = None
            self.committer.note(SNAPSHOT)
            if window <= follow_up.after_seconds:
                cause = (
                    f"switch to the prepared {follow_up.plan.policy} plan dropped: "
                    f"D {window:.0f} s no longer exceeds {follow_up.after_seconds:.0f} s"
                )
                record = DecisionRecord(m.generation, "", cause, now, mtbf_seconds=window)
                await self.committer.record([record], [])
                decisions_log.info("%s", cause)
                return
            generation = m.generation + 1
            why = f"switch pays after {follow_up.after_seconds:.1f} s (D {window:.0f} s)"
            plan = replace(follow_up.plan, generation=generation,
                           cause=f"switch to the prepared plan: {why}")  # fmt: skip
            self.committer.note(
                recorded(m.switch(generation, plan.workers, now, plan.cause, of_plan(plan)))
            )
            record = DecisionRecord(generation, plan.policy, plan.cause, now, mtbf_seconds=window,
                                    step_seconds=plan.estimates.step_seconds)  # fmt: skip
            published = await self.committer.publish(plan, record, [])
        self._published(published, published.cause, None)

    # ---- a worker slow, or back to speed -----------------------------------------------------

    async def _slow(self) -> None:
        """Answer the workers that became slow or recovered (Job.slow_due) with core.slowdecide,
        scored over the expected episode duration, and publish its plan through the same commit
        as a fault's; `keep` publishes nothing. With slow_mitigation off only the detection and
        its metrics go on."""
        job, m = self.job, self.job.machine
        due, job.slow_due = job.slow_due, {}
        cause = "; ".join(t.cause for _, t in sorted(due.items()))
        if not self.cfg.slow_mitigation:
            decisions_log.info("not mitigated (slow_mitigation off): %s", cause)
            return
        from chameleond.core.slowdecide import decide_slow

        spec, current, now = job.spec, job.plan, time.time()
        assert current is not None  # running() needs a plan
        speeds = {w: 1.0 for w, t in due.items() if not t.slow} | job.slowness.speeds()
        duration = job.slowness.expected_seconds(self.cfg.slow_episode_prior_seconds)
        generation, mtbf = m.generation + 1, job.mtbf(now)
        holdings = dict(m.holdings.held)
        try:
            decision = await self._off_loop(
                lambda: decide_slow(
                    spec, current, speeds, duration_seconds=duration, generation=generation,
                    mtbf_seconds=mtbf, holdings=holdings, cause=cause,
                ),
            )  # fmt: skip
        except DecisionError as e:
            log.warning("slow-worker decision failed (%s): %s", cause, e)
            self._soon()
            return
        async with self.committer.lock:
            if not m.running() or m.generation != generation - 1:
                job.slow_due = {**due, **job.slow_due}  # a fault came first: decide after it
                self._soon()
                return
            now = time.time()
            job.last_decision = {**decision_to_dict(decision), "cause": cause, "at": now}
            self.committer.note(SNAPSHOT)
            selected = decision.selected or ""
            self.metrics.slow_decisions.labels(selected or "none").inc()
            gains = zip(decision.candidates, decision.gains, strict=True)
            gain = next((g for c, g in gains if c.policy == decision.selected), 0.0)
            self.metrics.slow_expected_gain.set(gain)
            plan = decision.plan
            candidates = tuple(job.last_decision["candidates"])
            if plan is None or same_layout(plan, current):
                record = DecisionRecord(m.generation, "", cause, now, mtbf_seconds=duration,
                                        candidates=candidates, note=f"slow: {selected} selected",
                                        unrecoverable=decision.unrecoverable or "")  # fmt: skip
                await self.committer.record([record], [])
                decisions_log.info("kept the current plan cause=%s", cause)
                self._soon()
                return
            plan = replace(plan, cause=cause)
            self.committer.note(recorded(m.switch(generation, plan.workers, now, cause,
                                                  of_plan(plan))))  # fmt: skip
            record = DecisionRecord(generation, plan.policy, cause, now, mtbf_seconds=duration,
                                    candidates=candidates, note=f"slow: {selected} selected",
                                    step_seconds=plan.estimates.step_seconds)  # fmt: skip
            published = await self.committer.publish(plan, record, [])
        self._published(published, cause, None)

    # ---- between faults ------------------------------------------------------------------------

    def _prepare_due(self) -> bool:
        """The plan trains, nothing waits, and it was not prepared for, or not looked at for
        PREPARE_SPACING_SECONDS (the spec is derived again after every profile, and a large
        job's profiles keep coming: `_prepare` prepares again only if what it computes from
        moved)."""
        plan = self.job.plan
        if plan is None or not self.job.machine.running() or not self.quiet():
            return False
        if self._prepared is not None and self._prepared[0] == plan.generation:
            return time.monotonic() >= self._prepared_at + PREPARE_SPACING_SECONDS
        return True

    async def _prepare(self) -> None:
        """Search for the plan's likeliest next faults (core.decide `prepare`) on the planner's
        thread while the job trains, unless what that computes from (`prepared_for`: at 8,192
        workers itself tens of milliseconds, so also on that thread) is as when last prepared.
        Unlike a decision it does not hold the event loop back (`planning`): a decision that
        falls due meanwhile starts when it ends, and finds the tables and results kept."""
        spec, plan = self.job.spec, self.job.plan
        assert plan is not None  # _prepare_due
        kept = self._prepared
        before = kept[1] if kept is not None and kept[0] == plan.generation else None
        # Looked at now; after a failure, again after the spacing.
        self._prepared, self._prepared_at = (plan.generation, None), time.monotonic()

        def timed() -> tuple[tuple[object, ...], float | None]:
            key = prepared_for(spec, plan)
            if key == before:
                return key, None
            began = time.thread_time()
            prepare(spec, plan)
            return key, time.thread_time() - began

        try:
            key, seconds = await asyncio.get_running_loop().run_in_executor(None, timed)
        except Exception:  # a bug, but only a decision's head start is lost: the job goes on
            log.exception("preparing the search for generation %d failed", plan.generation)
        else:
            self._prepared = (plan.generation, key)
            if seconds is not None:
                self.metrics.prepare_seconds.observe(seconds)
                log.debug("search prepared for generation %d in %.3f CPU-s", plan.generation,
                          seconds)  # fmt: skip
        self._soon()

    # ---- after a publication -------------------------------------------------------------------

    def _published(self, plan: Plan, cause: str, decision_seconds: float | None) -> None:
        job, now = self.job, time.time()
        for w in plan.workers:  # the heartbeat clock of a worker new to the plan starts now
            rec = job.worker(w)
            rec.last_heartbeat = max(rec.last_heartbeat, now)
        self.metrics.policy_decisions.labels(plan.policy).inc()
        if decision_seconds is not None:
            self.metrics.decided(decision_seconds)
        refresh_gauges(job, self.metrics, self.cfg)
        decisions_log.info(
            "published generation=%d policy=%s workers=%d excluded=%s cause=%s",
            plan.generation, plan.policy, len(plan.workers),
            ",".join(plan.excluded) or "-", plan.cause or cause,
        )  # fmt: skip
        self._soon()


def _follow_up(decision: Decision | None, plan: Plan, force: Policy | None) -> FollowUp | None:
    """The prepared dynamic plan to switch to once `plan` (a reroute) trains; None when the
    planner offered none or the policy is forced."""
    prepared = prepared_switch(decision, force)
    return None if prepared is None else FollowUp(plan.generation, *prepared)
