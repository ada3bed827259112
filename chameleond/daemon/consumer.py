"""Reliable reading of the job's event stream through the consumer group.

XREADGROUP blocks for `block_ms`, well under the client's socket timeout, so a quiet stream never
looks like a dead connection. Entries are acknowledged by the service only once their effect is
durable. At start the consumer re-reads its own pending entries (id 0: delivered to this consumer
name before a crash, never acknowledged); periodically it claims entries left idle by any consumer
(XAUTOCLAIM), and reports how often each was delivered so a poison entry can be dead-lettered.
Trimming never cuts an entry the group has not acknowledged.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ResponseError

from chameleond.daemon.redis_errors import ErrorCode, has_code
from chameleond.protocol import CONSUMER_GROUP, Keys

log = logging.getLogger("chameleond.consumer")
# A batch read behind a backlog grows up to this many times the configured COUNT (`read`).
MAX_BATCH_GROWTH = 8


class Entry(NamedTuple):
    """One stream entry as read (a tuple: made once per event, so it is cheap to make)."""

    id: str
    fields: dict[bytes, bytes] | None  # None: trimmed from the stream before it was handled
    deliveries: int = 1


def _id(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _entries(reply: Any) -> list[Entry]:
    """XREADGROUP's reply as entries: RESP3's map from stream to entries, or RESP2's list of
    [stream, entries] pairs; each entry an id and its flat field list, nil for an entry deleted
    from the stream while pending."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [s[1] for s in reply]
    out: list[Entry] = []
    for entries in streams:
        for i, flat in entries:
            if flat is None:
                out.append(Entry(_id(i), None))
                continue
            it = iter(flat)
            out.append(Entry(_id(i), dict(zip(it, it))))  # noqa: B905 - pairs, as Redis sends them
    return out


