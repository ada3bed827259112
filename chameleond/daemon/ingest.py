"""Event ingestion: stream entries -> handlers -> one batch commit -> the decision flow.

Each batch is validated and handled entry by entry, then its durable effects and the
acknowledgements it earned are committed at once; a batch that changed nothing durable leaves
its acknowledgements to the next commit and awaits none (daemon/commits.py). Entries a pending
decision answers are not acknowledged here: that decision's commit does it. A malformed entry, or
one delivered more than `max_deliveries` times, is dead-lettered with a reason; a handler that
raises leaves its entry pending, so it comes back (and eventually dies).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from chameleond.auth import AuthError, Keyring
from chameleond.daemon.commits import Committer
from chameleond.daemon.consumer import Entry, StreamConsumer
from chameleond.daemon.decisions import Decisions
from chameleond.daemon.dispatch import dispatch
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.reachability import Reachability
from chameleond.daemon.redis_errors import ErrorCode, has_code
from chameleond.events import Event
from chameleond.handlers.outcome import EventOutcome
from chameleond.jobstate.change import SNAPSHOT, UNCHANGED
from chameleond.jobstate.job import Job
from chameleond.protocol import EVENT_TYPES, EventError, read_event, shorten

log = logging.getLogger("chameleond")
# A batch waits this long at most for a plan search under way (Ingest.process).
PLANNING_FIRST_SECONDS = 1.0

# Called once per batch with each handled entry, its event and the time its handling finished
# (benchmarks measure latency from the entry's id; daemon/commits.py's AckObserver tells when
# each was acknowledged).
EventObserver = Callable[[Sequence[tuple[Entry, Event, float]]], None]


class Ingest:
    def __init__(
        self,
        job: Job,
        consumer: StreamConsumer,
        committer: Committer,
        decisions: Decisions,
        metrics: Metrics,
        reachability: Reachability,
        *,
        max_deliveries: int,
        observer: EventObserver | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        self.job = job
        self.consumer = consumer
        self.committer = committer
        self.decisions = decisions
        self.metrics = metrics
        self.reachability = reachability  # a failed read says Redis is away
        self.max_deliveries = max_deliveries
        self.observer = observer
        self.keyring = keyring  # verifies each event's signature; None: unauthenticated
        self._forged_logged = 0.0  # when a refused signature was last logged (once a second)
        self._forged_quiet = 0  # refused since then, not logged one by one
        self.last_loop = time.monotonic()  # the read loop's last turn (liveness, /healthz)
        # How far the stream is handled (handled_through): when the last read that found the
        # stream read to its end began, and whether a read is waiting on such a stream now.
        self._through = 0.0
        self._caught_up = False
        self._reading = False

    async def replay_own_pending(self) -> None:
        """Entries this consumer name read before a restart and never acknowledged."""
        after = "0"
        while True:
            page = await self.consumer.own_pending(after)
            if not page:
                return
            log.info("re-reading %d pending entries from before a restart", len(page))
            await self.process(page)
            after = page[-1].id

    async def run(self, stop: asyncio.Event) -> None:
        """Read and handle batches until `stop`; a Redis error is retried (Redis restarts)."""
        while not stop.is_set():
            self.last_loop = time.monotonic()
            started, self._reading = time.time(), True
            try:
                entries = await self.consumer.read()
            except (RedisError, OSError) as e:
                self._reading = self._caught_up = False
                if has_code(e, ErrorCode.NOGROUP):
                    await self._group_lost()
                    continue
                log.warning("XREADGROUP failed (%s); retrying", e)
                self.reachability.failed(e)
                await asyncio.sleep(0.5)
                continue
            self._reading = False
            self.reachability.succeeded()
            self._caught_up = False
            if entries:
                await self.process(entries)
            if not self.consumer.last_full:  # it read to the end: all before is handled
                self._through, self._caught_up = started, True

    def handled_through(self) -> float:
        """The time up to which every event written to the stream has been handled: the start of
        the last read that found no more than it took (its batch is handled); now while a read
        waits on a stream read to its end (what arrives meanwhile is delivered at once). While
        the daemon is behind its stream (full batches), it stays where it was: what it has not
        read may hold any worker's newest heartbeat. 0 before the first such read."""
        if self._reading and self._caught_up:
            return time.time()
        return self._through

    async def _group_lost(self) -> None:
        """Redis answers without the consumer group: it came back without the job's data (no
        persistence, or a failover to a replica that missed it). Make the group again from the
        start of whatever the stream holds now; the next commit finds the state missing too and
        writes it again (daemon/commits.py)."""
        log.error("the consumer group is gone from Redis (its data was lost): making it again")
        try:
            await self.consumer.ensure_group()
        except (RedisError, OSError) as e:
            self.reachability.failed(e)
            await asyncio.sleep(0.5)
            return
        self.committer.note(SNAPSHOT)  # the snapshot went with the rest
        await self.committer.batch([], [], force_progress=True)

    async def claim_and_trim(self) -> None:
        """Take over entries left idle by any consumer name, then trim the stream."""
        # Entries a decision or the next snapshot acknowledges are this daemon's, not stale.
        owed = {i for ids in self.job.owed.values() for i in ids} | self.committer.held()
        claimed = await self.consumer.claim_stale(keep=owed)
        if claimed:
            log.info("claimed %d stale entries", len(claimed))
            await self.process(claimed)
        await self.consumer.trim()

    async def process(self, entries: list[Entry]) -> None:
        """Handle what was read, a batch of at most the configured COUNT at a time: a read behind
        a backlog takes up to MAX_BATCH_GROWTH times as many, and a fault among them must not
        wait for all of them to be handled before its decision starts. The other tasks (the
        connection watch, a decision's publication) run between two batches: a batch whose
        commit waits for a snapshot awaits nothing, and a read of 4,096 entries handled at one
        go held the event loop for seconds on a loaded machine (a lost host's liveness notice
        went out 4.3 s after the kill at 8,192 workers, against 0.4 to 0.6 s).

        A plan search under way (`Decisions.planning`) goes first: it runs on a thread that
        shares the interpreter's lock with this loop, and the loop handling a large job's events
        beside it took half of its time (a search of 0.4 s took 2.8 s at 8,192 workers on a
        loaded machine). Each batch waits for it, at most PLANNING_FIRST_SECONDS: the events wait
        in the stream, and the heartbeat lapse is judged up to what was handled."""
        size = max(1, self.consumer.count)
        for start in range(0, len(entries), size):
            if start:
                await asyncio.sleep(0)
            planning = self.decisions.planning
            if planning is not None and not planning.done():
                await asyncio.wait({planning}, timeout=PLANNING_FIRST_SECONDS)
            await self._batch(entries[start : start + size])

    async def _batch(self, entries: list[Entry]) -> None:
        """Handle one batch, then commit its durable effects and acknowledgements at once."""
        job, m = self.job, self.metrics
        now = time.time()
        owed = {i for ids in job.owed.values() for i in ids} if job.owed else ()
        acks: list[str] = []
        dead: list[list[str | bytes]] = []
        counts: dict[tuple[str, EventOutcome], int] = {}  # counted once per batch
        handled: list[tuple[Entry, Event, float]] = []
        for e in entries:
            if e.id in owed:
                continue  # redelivered while its decision runs: acknowledged by that decision
            if e.fields is None:
                dead.append(_dead(e, {}, "the entry was deleted from the stream before handling"))
                acks.append(e.id)
                _count(counts, ("unknown", EventOutcome.INVALID))
                continue
            if e.deliveries > self.max_deliveries:
                reason = f"delivered {e.deliveries} times without being handled"
                dead.append(_dead(e, e.fields, reason))
                acks.append(e.id)
                _count(counts, (_kind(e.fields), EventOutcome.INVALID))
                continue
            try:
                event = read_event(e.fields, job.name, self.keyring)
                outcome = dispatch(job, event, e.id, now)
            except AuthError as err:
                kind = _kind(e.fields)
                dead.append(_dead(e, e.fields, f"refused: {err}"))
                acks.append(e.id)
                _count(counts, (kind, EventOutcome.INVALID))
                m.forged_counters[kind].inc()
                self._log_forged(e.id, kind, str(err))
                continue
            except EventError as err:
                dead.append(_dead(e, e.fields, str(err)))
                acks.append(e.id)
                _count(counts, (_kind(e.fields), EventOutcome.INVALID))
                continue
            except Exception:  # a handler bug: leave the entry pending; it comes back, then dies
                log.exception("handler for entry %s failed; it stays pending", e.id)
                continue
            key = (event.type, outcome.label)
            counts[key] = counts.get(key, 0) + 1
            if outcome.change is not UNCHANGED:
                self.committer.note(outcome.change)
            if not outcome.owed:
                acks.append(e.id)
            if self.observer is not None:
                handled.append((e, event, time.time()))
        for (kind, label), n in counts.items():
            m.event_counters[kind, label].inc(n)
        # The decision a fault of this batch asks for starts now, searching while the batch
        # commits: its plan is published under the commit lock, after this batch's commit.
        self.decisions.maybe_decide()
        await self.committer.batch(acks, dead, behind=self.consumer.last_full)
        if handled and self.observer is not None:
            self.observer(handled)

    def _log_forged(self, entry: str, kind: str, why: str) -> None:
        now = time.monotonic()
        if now - self._forged_logged < 1.0:
            self._forged_quiet += 1
            return
        more = f" ({self._forged_quiet} more since the last report)" if self._forged_quiet else ""
        log.warning("refused %s event %s: %s%s", kind, entry, why, more)
        self._forged_logged, self._forged_quiet = now, 0


