"""The chameleond service: event -> handler -> state machine -> planner -> plan -> broadcast.

`Service.run()` connects to Redis, restores the job, starts its sub-tasks (consumer, decisions,
detector, housekeeping, HTTP, watchdog), waits for `shutdown()` or the first failure, then runs
one bounded shutdown sequence: stop reading, let the batch in hand and a running decision
commit, close. It installs no signal handlers; the command line maps SIGTERM to `shutdown()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import handlers
from chameleond.core import selector
from chameleond.core.decide import Decision, DecisionError, decide, decision_to_dict, initial_plan
from chameleond.core.machine import DecisionRequest, DecisionResult, Phase, PolicyMachine
from chameleond.core.plan import Plan, PlanError, plan_from_dict, plan_to_dict
from chameleond.core.spec import JobSpec, SpecError, parse_spec
from chameleond.daemon.broadcast import Broadcaster, Commit
from chameleond.daemon.config import Config
from chameleond.daemon.consumer import Entry, StreamConsumer
from chameleond.daemon.detector import Detector
from chameleond.daemon.http import HttpServer
from chameleond.daemon.job import Job
from chameleond.daemon.jobspec import spec_document
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.systemd import Notifier
from chameleond.protocol import EVENT_TYPES, Event, EventError, Keys, parse_event

log = logging.getLogger("chameleond")
decisions_log = logging.getLogger("chameleond.decisions")

# Called with each handled event and the time its handling finished (benchmarks measure latency).
EventObserver = Callable[[Event, float], None]


class Service:
    def __init__(
        self,
        cfg: Config,
        spec: JobSpec,
        redis_url: str,
        *,
        metrics: Metrics | None = None,
        notifier: Notifier | None = None,
        observer: EventObserver | None = None,
        http: bool = True,
    ) -> None:
        self.cfg = cfg
        self.keys = Keys(cfg.job)
        self.redis_url = redis_url
        self.metrics = metrics or Metrics()
        self.notifier = notifier or Notifier()
        self.observer = observer
        self.job = Job(
            cfg.job,
            replace(spec, name=cfg.job),
            policy=cfg.policy,
            machine=PolicyMachine(ready_timeout_seconds=cfg.ready_timeout_seconds),
        )
        self.client: aioredis.Redis | None = None
        self.http = HttpServer(self) if http else None
        self.ready = False
        self.last_loop = time.monotonic()  # the consumer loop's last turn (liveness)
        self.follow_up: tuple[int, Plan, str] | None = None  # (reroute generation, plan, why)
        self._stop = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self._decision: asyncio.Task[None] | None = None
        self._last_progress = 0.0
        self._failed: BaseException | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ask the service to stop (idempotent; safe from a signal handler)."""
        self._stop.set()

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()

    async def run(self) -> int:
        cfg = self.cfg
        self.client = aioredis.Redis.from_url(
            self.redis_url,
            socket_timeout=cfg.socket_timeout_seconds,
            socket_connect_timeout=cfg.socket_timeout_seconds,
            decode_responses=False,
        )
        tasks: list[asyncio.Task[Any]] = []
        try:
            await self.client.ping()
            self.broadcaster = Broadcaster(self.client, self.keys)
            self.consumer = StreamConsumer(
                self.client, self.keys, cfg.consumer_name,
                block_ms=cfg.block_ms, count=cfg.batch_count,
                claim_idle_ms=int(cfg.claim_idle_seconds * 1000), maxlen=cfg.stream_maxlen,
            )  # fmt: skip
            await self.consumer.ensure_group()
            await self._restore()
            if self.http is not None:
                await self.http.start(cfg.http_host, cfg.http_port)
            self.ready = True
            self.refresh_gauges()
            self.notifier.ready(f"job {cfg.job}: {self.job.machine.phase}")
            log.info(
                "ready job=%s generation=%d phase=%s redis=%s http=%s",
                cfg.job, self.job.machine.generation, self.job.machine.phase,
                _redact(self.redis_url), cfg.http if self.http else "off",
            )  # fmt: skip
            await self._replay_own_pending()
            self._maybe_decide()
            tasks = [
                asyncio.create_task(self._consume(), name="consume"),
                asyncio.create_task(Detector(self).run(), name="detector"),
                asyncio.create_task(self._housekeeping(), name="housekeeping"),
            ]
            if self.notifier.watchdog_seconds:
                tasks.append(asyncio.create_task(self.notifier.watchdog(), name="watchdog"))
            stop = asyncio.create_task(self._stop.wait(), name="stop")
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and not t.cancelled() and t.exception() is not None:
                    self._failed = t.exception()
                    log.error("task %s failed: %r", t.get_name(), t.exception())
            stop.cancel()
            await self._drain(tasks)
        except (RedisError, OSError) as e:
            log.error("cannot run: Redis at %s: %s", _redact(self.redis_url), e)
            self._failed = e
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.http is not None:
                await self.http.stop()
            await self.client.aclose()
        return 1 if self._failed is not None else 0

    async def _drain(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Bounded shutdown: the consumer finishes its batch in hand, a running decision commits."""
        self.notifier.stopping()
        self._stop.set()
        self.ready = False
        consume = next((t for t in tasks if t.get_name() == "consume"), None)
        if consume is not None and not consume.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(consume, timeout=self.cfg.block_ms / 1000 + 5.0)
        if self._decision is not None and not self._decision.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(
                    self._decision, timeout=30.0 + self.cfg.decision_delay_seconds
                )
        with contextlib.suppress(RedisError, OSError):
            await self._commit_batch([], [], force_progress=True)
        log.info("stopped job=%s generation=%d", self.cfg.job, self.job.machine.generation)

    async def _restore(self) -> None:
        """Resume from the persisted state, or start the job fresh from the configured spec."""
        assert self.client is not None
        k, job = self.keys, self.job
        state = await self.client.hgetall(k.state)
        base = state.get(b"base_spec")
        if base is not None:
            try:
                job.reset_spec(replace(parse_spec(json.loads(base)), name=self.cfg.job))
            except (SpecError, ValueError) as e:
                raise RuntimeError(f"{k.state} base_spec does not decode: {e}") from e
        else:
            doc = json.dumps(spec_document(job.base_spec))
            await self.client.hsetnx(k.state, "base_spec", doc)
        snap = state.get(b"snapshot")
        if snap is not None:
            raw_plan = await self.client.get(k.plan)
            plan = None
            if raw_plan is not None:
                try:
                    plan = plan_from_dict(json.loads(raw_plan))
                except (PlanError, ValueError) as e:
                    raise RuntimeError(f"{k.plan} does not decode: {e}") from e
            job.restore(json.loads(snap), plan, ready_timeout=self.cfg.ready_timeout_seconds)
            stored = int(state.get(b"generation", b"0"))
            if stored != job.machine.generation:
                raise RuntimeError(
                    f"{k.state}: generation {stored} but snapshot says {job.machine.generation}"
                )
            log.info("resumed job=%s generation=%d phase=%s", self.cfg.job, stored,
                     job.machine.phase)  # fmt: skip
        await self.client.set(k.spec, json.dumps(spec_document(job.spec)))

    # ---- the consumer ------------------------------------------------------------------------

    async def _replay_own_pending(self) -> None:
        after = "0"
        while True:
            page = await self.consumer.own_pending(after)
            if not page:
                return
            log.info("re-reading %d pending entries from before a restart", len(page))
            await self.process(page)
            after = page[-1].id

    async def _consume(self) -> None:
        while not self._stop.is_set():
            self.last_loop = time.monotonic()
            try:
                entries = await self.consumer.read()
            except (RedisError, OSError) as e:
                log.warning("XREADGROUP failed (%s); retrying", e)
                await asyncio.sleep(0.5)
                continue
            if entries:
                await self.process(entries)

    async def process(self, entries: list[Entry]) -> None:
        """Handle one batch, then commit its durable effects and acknowledgements at once."""
        job, m = self.job, self.metrics
        now = time.time()
        owed = {i for ids in job.owed.values() for i in ids}
        acks: list[str] = []
        dead: list[list[str | bytes]] = []
        for e in entries:
            if e.id in owed:
                continue  # redelivered while its decision runs: acknowledged by that decision
            if e.fields is None:
                dead.append(_dead(e, {}, "the entry was deleted from the stream before handling"))
                acks.append(e.id)
                m.count_event("unknown", "invalid")
                continue
            kind = _kind(e.fields)
            if e.deliveries > self.cfg.max_deliveries:
                reason = f"delivered {e.deliveries} times without being handled"
                dead.append(_dead(e, e.fields, reason))
                acks.append(e.id)
                m.count_event(kind, "invalid")
                continue
            try:
                event = parse_event(e.fields)
                outcome = handlers.dispatch(job, event, e.id, now)
            except EventError as err:
                dead.append(_dead(e, e.fields, str(err)))
                acks.append(e.id)
                m.count_event(kind, "invalid")
                continue
            except Exception:  # a handler bug: leave the entry pending; it comes back, then dies
                log.exception("handler for entry %s failed; it stays pending", e.id)
                continue
            m.count_event(event.type, outcome.label)
            if not outcome.owed:
                acks.append(e.id)
            if self.observer is not None:
                self.observer(event, time.time())
        await self._commit_batch(acks, dead)
        self._maybe_decide()

    async def _commit_batch(
        self, acks: list[str], dead: list[list[str | bytes]], *, force_progress: bool = False
    ) -> None:
        job = self.job
        now = time.time()
        progress = None
        if force_progress or now - self._last_progress >= self.cfg.persist_interval_seconds:
            progress = self.progress()
            self._last_progress = now
        async with self._commit_lock:
            spec_changed = job.dirty and job._spec_cache is None
            c = Commit(
                expected_generation=job.machine.generation,
                generation=job.machine.generation,
                snapshot=job.snapshot() if job.dirty else None,
                progress=progress,
                records=_drain(job.records),
                dead_letters=dead,
                acks=acks,
            )
            if c.empty():
                return
            await self._commit(c)
            job.dirty = False
        if spec_changed and self.client is not None:
            await self.client.set(self.keys.spec, json.dumps(spec_document(job.spec)))
        for r in _drain(job.recoveries):
            self.metrics.recovery_seconds.labels(r.policy).observe(r.seconds)
            decisions_log.info("recovered generation=%d policy=%s seconds=%.3f",
                               r.generation, r.policy, r.seconds)  # fmt: skip

    async def _commit(self, c: Commit) -> None:
        """Retry until Redis takes it: what is in memory is ahead of Redis until then."""
        delay = 0.1
        while True:
            try:
                await self.broadcaster.commit(c)
                return
            except (RedisError, OSError) as e:
                if "generation conflict" in str(e):
                    raise
                log.warning("commit failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # ---- decisions -----------------------------------------------------------------------------

    def _maybe_decide(self) -> None:
        if self._decision is not None and not self._decision.done():
            return
        if self._decision is not None and self._decision.exception() is not None:
            raise RuntimeError("a decision failed") from self._decision.exception()
        job, now = self.job, time.time()
        if job.initial_due(self.cfg.min_workers):
            self._decision = asyncio.create_task(self._initial(), name="initial")
            return
        request, transitions = job.machine.next_request(now)
        job.record(transitions)
        if request is not None:
            self._decision = asyncio.create_task(self._decide(request), name="decide")
        elif self._switch_due():
            self._decision = asyncio.create_task(self._switch(), name="switch")

    def _mtbf(self, now: float) -> float:
        job = self.job
        started = job.started or now
        return selector.estimate_mtbf(
            job.fault_times, max(now, started), started, job.spec.mtbf_prior_seconds
        )

    async def _initial(self) -> None:
        job, now = self.job, time.time()
        spec = job.spec
        loop = asyncio.get_running_loop()
        generation = job.machine.generation + 1
        try:
            plan = await loop.run_in_executor(
                None, lambda: initial_plan(spec, generation, mtbf_seconds=self._mtbf(now))
            )
        except DecisionError as e:
            log.error("no initial plan: %s", e)
            job.machine.phase = Phase.UNRECOVERABLE
            job.dirty = True
            await self._commit_batch([], [])
            return
        now = time.time()
        job.started = now
        job.record(job.machine.initial(generation, plan.workers, now))
        for w in spec.workers:
            if w.id in plan.workers and not job.workers[w.id].registered:
                job.machine.fault(w.id, "not registered when the initial plan was made", now)
            elif w.id not in plan.workers and job.workers[w.id].registered:
                job.machine.join(w.id, now)
        record = {"kind": "decision", "generation": str(generation), "selected": "initial",
                  "cause": "initial plan", "at": f"{now:.6f}"}  # fmt: skip
        await self._publish(plan, record, acks=[], decision_seconds=None)

    async def _decide(self, request: DecisionRequest) -> None:
        job = self.job
        spec, current = job.spec, job.plan
        assert current is not None
        mtbf = self._mtbf(time.time())
        loop = asyncio.get_running_loop()
        try:
            decision: Decision | None = await loop.run_in_executor(
                None,
                lambda: decide(
                    spec, current, request.failed, mtbf_seconds=mtbf,
                    generation=request.generation, joined=request.joined,
                    force=job.force(), cause=request.cause,
                ),
            )  # fmt: skip
            error = None
        except DecisionError as e:
            decision, error = None, f"decision failed: {e}"
        if self.cfg.decision_delay_seconds:
            await asyncio.sleep(self.cfg.decision_delay_seconds)
        now = time.time()
        plan = decision.plan if decision is not None else None
        if plan is not None and not request.faults and _same_layout(plan, current):
            plan = None  # a join the planner does not take: keep the current plan
        result = DecisionResult(
            generation=plan.generation if plan is not None else None,
            policy=decision.selected if plan is not None and decision is not None else None,
            workers=plan.workers if plan is not None else (),
            unrecoverable=error or (decision.unrecoverable if decision is not None else None),
        )
        commit, transitions = job.machine.decided(request, result, now)
        job.record(transitions)
        if not commit:
            decisions_log.info("superseded generation=%d cause=%s", request.generation,
                               request.cause)  # fmt: skip
            self._maybe_decide_soon()
            return
        summary = decision_to_dict(decision) if decision is not None else {}
        summary.update(
            cause=request.cause, at=now, failed=sorted(request.failed),
            joined=sorted(request.joined), error=error,
            decision_seconds=now - request.first_event_at,
        )  # fmt: skip
        job.last_decision = summary
        job.dirty = True
        record = {
            "kind": "decision",
            "generation": str(request.generation if plan is not None else job.machine.generation),
            "selected": (decision.selected or "") if plan is not None and decision else "",
            "cause": request.cause,
            "unrecoverable": result.unrecoverable or "",
            "mtbf_seconds": f"{mtbf:.3f}",
            "failed": json.dumps(sorted(request.failed)),
            "joined": json.dumps(sorted(request.joined)),
            "candidates": json.dumps(summary.get("candidates", [])),
            "search_seconds": f"{summary.get('search_seconds', 0.0):.6f}",
            "decision_seconds": f"{now - request.first_event_at:.6f}",
            "at": f"{now:.6f}",
        }
        if decision is not None and decision.note:
            record["note"] = decision.note
        acks = job.acks_for(request)
        if plan is None:
            async with self._commit_lock:
                record_list = [*_drain(job.records), record]
                await self._commit(Commit(
                    job.machine.generation, job.machine.generation, snapshot=job.snapshot(),
                    records=record_list, acks=acks,
                ))  # fmt: skip
                job.dirty = False
            decisions_log.warning("no new plan cause=%s reason=%s", request.cause,
                                  result.unrecoverable or "current plan kept")  # fmt: skip
        else:
            self.follow_up = None
            if decision is not None and decision.follow_up is not None and job.force() is None:
                after = decision.follow_up_after_seconds or 0.0
                why = f"switch pays after {after:.1f} s (D {mtbf:.0f} s)"
                self.follow_up = (plan.generation, decision.follow_up, why)
            seconds = now - request.first_event_at if request.faults else None
            await self._publish(plan, record, acks=acks, decision_seconds=seconds)
        self._maybe_decide_soon()

    def _switch_due(self) -> bool:
        fu = self.follow_up
        m = self.job.machine
        if fu is None:
            return False
        if fu[0] != m.generation:
            self.follow_up = None
            return False
        return m.phase is Phase.TRAINING and not m.pending_faults and not m.pending_joins

    async def _switch(self) -> None:
        assert self.follow_up is not None
        _, prepared, why = self.follow_up
        self.follow_up = None
        job, now = self.job, time.time()
        generation = job.machine.generation + 1
        plan = replace(prepared, generation=generation, cause=f"switch to the prepared plan: {why}")
        job.record(job.machine.switch(generation, plan.workers, now, plan.cause))
        record = {"kind": "decision", "generation": str(generation), "selected": plan.policy,
                  "cause": plan.cause, "at": f"{now:.6f}"}  # fmt: skip
        await self._publish(plan, record, acks=[], decision_seconds=None)

    def _maybe_decide_soon(self) -> None:
        # Runs when the current task ends, so _maybe_decide sees it done.
        asyncio.get_running_loop().call_soon(self._safe_maybe_decide)

    def _safe_maybe_decide(self) -> None:
        if not self._stop.is_set():
            self._maybe_decide()

    async def _publish(
        self, plan: Plan, record: dict[str, str], *, acks: list[str], decision_seconds: float | None
    ) -> None:
        """SET the plan, bump the generation, record, acknowledge and PUBLISH: one atomic commit."""
        job = self.job
        published = job.adopt(plan, job.machine.failed)
        async with self._commit_lock:
            previous = job.plan.generation if job.plan is not None else 0
            c = Commit(
                expected_generation=previous,
                generation=published.generation,
                plan_json=json.dumps(plan_to_dict(published), separators=(",", ":")),
                snapshot=job.snapshot(),
                records=[*_drain(job.records), record],
                acks=acks,
            )
            await self._commit(c)
            job.plan = published
            job.dirty = False
        now = time.time()
        for w in published.workers:  # the heartbeat clock of a worker new to the plan starts now
            rec = job.worker(w)
            rec.last_heartbeat = max(rec.last_heartbeat, now)
        self.metrics.policy_decisions.labels(published.policy).inc()
        if decision_seconds is not None:
            self.metrics.decision_seconds.observe(decision_seconds)
        self.refresh_gauges()
        decisions_log.info(
            "published generation=%d policy=%s workers=%d excluded=%s cause=%s",
            published.generation, published.policy, len(published.workers),
            ",".join(published.excluded) or "-", published.cause or record.get("cause", ""),
        )  # fmt: skip
        self._maybe_decide_soon()

    # ---- periodic ------------------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        """Claim stale entries, trim the stream, persist progress, refresh gauges."""
        claim_every = max(1.0, self.cfg.claim_idle_seconds / 2)
        next_claim = time.monotonic() + claim_every
        while not self._stop.is_set():
            await asyncio.sleep(min(1.0, self.cfg.persist_interval_seconds))
            try:
                if time.monotonic() >= next_claim:
                    next_claim = time.monotonic() + claim_every
                    claimed = await self.consumer.claim_stale()
                    if claimed:
                        log.info("claimed %d stale entries", len(claimed))
                        await self.process(claimed)
                    await self.consumer.trim()
                await self._commit_batch([], [])
                self._maybe_decide()
            except (RedisError, OSError) as e:
                log.warning("housekeeping: %s", e)
            self.refresh_gauges()

    # ---- views (HTTP) --------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        job, m = self.job, self.metrics
        m.set_phase(job.machine.phase)
        m.generation.set(job.machine.generation)
        m.set_workers(job.worker_states(time.time(), self.cfg.heartbeat_timeout_seconds))
        m.training_throughput.set(job.meter.samples_per_second)
        m.estimated_throughput.set(job.plan.samples_per_second if job.plan else 0.0)

    def progress(self) -> dict[str, Any]:
        meter = self.job.meter
        return {
            "at": time.time(),
            "generation": meter.generation,
            "step": meter.step,
            "samples_per_second": meter.samples_per_second,
            "loss": meter.last_loss if meter.last_loss == meter.last_loss else None,
        }

    def status(self) -> dict[str, Any]:
        job, now = self.job, time.time()
        m = job.machine
        states = job.worker_states(now, self.cfg.heartbeat_timeout_seconds)
        workers = {
            wid: {
                "state": state,
                "host": job.workers[wid].host,
                "device": job.workers[wid].device,
                "memory_bytes": job.workers[wid].memory_bytes,
                "heartbeat_age_seconds": round(now - job.workers[wid].last_heartbeat, 3)
                if job.workers[wid].last_heartbeat
                else None,
            }
            for wid, state in sorted(states.items())
        }
        return {
            "job": self.cfg.job,
            "state": m.phase.value,
            "generation": m.generation,
            "policy": self.cfg.policy,
            "plan_policy": job.plan.policy if job.plan else None,
            "workers": workers,
            "failed": sorted(m.failed),
            "pending_faults": dict(sorted(m.pending_faults.items())),
            "awaiting_ready": sorted(m.awaiting_ready),
            "last_decision": job.last_decision,
            "mtbf_seconds": self._mtbf(now),
            "progress": self.progress(),
            "estimated_samples_per_second": job.plan.samples_per_second if job.plan else None,
        }

    def healthy(self) -> tuple[bool, str]:
        age = time.monotonic() - self.last_loop
        limit = self.cfg.block_ms / 1000 + self.cfg.socket_timeout_seconds * 2
        if self.ready and age > limit:
            return False, f"consumer loop silent for {age:.1f} s"
        return True, "ok"


def _kind(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(b"type", b"")
    kind = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return kind if kind in EVENT_TYPES else "unknown"


def _dead(e: Entry, fields: dict[bytes, bytes] | dict[str, str], reason: str) -> list[str | bytes]:
    out: list[str | bytes] = []
    for k, v in fields.items():
        if k in (b"error", "error", b"entry", "entry"):
            continue
        out += [k, v]
    return [*out, "entry", e.id, "error", reason]


def _drain(items: list[Any]) -> list[Any]:
    out = list(items)
    items.clear()
    return out


def _same_layout(a: Plan, b: Plan) -> bool:
    return a.pipelines == b.pipelines and a.routing == b.routing and a.excluded == b.excluded


def _redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