class StreamConsumer:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        consumer: str,
        *,
        block_ms: int,
        count: int,
        claim_idle_ms: int,
        maxlen: int,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.block_ms = block_ms
        self.count = count
        self.read_count = count  # the COUNT of the next read of new entries (`read`)
        self.last_full = False  # the last read took all it asked for: more may be waiting
        self.claim_idle_ms = claim_idle_ms
        self.maxlen = maxlen
        self._claim_cursor = "0-0"
        self._conn: AbstractConnection | None = None  # the reads' own connection (`_xreadgroup`)

    async def ensure_group(self) -> None:
        """Create the group at the start of the stream: events sent before the daemon's first start
        (a fault typed by an operator) are handled too."""
        try:
            await self.client.xgroup_create(self.keys.events, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if not has_code(e, ErrorCode.BUSYGROUP):
                raise

    async def read(self) -> list[Entry]:
        """New entries, blocking up to block_ms: `read_count` of them at most. Behind a backlog
        (a full batch), the next read takes twice as many, up to MAX_BATCH_GROWTH times `count`:
        what a batch costs once (its commit, a snapshot of a large job) is shared by more
        entries, so a burst (8,192 workers registering) is caught up with."""
        count = self.read_count
        entries = await self._xreadgroup(">", count, self.block_ms)
        full = len(entries) >= count
        self.read_count = min(count * 2, self.count * MAX_BATCH_GROWTH) if full else self.count
        self.last_full = full
        return entries

    async def own_pending(self, after: str = "0") -> list[Entry]:
        """Entries delivered to this consumer and never acknowledged, oldest first, one page; one
        deleted from the stream while pending has no fields."""
        return await self._with_deliveries(await self._xreadgroup(after, self.count, None))

    async def _xreadgroup(self, start: str, count: int, block_ms: int | None) -> list[Entry]:
        """One XREADGROUP on the consumer's own connection, its reply read straight into entries.
        The connection is held from one read to the next (a blocking read holds one anyway):
        the client's command path (the pool's checks, a task for each timed read, the reply
        converted twice) cost as much CPU as the read itself at a read every few milliseconds
        (docs/daemon.md, Ingestion benchmark). A connection whose command failed, or was cut
        short with its reply unread, is closed and given back: the next read takes one from the
        pool, which connects it as the client would (to the master a Sentinel names now; a
        connection that reconnects by itself goes back to the address it had)."""
        args: list[Any] = ["XREADGROUP", "GROUP", CONSUMER_GROUP, self.consumer, "COUNT", count]
        if block_ms is not None:
            args += ["BLOCK", block_ms]
        args += ["STREAMS", self.keys.events, start]
        pool = self.client.connection_pool
        if self._conn is None:
            self._conn = await pool.get_connection()
        conn = self._conn
        try:
            await conn.send_command(*args)
            reply = await conn.read_response(disable_decoding=True)
        except ResponseError:
            raise  # Redis answered (NOGROUP, say): the connection is sound
        except BaseException:
            self._conn = None
            await conn.disconnect()
            await pool.release(conn)
            raise
        return _entries(reply)

    async def claim_orphans(self) -> int:
        """Claim, at once, every entry pending under another consumer name (XCLAIM with min-idle 0
        and JUSTID: no delivery is counted, the entries were never handled). Only for a daemon
        that holds the job's lease: no other daemon reads the stream, so what another name holds
        is what a dead leader left in flight. They are then read as this consumer's own pending
        entries (`own_pending`). Returns how many were claimed."""
        summary: Any = await self.client.xpending(self.keys.events, CONSUMER_GROUP)
        names = [_id(c["name"]) for c in (summary or {}).get("consumers") or []]
        claimed = 0
        for name in names:
            if name == self.consumer:
                continue
            seen: set[str] = set()
            while True:
                rows = await self.client.xpending_range(
                    self.keys.events, CONSUMER_GROUP, min="-", max="+",
                    count=self.count, consumername=name,
                )  # fmt: skip
                ids: list[Any] = [_id(r["message_id"]) for r in rows]
                if not ids or seen.issuperset(ids):
                    break
                seen.update(ids)
                await self.client.xclaim(
                    self.keys.events, CONSUMER_GROUP, self.consumer, 0, ids, justid=True
                )
                claimed += len(ids)
        return claimed

    async def claim_stale(self, keep: Collection[str] = ()) -> list[Entry]:
        """Entries idle for claim_idle_ms under any consumer name (a daemon that died on another
        host, or a handler that failed), claimed by this one with XAUTOCLAIM; a page per call.

        Entries in `keep` (pending on purpose: a decision under way acknowledges them) are touched
        first (XCLAIM JUSTID resets their idle time without counting a delivery), so they are
        never claimed and never creep towards the dead-letter limit while they wait.
        """
        if keep:
            await self.client.xclaim(
                self.keys.events, CONSUMER_GROUP, self.consumer, 0, list(keep), justid=True
            )
        try:
            reply: Any = await self.client.xautoclaim(
                self.keys.events,
                CONSUMER_GROUP,
                self.consumer,
                self.claim_idle_ms,
                start_id=self._claim_cursor,
                count=self.count,
            )
        except ResponseError as e:
            log.warning("XAUTOCLAIM failed: %s", e)
            return []
        cursor, claimed = reply[0], reply[1]
        self._claim_cursor = _id(cursor)
        entries = [Entry(_id(i), f or None) for i, f in claimed if i is not None]
        gone = len(claimed) - len(entries)
        if gone:
            # Redis 6.2 answers nil, without the id, for an entry deleted while pending; it now
            # belongs to this consumer name and is dead-lettered when its pending list is re-read.
            log.warning("%d claimed entries were deleted from the stream while pending", gone)
        # Redis 7 drops such entries from the pending list itself and names them in a third
        # element: they are dead-lettered now, since nothing else would ever mention them.
        deleted = [Entry(_id(i), None) for i in (reply[2] if len(reply) > 2 else [])]
        if deleted:
            log.warning("%d pending entries were deleted from the stream", len(deleted))
        return [*await self._with_deliveries(entries), *deleted]

    async def _with_deliveries(self, entries: list[Entry]) -> list[Entry]:
        if not entries:
            return []
        rows = await self.client.xpending_range(
            self.keys.events,
            CONSUMER_GROUP,
            min=entries[0].id,
            max=entries[-1].id,
            count=len(entries) * 2 + 16,
            consumername=self.consumer,
        )
        times = {_id(r["message_id"]): int(r["times_delivered"]) for r in rows}
        return [Entry(e.id, e.fields, times.get(e.id, 1)) for e in entries]

    async def trim(self) -> None:
        """Keep the stream near maxlen, but never cut an entry that is not acknowledged: neither a
        pending one nor one not delivered yet. When something is unacknowledged the cut is the
        earlier of the first unacknowledged entry and the maxlen point estimated from the ids'
        timestamps, so a consumer more than maxlen behind keeps the stream longer until it
        catches up (the bound is maxlen + the unacknowledged tail)."""
        info: Any = await self.client.xinfo_stream(self.keys.events)
        length = int(info["length"])
        if length <= self.maxlen:
            return
        first = await self._first_unacknowledged(_id(info["last-generated-id"]))
        if first is None:
            await self.client.xtrim(self.keys.events, maxlen=self.maxlen, approximate=True)
            return
        head, tail = _stamp(_id(info["first-entry"][0])), _stamp(_id(info["last-entry"][0]))
        estimate = (head[0] + (tail[0] - head[0]) * (length - self.maxlen) // length, 0)
        cut = min(first, estimate)
        await self.client.xtrim(self.keys.events, minid=f"{cut[0]}-{cut[1]}", approximate=True)

    async def _first_unacknowledged(self, last_id: str) -> tuple[int, int] | None:
        """The smallest id the group has not acknowledged (pending, or after its last delivered
        id), or None when every entry up to `last_id` is acknowledged."""
        summary: Any = await self.client.xpending(self.keys.events, CONSUMER_GROUP)
        candidates = []
        if summary and summary.get("pending"):
            candidates.append(_stamp(_id(summary["min"])))
        groups: Any = await self.client.xinfo_groups(self.keys.events)
        for g in groups:
            if _id(g["name"]) == CONSUMER_GROUP:
                delivered = _stamp(_id(g["last-delivered-id"]))
                if delivered < _stamp(last_id):
                    candidates.append((delivered[0], delivered[1] + 1))
        return min(candidates) if candidates else None


def _stamp(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