def _count(counts: dict[tuple[str, EventOutcome], int], key: tuple[str, EventOutcome]) -> None:
    counts[key] = counts.get(key, 0) + 1


def _kind(fields: dict[bytes, bytes]) -> str:
    raw = fields.get(b"type", b"")
    kind = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return kind if kind in EVENT_TYPES else "unknown"


# A dead letter keeps the original fields for the operator, within bounds: an entry with
# thousands of fields or megabyte values must neither break the commit script (Lua's unpack
# takes a few thousand values) nor fill Redis with copies.
DEAD_FIELDS_KEPT = 64
DEAD_VALUE_BYTES = 1024


def _dead(e: Entry, fields: dict[bytes, bytes] | dict[str, str], reason: str) -> list[str | bytes]:
    out: list[str | bytes] = []
    kept = cut = 0
    for k, v in fields.items():
        if k in (b"error", "error", b"entry", "entry", b"truncated", "truncated"):
            continue
        if kept == DEAD_FIELDS_KEPT:
            cut += 1
            continue
        kept += 1
        k, v = _bounded(k), _bounded(v)
        out += [k, v]
    if cut:
        out += ["truncated", f"{cut} more fields not kept"]
    return [*out, "entry", e.id, "error", shorten(reason)]


def _bounded(v: str | bytes) -> str | bytes:
    if len(v) <= DEAD_VALUE_BYTES:
        return v
    if isinstance(v, bytes):
        return v[:DEAD_VALUE_BYTES] + b"..."
    return v[:DEAD_VALUE_BYTES] + "..."
