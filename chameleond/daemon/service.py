"""The chameleond service: the lifecycle around event -> handler -> state machine -> planner ->
plan -> broadcast.

`Service.run()` connects to Redis, restores the job, starts its sub-tasks (reading events,
detector, housekeeping, HTTP, watchdog), waits for `shutdown()` or the first failure, then runs
one bounded shutdown sequence: stop reading, let the batch in hand and a running decision
commit, write the progress, close. It installs no signal handlers; the command line maps SIGTERM
to `shutdown()`. The flow itself lives in daemon/ingest.py (events), daemon/decisions.py
(plans), daemon/commits.py (durable writes) and daemon/views.py (status and gauges).

The service builds the parts and hands each the narrow thing it needs (the job, the configuration,
a callback); no part is given the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from chameleond.auth import SIG_FIELD, AuthError, Keyring, signed_document, signed_json
from chameleond.core.machine import PolicyMachine
from chameleond.core.plan import Plan, PlanError, plan_from_dict
from chameleond.core.policy import Selection
from chameleond.core.spec import JobSpec, SpecError, parse_spec
from chameleond.daemon import views
from chameleond.daemon.commits import AckObserver, Committer
from chameleond.daemon.config import Config
from chameleond.daemon.connwatch import ConnWatch
from chameleond.daemon.consumer import StreamConsumer
from chameleond.daemon.decisions import Decisions, nobody_announced
from chameleond.daemon.detector import Detector
from chameleond.daemon.health import Health
from chameleond.daemon.heap import Heap
from chameleond.daemon.http import HttpServer
from chameleond.daemon.ingest import EventObserver, Ingest
from chameleond.daemon.lease import Lease, LeaseLost, connection_name, new_incarnation
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.reachability import Reachability
from chameleond.events import Event
from chameleond.jobstate.job import Job
from chameleond.jobstate.jobspec import spec_document
from chameleond.jobstate.snapshot import restore
from chameleond.protocol import Keys, packed_plan, redact_url, unpacked_plan
from chameleond.redisurl import connect_async
from chameleond.sdnotify import Notifier

log = logging.getLogger("chameleond")


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
        acknowledged: AckObserver | None = None,
        http: bool = True,
        keyring: Keyring | None = None,
    ) -> None:
        self.cfg = cfg
        # Signs plans and specs, verifies the workers' events; None: unauthenticated (--insecure)
        self.keyring = keyring
        self.keys = Keys(cfg.job)
        self.redis_url = redis_url
        self.metrics = metrics or Metrics()
        self.notifier = notifier or Notifier()
        self.observer = observer  # benchmarks: each batch's handled events
        self.acknowledged = acknowledged  # and each commit's acknowledged entries
        self.job = Job(
            cfg.job,
            replace(spec, name=cfg.job),
            policy=Selection(cfg.policy),
            machine=PolicyMachine(ready_timeout_seconds=cfg.ready_timeout_seconds),
            registration_ttl_seconds=cfg.registration_ttl_seconds,
        )
        # What /healthz and /readyz answer; moved along by the lifecycle below.
        self.health = Health(
            loop_limit_seconds=cfg.block_ms / 1000 + cfg.socket_timeout_seconds * 2
        )
        self._serve_http = http
        self.http: HttpServer | None = None  # built by run() once Redis answers
        self._stop = asyncio.Event()
        self._stopped = asyncio.Event()
        self._running = False
        self._failed: BaseException | None = None
        self.leading = False  # holds the job's leader lease (daemon/lease.py)

    @property
    def ready(self) -> bool:
        """Started and leading the job (False again once stopping)."""
        return self.health.ready

    # ---- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ask the service to stop (idempotent; safe from a signal handler)."""
        self._stop.set()

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop, and wait for a `run()` in progress to finish its shutdown sequence."""
        self.shutdown()
        if self._running:
            await self._stopped.wait()

    async def run(self) -> int:
        """Serve until `shutdown()` or the first failure. Returns the exit status (0 or 1)."""
        if self._running or self._stopped.is_set():
            raise RuntimeError("a Service runs once")
        self._running = True
        try:
            return await self._run()
        finally:
            self._running = False
            self._stopped.set()

    async def _run(self) -> int:
        cfg, job = self.cfg, self.job
        incarnation = new_incarnation()
        client = connect_async(
            self.redis_url,
            socket_timeout=cfg.socket_timeout_seconds,
            socket_connect_timeout=cfg.socket_timeout_seconds,
            decode_responses=False,
            client_name=connection_name(incarnation),  # how a standby sees this process live
        )
        tasks: list[asyncio.Task[Any]] = []
        lease = Lease(client, self.keys, cfg.consumer_name, cfg.lease_seconds, incarnation)
        try:
            await client.ping()
            if self._serve_http:
                self.http = HttpServer(job, cfg, self.metrics, self.health, client)
                try:
                    await self.http.start(cfg.http_host, cfg.http_port)
                except OSError as e:  # not Redis's fault: say whose port it is
                    log.error(
                        "cannot serve HTTP on %s: %s (another daemon's? give each job its own "
                        "--http HOST:PORT)", cfg.http, e.strerror or e,
                    )  # fmt: skip
                    self._failed = e
                    return 1
            if self.notifier.watchdog_seconds:
                tasks.append(asyncio.create_task(self.notifier.watchdog(), name="watchdog"))
            if not await lease.acquire(self._stop, self._standing_by):
                return 0  # stopped while standing by
            self.health.standby_for, self.leading = "", True
            self.metrics.leader.set(1)
            consumer = StreamConsumer(
                client, self.keys, cfg.consumer_name,
                block_ms=cfg.block_ms, count=cfg.batch_count,
                claim_idle_ms=int(cfg.claim_idle_seconds * 1000), maxlen=cfg.stream_maxlen,
            )  # fmt: skip
            await consumer.ensure_group()
            # The lease says no other daemon reads the stream now: what another consumer name
            # holds pending (the events in flight when the leader died) is ours at once, not
            # after claim_idle_seconds.
            orphans = await consumer.claim_orphans()
            if orphans:
                log.info("claimed %d in-flight entries of the daemon that led before", orphans)
            await self._restore(client)
            heap = Heap()
            self.metrics.heap_settle_seconds.observe(heap.settle(job.machine.generation))
            reachability = self.health.reachability = Reachability(self.metrics)
            committer = Committer(
                client, self.keys, job, self.metrics, reachability, lease,
                persist_interval_seconds=cfg.persist_interval_seconds, keyring=self.keyring,
                acknowledged=self.acknowledged,
            )  # fmt: skip
            watch = None
            if cfg.peer_watch_seconds > 0:
                watch = ConnWatch(
                    client, self.keys, cfg.peer_watch_seconds, self.metrics, self.keyring,
                    own=connection_name(incarnation),
                )  # fmt: skip
            announced = watch.recently_gone if watch is not None else nobody_announced
            decisions = Decisions(job, cfg, committer, self.metrics, announced)
            ingest = Ingest(
                job, consumer, committer, decisions, self.metrics, reachability,
                max_deliveries=cfg.max_deliveries, observer=self.observer, keyring=self.keyring,
            )  # fmt: skip
            self.health.last_activity = lambda: max(ingest.last_loop, committer.last_attempt)
            detector = Detector(
                job, cfg, reachability,
                write_events=own_event_writer(lease, self.keys, self.keyring),
                nudge=committer.broadcaster.nudge, handled_through=ingest.handled_through,
            )  # fmt: skip
            self.health.ready = True
            self.refresh_gauges()
            self.notifier.ready(f"job {cfg.job}: {job.machine.phase}")
            log.info(
                "ready job=%s generation=%d phase=%s redis=%s http=%s",
                cfg.job, job.machine.generation, job.machine.phase,
                redact_url(self.redis_url), cfg.http if self.http else "off",
            )  # fmt: skip
            await ingest.replay_own_pending()
            decisions.maybe_decide()
            tasks += [
                asyncio.create_task(ingest.run(self._stop), name="consume"),
                asyncio.create_task(detector.run(), name="detector"),
                asyncio.create_task(
                    self._housekeeping(ingest, committer, decisions, heap), name="housekeeping"
                ),
                asyncio.create_task(lease.keep(self._stop), name="lease"),
            ]
            if watch is not None:
                tasks.append(asyncio.create_task(watch.run(self._stop), name="connwatch"))
            stop = asyncio.create_task(self._stop.wait(), name="stop")
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and not t.cancelled() and t.exception() is not None:
                    self._failed = t.exception()
                    log.error("task %s failed: %r", t.get_name(), t.exception())
            stop.cancel()
            await self._drain(tasks, committer, decisions)
        except (RedisError, OSError) as e:
            log.error("cannot run: Redis at %s: %s", redact_url(self.redis_url), e)
            self._failed = e
        finally:
            self.health.ready = False
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.leading:  # hand over at once rather than when the lease lapses
                self.leading = False
                self.metrics.leader.set(0)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(lease.release(), timeout=2.0)
            if self.http is not None:
                await self.http.stop()
            await client.aclose()
        return 1 if self._failed is not None else 0

    async def _drain(
        self, tasks: list[asyncio.Task[Any]], committer: Committer, decisions: Decisions
    ) -> None:
        """Bounded shutdown: the consumer finishes its batch in hand, a running decision commits,
        the progress is written."""
        self.notifier.stopping()
        self._stop.set()
        self.health.ready = False
        consume = next((t for t in tasks if t.get_name() == "consume"), None)
        if consume is not None and not consume.done():
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(consume, timeout=self.cfg.block_ms / 1000 + 5.0)
        await decisions.drain(timeout=30.0 + self.cfg.decision_delay_seconds)
        with contextlib.suppress(RedisError, OSError, LeaseLost):
            await asyncio.wait_for(committer.batch([], [], force_progress=True), timeout=10.0)
        log.info("stopped job=%s generation=%d", self.cfg.job, self.job.machine.generation)

    def _standing_by(self, holder: str) -> None:
        self.health.standby_for = holder
        self.notifier.ready(f"job {self.cfg.job}: standing by, led by {holder}")

    async def _restore(self, client: aioredis.Redis) -> None:
        """Resume from the persisted state, or start the job fresh from the configured spec. With
        a keyring the base spec, the snapshot and the plan must carry this job's signature: the
        next decisions start from them, so nobody without the secret may write them
        (docs/security.md)."""
        k, job = self.keys, self.job
        state = await client.hgetall(k.state)
        base = state.get(b"base_spec")
        if base is not None:
            doc = self._trusted(base, "base_spec", f"{k.state} base_spec")
            try:
                job.reset_spec(replace(parse_spec(doc), name=self.cfg.job))
            except SpecError as e:
                raise RuntimeError(f"{k.state} base_spec does not decode: {e}") from e
        else:
            await client.hsetnx(
                k.state,
                "base_spec",
                signed_json(self.keyring, "base_spec", self.cfg.job, spec_document(job.base_spec)),
            )
        snap = state.get(b"snapshot")
        if snap is not None:
            snapshot = self._trusted(snap, "state", f"{k.state} snapshot")
            plan = await self._restore_plan(client, snapshot.get("plan"))
            restore(job, snapshot, plan, ready_timeout=self.cfg.ready_timeout_seconds)
            stored = int(state.get(b"generation", b"0"))
            if stored != job.machine.generation:
                raise RuntimeError(
                    f"{k.state}: generation {stored} but snapshot says {job.machine.generation}"
                )
            log.info("resumed job=%s generation=%d phase=%s", self.cfg.job, stored,
                     job.machine.phase)  # fmt: skip
        await client.set(
            k.spec, signed_json(self.keyring, "spec", self.cfg.job, spec_document(job.spec))
        )

    async def _restore_plan(
        self, client: aioredis.Redis, committed: dict[str, Any] | None
    ) -> Plan | None:
        """The current plan: the copy the last commit put in the snapshot. The plan key should
        hold the same, signed; when it does not, somebody else wrote it (a forged or stray
        plan), and it is written again from the snapshot, so the daemon and the workers agree
        and no client can keep the daemon from starting. A snapshot from before it held the
        plan falls back to the key, which must then verify."""
        k = self.keys
        raw = await client.get(k.plan)
        if committed is None:
            return self._plan_from_key(raw) if raw is not None else None
        try:
            plan = plan_from_dict(committed)
        except PlanError as e:
            raise RuntimeError(f"{k.state} snapshot: its plan does not decode: {e}") from e
        why = self._plan_key_differs(raw, committed)
        if not why:
            stored = await client.get(k.plan_packed)
            if stored is not None and _unpacked(_bytes(stored)) != json.loads(raw or "null"):
                why = f"its packed copy under {k.plan_packed} differs"
        if why:
            log.error(
                "the plan under %s is not the one this job published (%s): writing generation "
                "%d again", k.plan, why, plan.generation,
            )  # fmt: skip
            text, doc = signed_document(self.keyring, "plan", self.cfg.job, committed)
            async with client.pipeline(transaction=True) as tx:
                tx.set(k.plan, text)
                tx.set(k.plan_packed, packed_plan(doc))
                tx.delete(k.plan_delta)  # what the workers read, as the daemon's commits write it
                tx.publish(k.plans_channel, str(plan.generation))
                await tx.execute()
        return plan

    def _plan_key_differs(self, raw: bytes | str | None, committed: dict[str, Any]) -> str:
        """Why the plan key is not the committed plan, signed by this job ("" when it is)."""
        if raw is None:
            return "it is missing"
        try:
            doc = json.loads(raw)
        except ValueError:
            return "it does not decode"
        if not isinstance(doc, dict):
            return "it is no plan"
        body = {key: v for key, v in doc.items() if key != SIG_FIELD}
        if body != committed:
            found = body.get("generation")
            return f"generation {found!r} there, {committed['generation']} committed"
        if self.keyring is not None:
            try:
                self.keyring.verify_doc("plan", self.cfg.job, doc)
            except AuthError as e:
                return f"its signature: {e}"
        return ""

    def _plan_from_key(self, raw: bytes | str) -> Plan:
        k = self.keys
        try:
            return plan_from_dict(self._trusted(raw, "plan", k.plan))
        except PlanError as e:
            raise RuntimeError(f"{k.plan} does not decode: {e}") from e

    def _trusted(self, raw: bytes | str, kind: str, where: str) -> dict[str, Any]:
        """A persisted JSON object, checked against this job's signature when there is a keyring.
        Raises RuntimeError naming `where`: the daemon does not resume from it."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
            if self.keyring is not None:
                self.keyring.verify_doc(kind, self.cfg.job, doc)
        except AuthError as e:
            raise RuntimeError(f"{where} is not signed by this job's secret: {e}") from e
        except ValueError as e:
            raise RuntimeError(f"{where} does not decode: {e}") from e
        return doc

    # ---- periodic ------------------------------------------------------------------------------

    async def _housekeeping(
        self, ingest: Ingest, committer: Committer, decisions: Decisions, heap: Heap
    ) -> None:
        """Claim stale entries, trim the stream, persist progress, start due decisions, settle
        the heap when it is due and nothing is being decided, refresh gauges. A Redis error is
        logged and the next tick tries again."""
        claim_every = max(1.0, self.cfg.claim_idle_seconds / 2)
        next_claim = time.monotonic() + claim_every
        while not self._stop.is_set():
            await asyncio.sleep(min(1.0, self.cfg.persist_interval_seconds))
            try:
                if time.monotonic() >= next_claim:
                    next_claim = time.monotonic() + claim_every
                    await ingest.claim_and_trim()
                await committer.batch([], [])
                decisions.maybe_decide()
            except (RedisError, OSError) as e:
                log.warning("housekeeping: %s", e)
            generation = self.job.machine.generation
            if heap.due(time.monotonic(), generation) and decisions.quiet():
                self.metrics.heap_settle_seconds.observe(heap.settle(generation))
            self.refresh_gauges()

    # ---- views -------------------------------------------------------------------------------

    def refresh_gauges(self) -> None:
        views.refresh_gauges(self.job, self.metrics, self.cfg)

    def status(self) -> dict[str, Any]:
        return views.status(self.job, self.cfg, standby_for=self.health.standby_for)

    def healthy(self) -> tuple[bool, str]:
        return self.health.healthy()


def own_event_writer(
    lease: Lease, keys: Keys, keyring: Keyring | None
) -> Callable[[Sequence[Event]], Awaitable[None]]:
    """How the daemon writes events to its own stream (the detector's faults): signed as the
    workers sign theirs, so that they pass the same check, in order, batched, and only while it
    holds the lease."""

    async def write(events: Sequence[Event]) -> None:
        entries = [e.to_fields() for e in events]
        if keyring:
            entries = [keyring.sign_event(keys.job, fields) for fields in entries]
        await lease.xadd(keys.events, entries)

    return write


def _unpacked(raw: bytes | None) -> Any:
    """The plan document under Keys.plan_packed; None when there is none to read."""
    if raw is None:
        return None
    try:
        return unpacked_plan(raw)
    except (ValueError, zlib.error):
        return None


def _bytes(raw: bytes | str | None) -> bytes | None:
    return raw.encode() if isinstance(raw, str) else raw
