"""What goes into each durable commit of the job, and retrying it until Redis takes it.

Every commit is one atomic script (daemon/broadcast.py). What the job's transitions changed is
noted here (`note`, a `Change` each) until a commit carries it. A batch commit carries the job's
snapshot when a change named it, the noted transition records, dead letters, the XACK of the
batch's entries and, every `persist_interval_seconds`, the progress (and the snapshot, when only
measurements moved it: Change.measured, at most every SNAPSHOT_MEASURED_SPACING times its cost).
A batch is acknowledged only by a commit whose snapshot
holds its changes; when the last snapshot was made too recently for its cost (a job of thousands
of workers), the batch's entries wait unacknowledged and the next snapshot's commit, at most
SNAPSHOT_WAIT_MAX_SECONDS later, acknowledges them with its own; while a fault decision is on its
way (faults pending, or a decision in flight), they wait for the snapshot its plan's commit
carries, up to SNAPSHOT_DECIDING_WAIT_SECONDS: a large job's snapshot (0.3 to 0.7 s of the event
loop at 8,192 workers under load) made between a fault and its plan delays the plan by as much.
A batch whose commit would carry its acknowledgements alone (heartbeats, steps: nothing durable
changed, no progress due) commits nothing: its acknowledgements go with the next commit, at the
latest the flush's, ACK_SPACING_SECONDS after they were deferred (`_flush_after`, a task of its
own). A daemon reading a thousand events a second in small batches committed each (an EVALSHA,
its lease and generation checks and an XACK: four Redis commands), as many commits a second as
it read batches; and a read loop that awaited such a commit (one every ACK_SPACING_SECONDS), or
waited for the lock while the flush's was on its way, held the events read after it back by the
commit's round trip: 1.3 to 5.7 ms in a paced run, most of its slowest events.
A decision commit adds its decision record and the entries it answers, and a plan commit adds
the plan, the generation and the PUBLISH. `lock` orders them: the decision flow holds it from the
moment it moves the machine's generation until the plan is committed, so no snapshot ever gets
ahead of the published plan.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ReadOnlyError, RedisError, ResponseError

from chameleond.auth import (
    JsonText,
    Keyring,
    canonical,
    signed_canonical,
    signed_json,
)
from chameleond.core.plan import Plan
from chameleond.core.plandelta import plan_delta
from chameleond.daemon.broadcast import Broadcaster, Commit
from chameleond.daemon.lease import Lease, LeaseLost
from chameleond.daemon.lease import lost as lease_lost
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.reachability import Reachability
from chameleond.daemon.redis_errors import ErrorCode, error_message, has_code
from chameleond.daemon.views import progress
from chameleond.jobstate.change import SNAPSHOT, UNCHANGED, Change
from chameleond.jobstate.job import Job
from chameleond.jobstate.jobspec import spec_document
from chameleond.jobstate.snapshot import WorkerTexts, plan_document, snapshot
from chameleond.protocol import Keys, packed, packed_plan
from chameleond.records import Record

log = logging.getLogger("chameleond")
# Refusals that end by themselves: a replica until failover completes, memory until freed.
TRANSIENT = (ReadOnlyError, OutOfMemoryError)
decisions_log = logging.getLogger("chameleond.decisions")
# A batch that changed the job waits for its snapshot until this many times the last snapshot's
# cost has passed since it, and never longer than SNAPSHOT_WAIT_MAX_SECONDS: a large job's
# snapshot (megabytes at 8,192 workers) takes at most about 1/SNAPSHOT_SPACING of the daemon.
# Behind a backlog the cost and the time since are the daemon's CPU time (`_snapshot_spaced`).
SNAPSHOT_SPACING = 4
SNAPSHOT_WAIT_MAX_SECONDS = 2.0
SNAPSHOT_CHEAP_SECONDS = 0.02
SNAPSHOT_DECIDING_WAIT_SECONDS = 10.0
# Measurements alone (Change.measured: a large job's profiles move them with nearly every batch)
# ride with the progress, but a costly snapshot for them waits SNAPSHOT_MEASURED_SPACING times its
# cost, at most SNAPSHOT_MEASURED_WAIT_MAX_SECONDS: every worker sends its measurements again
# within its profile period, so a restarted daemon has them back that soon anyway; a snapshot of
# 8,192 workers with every progress (each second) took most of the daemon.
SNAPSHOT_MEASURED_SPACING = 20
SNAPSHOT_MEASURED_WAIT_MAX_SECONDS = 30.0
ACK_SPACING_SECONDS = 0.02
# Called with the entries each commit acknowledged, once Redis took it, and the time (benchmarks
# measure an event's latency to its acknowledgement).
AckObserver = Callable[[Sequence[str], float], None]


@dataclass
class Held:
    """Handled entries (their ids, and the dead letters they made) that wait, unacknowledged,
    for the snapshot that holds their changes."""

    acks: list[str] = field(default_factory=list)
    dead: list[list[str | bytes]] = field(default_factory=list)


class Committer:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        job: Job,
        metrics: Metrics,
        reachability: Reachability,
        lease: Lease,
        *,
        persist_interval_seconds: float,
        keyring: Keyring | None = None,
        acknowledged: AckObserver | None = None,
    ) -> None:
        self.client = client
        self.acknowledged = acknowledged  # told of each commit's acknowledged entries
        self.keyring = keyring  # signs the plan and spec documents (chameleond/auth.py)
        self.keys = keys
        self.job = job
        self.metrics = metrics
        self.reachability = reachability  # a failed commit says Redis is away
        self.persist_interval_seconds = persist_interval_seconds
        self.lease = lease
        self.broadcaster = Broadcaster(client, keys, lease)
        self.lock = asyncio.Lock()
        self.spec_written = job.spec_version  # the version stored under chameleon:{job}:spec
        self._spec_at = 0.0  # when the spec was last written
        self._last_progress = 0.0
        self.last_attempt = time.monotonic()  # a commit retrying through an outage is alive
        self.unsaved = UNCHANGED  # what the job's transitions changed that no commit carried yet
        self._held = Held()  # handled entries whose changes wait for the next snapshot
        self._acks_later: list[str] = []  # handled entries that changed nothing durable
        self._flush: asyncio.Task[None] | None = None  # commits the later acks (`_flush_after`)
        self._snapshot_at = 0.0  # time.monotonic() of the last snapshot made
        self._snapshot_cost = 0.0  # how long it took
        self._snapshot_cpu_at = 0.0  # time.process_time() after it
        self._snapshot_cpu = 0.0  # the daemon's CPU time it took
        # The current plan's document in the snapshot, and its canonical text
        self._plan_text: tuple[object, JsonText] = (None, JsonText("null"))
        self._texts = WorkerTexts()  # the workers' parts of the snapshot, made as they change
        self._plan_doc: dict[str, Any] | None = None  # the last plan published, as a document

    def note(self, change: Change) -> None:
        """What a handler or a decision changed: the next commit carries it."""
        if change:
            self.unsaved |= change

    async def batch(
        self,
        acks: Sequence[str],
        dead: list[list[str | bytes]],
        *,
        force_progress: bool = False,
        behind: bool = False,
    ) -> None:
        """The job's changes since the last commit, with this batch's dead letters and acks
        (`behind`: read from a backlog, with more waiting)."""
        job = self.job
        now = time.time()
        if self._nothing_durable(dead, self._progress_due(now, force_progress)):
            # Acknowledgements alone: the flush's commit, or any before it, carries them; the
            # read loop waits for no commit (module docstring).
            self._acks_later += acks
            if self._acks_later:
                self._flush_later()
        else:
            async with self.lock:
                await self._batch_locked(
                    acks, dead, now, force_progress=force_progress, behind=behind
                )
        if job.spec_version != self.spec_written and (
            force_progress or now - self._spec_at >= self.persist_interval_seconds
        ):
            # The spec the workers read, derived from the job, at most once per persist interval
            # (profiles change it with nearly every batch of a large job; a document of 8,192
            # workers takes 45 ms to write): a write lost to a Redis outage, or held back, is
            # made by a later batch (at the latest the next housekeeping tick).
            version, self._spec_at = job.spec_version, now
            try:
                await self.client.set(self.keys.spec, self._signed("spec", spec_document(job.spec)))
            except (RedisError, OSError) as e:
                self.reachability.failed(e)
                log.warning("spec not written (%s); the next batch writes it", e)
            else:
                self.spec_written = version
        recoveries, self.unsaved = self.unsaved.recoveries, replace(self.unsaved, recoveries=())
        for r in recoveries:
            self.metrics.recovered(r.policy, r.seconds)
            decisions_log.info("recovered generation=%d policy=%s seconds=%.3f",
                               r.generation, r.policy, r.seconds)  # fmt: skip

    async def _batch_locked(
        self,
        acks: Sequence[str],
        dead: list[list[str | bytes]],
        now: float,
        *,
        force_progress: bool,
        behind: bool,
    ) -> None:
        progress_due = self._progress_due(now, force_progress)
        if not force_progress and self.unsaved.snapshot and not self._snapshot_spaced(behind):
            # The entries wait, unacknowledged, for the next snapshot (module docstring).
            self._held.acks += acks
            self._held.dead += dead
        else:
            progress_doc = None
            if progress_due:
                progress_doc = progress(self.job)
                self._last_progress = now
            await self._job_commit(acks, dead=dead, progress=progress_doc)

    def _progress_due(self, now: float, force: bool) -> bool:
        return force or now - self._last_progress >= self.persist_interval_seconds

    def _nothing_durable(self, dead: list[list[str | bytes]], progress_due: bool) -> bool:
        """Whether a commit now would acknowledge entries and carry nothing else."""
        return not (dead or progress_due or self.unsaved.snapshot or self.unsaved.records)

    def _flush_later(self) -> None:
        """Commit the acknowledgements waiting ACK_SPACING_SECONDS from now."""
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._flush_after())

    async def _flush_after(self) -> None:
        """Every ACK_SPACING_SECONDS while acknowledgements wait, one commit of them (with
        whatever else is due); those deferred while it was on its way go with the next round."""
        while True:
            await asyncio.sleep(ACK_SPACING_SECONDS)
            if not self._acks_later:
                return
            try:
                async with self.lock:
                    await self._batch_locked(
                        [], [], time.time(), force_progress=False, behind=False
                    )
            except (RedisError, OSError, LeaseLost) as e:  # the next commit carries them
                log.warning("acknowledgements not committed (%s); the next commit carries them", e)
                return

    async def record(self, records: Sequence[Record], acks: Sequence[str]) -> None:
        """A decision without a new plan: snapshot, records and the entries it answers. The caller
        holds `lock`."""
        assert self.lock.locked()
        await self._job_commit(acks, records=records)

    async def publish(self, plan: Plan, record: Record, acks: Sequence[str]) -> Plan:
        """SET the plan, bump the generation, snapshot, record, acknowledge and PUBLISH at once.
        Returns the plan as published (every failed worker fenced through `excluded`). The caller
        holds `lock`."""
        assert self.lock.locked()
        job = self.job
        published = job.adopt(plan, job.machine.failed)
        text, doc = self._signed_plan(published)
        c = Commit(
            expected_generation=job.plan.generation if job.plan is not None else 0,
            generation=published.generation,
            plan_json=text,
            plan_packed=packed_plan(doc),
            plan_delta=self._delta(published, doc),
            snapshot=self._snapshot(plan=published),
            records=[*self._take_records(), record],
            acks=acks,
        )
        await self._retry_clean(c)
        job.plan, self._plan_doc = published, doc
        return published

    def _delta(self, plan: Plan, doc: dict[str, Any]) -> bytes:
        """`doc` (of `plan`) as a delta from the plan the workers hold, packed (b"": none known,
        or none worth making). Only a plan that keeps the pipelines of the one before is worth
        it: a delta that re-partitions is larger than the whole plan's compact form (at 8 to
        8,192 devices: 1.4 to 14 times), and at 8,192 it took 80 ms to make and throw away."""
        held, current = self._plan_doc, self.job.plan
        if current is None or plan.pipelines != current.pipelines:
            return b""
        if held is None or held.get("generation") != current.generation:  # after a restart
            held = self._signed_plan(current)[1]
        return packed(json.dumps(plan_delta(held, doc), separators=(",", ":")))

    async def _job_commit(
        self,
        acks: Sequence[str],
        *,
        dead: list[list[str | bytes]] | None = None,
        records: Sequence[Record] = (),
        progress: dict[str, Any] | None = None,
    ) -> None:
        job = self.job
        c = Commit(
            expected_generation=job.machine.generation,
            generation=job.machine.generation,
            snapshot=self._snapshot() if self._snapshot_due(progress is not None) else None,
            progress=progress,
            records=[*self._take_records(), *records],
            dead_letters=dead or [],
            acks=acks,
        )
        if c.empty() and not self._acks_later:
            return
        await self._retry_clean(c)

    def held(self) -> set[str]:
        """The entries handled and not yet acknowledged: their snapshot, or their commit, is
        still to come."""
        return {*self._held.acks, *self._acks_later}

    def _snapshot_spaced(self, behind: bool) -> bool:
        """Long enough since the last snapshot: SNAPSHOT_SPACING times what it took to make, at
        most SNAPSHOT_WAIT_MAX_SECONDS, or SNAPSHOT_DECIDING_WAIT_SECONDS while a fault decision
        is on its way. A snapshot that took under SNAPSHOT_CHEAP_SECONDS (a job of hundreds of
        workers) never waits: every batch that changed the job carries one.

        `behind` a backlog, what counts is the daemon's CPU time, up to
        SNAPSHOT_DECIDING_WAIT_SECONDS: SNAPSHOT_SPACING times the snapshot's own spent on
        events since it. On a machine whose other processes leave the daemon a fraction of a
        core, a snapshot's wall time grows by as much, and one every SNAPSHOT_WAIT_MAX_SECONDS
        took half of the daemon's time (8,192 workers registering on 2 shared cores) while the
        backlog grew."""
        if self._snapshot_cost < SNAPSHOT_CHEAP_SECONDS:
            return True
        since = time.monotonic() - self._snapshot_at
        m = self.job.machine
        if m.pending_faults or m.in_flight is not None:  # the plan's commit carries one soon
            return since >= SNAPSHOT_DECIDING_WAIT_SECONDS
        if behind and since < SNAPSHOT_DECIDING_WAIT_SECONDS:
            return time.process_time() - self._snapshot_cpu_at >= (
                SNAPSHOT_SPACING * self._snapshot_cpu
            )
        return since >= min(SNAPSHOT_SPACING * self._snapshot_cost, SNAPSHOT_WAIT_MAX_SECONDS)

    def _snapshot_due(self, progress: bool) -> bool:
        """A change named the snapshot; or measurements moved it, the progress is due and the
        last snapshot is long enough ago for its cost (SNAPSHOT_MEASURED_SPACING)."""
        if self.unsaved.snapshot:
            return True
        if not (self.unsaved.measured and progress):
            return False
        cost = self._snapshot_cost
        wait = min(SNAPSHOT_MEASURED_SPACING * cost, SNAPSHOT_MEASURED_WAIT_MAX_SECONDS)
        return cost < SNAPSHOT_CHEAP_SECONDS or time.monotonic() - self._snapshot_at >= wait

    def _take_records(self) -> tuple[Record, ...]:
        records, self.unsaved = self.unsaved.records, replace(self.unsaved, records=())
        return records

    async def _retry_clean(self, c: Commit) -> None:
        """Commit a snapshot taken now. The job is saved from the moment it is taken: a handler
        that runs while the commit waits on Redis notes its change again, so it goes into the
        next commit, never lost behind a flag cleared after the await."""
        taken = c.snapshot is not None
        held = Held(list(self._held.acks), list(self._held.dead)) if taken else Held()
        if taken:
            self.unsaved = replace(self.unsaved, snapshot=False, measured=False)
            # Entries handled since the last snapshot: this one holds their changes.
            c = replace(c, acks=[*held.acks, *c.acks], dead_letters=[*held.dead, *c.dead_letters])
        later, self._acks_later = self._acks_later, []  # any commit acknowledges them
        c = replace(c, acks=[*later, *c.acks])
        try:
            await self._retry(c)
        except BaseException:
            if taken:
                self.note(SNAPSHOT)
            self._acks_later = [*later, *self._acks_later]
            raise
        if taken:  # those held meanwhile wait for the next
            del self._held.acks[: len(held.acks)], self._held.dead[: len(held.dead)]
        if self.acknowledged is not None and c.acks:
            self.acknowledged(c.acks, time.time())

    async def _retry(self, c: Commit) -> None:
        """Retry, at least once a second, until Redis takes it: what is in memory is ahead of
        Redis until then. A generation conflict (a second daemon on the job) is not retried."""
        delay, retried = 0.1, False
        while True:
            self.last_attempt = time.monotonic()
            try:
                await self.broadcaster.commit(c)
                self.reachability.succeeded()
                return
            except (RedisError, OSError) as e:
                self.reachability.failed(e)
                if lease_lost(e):
                    raise LeaseLost(error_message(e)) from None
                if has_code(e, ErrorCode.STATE_LOST):
                    await self._reseed(c)
                    continue
                if has_code(e, ErrorCode.GENERATION_CONFLICT):
                    if retried and await self._landed(c):
                        return  # the connection broke after Redis ran it: the reply was lost
                    raise
                if isinstance(e, ResponseError) and not isinstance(e, TRANSIENT):
                    # Redis answers but refuses (an ACL without a key, a key of the wrong type):
                    # nothing is lost while the operator mends it, so keep trying, loudly.
                    log.error("Redis refuses the commit (%s); retrying in %.1f s", e, delay)
                else:
                    log.warning("commit failed (%s); retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay, retried = min(delay * 2, 1.0), True

    async def _reseed(self, c: Commit) -> None:
        """Redis came back without the job's state (restarted without persistence, or a failover
        to a replica that missed writes): write it again from memory, up to the generation `c`
        expects, so that `c` lands next. The workers hold the plan already; publishing its
        generation again changes nothing for them. The workers' spec is written first, so whoever
        sees the plan again finds its spec; the consumer group is made again by the read loop
        (daemon/ingest.py)."""
        job = self.job
        raw = await self.client.hget(self.keys.state, "generation")
        stored = int(raw or 0)
        log.error(
            "Redis lost the job's state: it holds generation %d, this daemon published %d; "
            "writing it again from memory", stored, c.expected_generation,
        )  # fmt: skip
        await self.client.hsetnx(
            self.keys.state, "base_spec", self._signed("base_spec", spec_document(job.base_spec))
        )
        plan = job.plan
        if plan is None or plan.generation != c.expected_generation:  # cannot be: 0 < expected
            raise RuntimeError(f"no plan of generation {c.expected_generation} to write again")
        await self.client.set(self.keys.spec, self._signed("spec", spec_document(job.spec)))
        self.spec_written = job.spec_version
        text, doc = self._signed_plan(plan)
        seed = Commit(
            expected_generation=stored,
            generation=plan.generation,
            plan_json=text,
            plan_packed=packed_plan(doc),
            snapshot=self._snapshot() if job.machine.generation == plan.generation else None,
        )
        await self.broadcaster.commit(seed)

    def _snapshot(self, plan: Plan | None = None) -> str:
        """The job's snapshot as persisted (with `plan`, the one about to be published): signed,
        so a restarted daemon trusts only its own."""
        began, cpu = time.perf_counter(), time.process_time()
        doc = snapshot(self.job, plan=plan, texts=self._texts)
        if doc["plan"] is not None:
            doc["plan"] = self._plan_canonical(doc["plan"])
        text = self._signed("state", doc)
        self._snapshot_cost = time.perf_counter() - began
        self._snapshot_cpu_at = time.process_time()
        self._snapshot_cpu = self._snapshot_cpu_at - cpu
        self._snapshot_at = time.monotonic()
        return text

    def _signed_plan(self, plan: Plan) -> tuple[str, dict[str, Any]]:
        """The plan's text as stored, and the document read from it. Its document and canonical
        text are made once per plan: the snapshots hold the same (`_snapshot`)."""
        body = plan_document(plan)
        text = self._plan_canonical(body)
        return signed_canonical(self.keyring, "plan", self.job.name, body, text)

    def _plan_canonical(self, body: dict[str, Any]) -> JsonText:
        """The canonical text of a plan's document (`plan_document`: the same object while the
        plan is), made once per plan."""
        if self._plan_text[0] is not body:
            self._plan_text = (body, canonical(body))
        return self._plan_text[1]

    def _signed(self, kind: str, doc: dict[str, Any]) -> str:
        return signed_json(self.keyring, kind, self.job.name, doc)

    async def _landed(self, c: Commit) -> bool:
        if not c.plan_json:
            return False
        stored = await self.client.hget(self.keys.state, "generation")
        plan = await self.client.get(self.keys.plan)
        return stored is not None and int(stored) == c.generation and plan == c.plan_json.encode()
