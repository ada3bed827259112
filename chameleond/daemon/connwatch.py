"""Peer death, seen once for the whole job: the daemon watches the workers' Redis connections and
announces the processes that are gone.

Every Redis connection of a worker is named `chameleon-worker:{job}:{id}:{incarnation}`
(chameleond/worker/_link.py); the kernel closes a killed process's sockets, so Redis drops its
connections at once. One `CLIENT LIST TYPE normal` per `peer_watch_seconds` (about 2 MB and 9 ms
of Redis at 8,192 workers; at most one per LISTING_SPACING of its round trips, and at least one
per MAX_LISTING_PAUSE) finds the incarnations that were listed and are missing from two listings
in a row; the daemon publishes them on `Keys.liveness_channel` and keeps the recent ones under
`Keys.gone` for a worker that subscribes later. A worker thus learns of a peer's death within two
pauses (one of at most max(peer_watch_seconds, MAX_LISTING_PAUSE), then one of
peer_watch_seconds to confirm), two listings and a publish, on every backend, without listing
clients itself (its ACL user needs no CLIENT LIST).

The notice is evidence, not a verdict: a survivor names a peer in a fault only when its own
collective failed and the peer is announced gone (chameleond/worker/_attribution.py), as before.
An incarnation seen again is announced `live` (a connection blip), and so is a new incarnation
of a worker that had one gone (its restart): for the workers, the id is alive again.

`Connections` is the pure part (the listed incarnations in, the notices out); `ConnWatch` is the
loop around it. After a Redis restart or failover no connection is older than
RECONNECT_SECONDS: until one is (a worker's, or the daemon's own), a missing connection says
nothing (live workers are reconnecting) and the watch keeps what it saw before. The daemon's own
connections count so that a worker killed in the job's first seconds is announced too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, RedisError

from chameleond.auth import AuthError, Keyring, signed_json
from chameleond.daemon.metrics import Metrics
from chameleond.protocol import Keys

log = logging.getLogger("chameleond.connwatch")
# After a Redis restart every live worker reconnects within a heartbeat or two (redis-py's retries
# back off to 1 s); until then a missing connection says nothing.
RECONNECT_SECONDS = 3
GONE_KEEP_SECONDS = 600.0  # how long a gone incarnation stays listed under Keys.gone
RECENT_SECONDS = 10.0  # an announcement this recent makes a fault decision wait for its faults
# The watch waits at least this many times its last listing's round trip between listings, so
# that listing a large job's connections takes at most 1/20 of Redis's time; but never longer
# than MAX_LISTING_PAUSE: the round trip also counts the daemon's own event loop, busy with a
# large job's events (at 8,192 workers, round trips of 0.6 s on a loaded machine spaced the
# listings 12 s apart, and the heartbeat timeout found a dead host first), while Redis lists
# 8,192 workers' connections in about 9 ms (twice a second: under 2% of its time).
LISTING_SPACING = 20
MAX_LISTING_PAUSE = 0.5
_AGE = re.compile(rb" age=(\d+)")  # right after the name, in CLIENT LIST

Incarnation = tuple[str, str]  # (worker id, incarnation)


def listed(raw: bytes, job: str, own: str | None = None) -> tuple[set[Incarnation], int]:
    """The job's worker incarnations in a CLIENT LIST reply, and the oldest age of the lister's
    own connections (named `own`) and, while none of those is RECONNECT_SECONDS old, of the
    workers' (after a restart of Redis; a sentinel's or a tool's old connection says nothing of
    it). At 8,192 workers the reply lists 16,384 connections twice a second: the names are read
    in one regular-expression pass, and a listing of the same names as the last is not parsed
    again."""
    oldest = _oldest_named(raw, f" name={own} ".encode()) if own is not None else 0
    if oldest < RECONNECT_SECONDS:
        oldest = max(oldest, max(map(int, _ages(job).findall(raw)), default=0))
    return set(_incarnations(frozenset(_names(job).findall(raw)))), oldest


def _named(job: str) -> bytes:
    """The start of a job's worker connection name field in CLIENT LIST, as a pattern."""
    return re.escape(f" name=chameleon-worker:{job}:".encode())


@functools.lru_cache(maxsize=8)
def _names(job: str) -> re.Pattern[bytes]:
    """A job's worker connection names (after the prefix), in CLIENT LIST."""
    return re.compile(_named(job) + rb"(\S*)")


@functools.lru_cache(maxsize=8)
def _ages(job: str) -> re.Pattern[bytes]:
    """The ages of a job's worker connections, in CLIENT LIST (the field after the name)."""
    return re.compile(_named(job) + rb"\S* age=(\d+)")


@functools.lru_cache(maxsize=2)
def _incarnations(names: frozenset[bytes]) -> frozenset[Incarnation]:
    return frozenset(v for name in names if (v := _incarnation(name)) is not None)


@functools.lru_cache(maxsize=1 << 16)
def _incarnation(name: bytes) -> Incarnation | None:
    worker, _, incarnation = name.decode("utf-8", "replace").rpartition(":")
    return (worker, incarnation) if worker else None


def _oldest_named(raw: bytes, field: bytes) -> int:
    """The oldest age of the connections whose name field is `field` (0: none)."""
    oldest = 0
    start = raw.find(field)
    while start >= 0:
        if age := _AGE.match(raw, start + len(field) - 1):
            oldest = max(oldest, int(age.group(1)))
        start = raw.find(field, start + len(field))
    return oldest


@dataclass(frozen=True)
class Notice:
    """Incarnations gone since the last listing, and those live again (back after a blip, or a
    new process of a worker that had one gone)."""

    gone: tuple[Incarnation, ...] = ()
    live: tuple[Incarnation, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.gone or self.live)

    def doc(self, at: float) -> dict[str, object]:
        gone, live = [list(g) for g in self.gone], [list(v) for v in self.live]
        return {"gone": gone, "live": live, "at": at}


@dataclass
class Connections:
    """The job's worker incarnations as the listings show them (pure: listings in, notices out)."""

    seen: set[Incarnation] = field(default_factory=set)  # listed, or missing from one listing
    missing: set[Incarnation] = field(default_factory=set)  # missing from the last listing only
    gone: dict[Incarnation, float] = field(default_factory=dict)  # -> when it was seen gone
    # The worker ids of `seen`, for the `seen` they were made of
    _ids: tuple[set[Incarnation] | None, set[str]] = field(
        default=(None, set()), init=False, repr=False, compare=False
    )

    def update(self, live: set[Incarnation], oldest: int, now: float) -> Notice:
        """One listing at `now` (unix time); nothing changes while no connection is older than
        RECONNECT_SECONDS (Redis restarted or failed over: live workers are reconnecting).

        Announced gone: an incarnation missing from two listings in a row (a live worker that
        closes and opens its connection again is missing from one at most). Announced live: an
        incarnation listed again after it was announced gone, and the live incarnations of a
        worker whose other incarnation just went or came (a restarted worker: its id is alive,
        whichever process of it died)."""
        if oldest < RECONNECT_SECONDS:
            return Notice()
        absent = self.seen - live
        gone = absent & self.missing
        new = live - self.seen
        self.missing = absent - gone
        self.seen = live | self.missing
        back = new & set(self.gone)
        for v in back:
            del self.gone[v]
        for g in gone:
            self.gone[g] = now
        for g, at in list(self.gone.items()):
            if now - at > GONE_KEEP_SECONDS:
                del self.gone[g]
        touched = {w for w, _ in gone | new}
        with_gone = {w for w, _ in self.gone}
        also = {v for v in live if v[0] in touched and v[0] in with_gone}
        return Notice(tuple(sorted(gone)), tuple(sorted(back | also)))

    def recently_gone(self, now: float, within: float) -> frozenset[str]:
        """The workers with an incarnation announced gone in the last `within` seconds and none
        listed since (a restarted worker is alive)."""
        recent = {w for (w, _), at in self.gone.items() if now - at <= within}
        if not recent:
            return frozenset()
        if self._ids[0] is not self.seen:  # asked after every batch: made once per listing
            self._ids = (self.seen, {w for w, _ in self.seen})
        return frozenset(recent - self._ids[1])

    def current(self) -> Notice:
        """What a worker that subscribes now needs (the Keys.gone document): the incarnations
        gone within GONE_KEEP_SECONDS, and the live ones of the same workers."""
        with_gone = {w for w, _ in self.gone}
        return Notice(
            tuple(sorted(self.gone)), tuple(sorted(v for v in self.seen if v[0] in with_gone))
        )

    def restore(self, doc: dict[str, object]) -> None:
        """Take up the gone incarnations a previous daemon announced (its Keys.gone doc)."""
        at = float(doc.get("at", 0) or 0)  # type: ignore[arg-type]
        for item in doc.get("gone", []):  # type: ignore[attr-defined]
            if isinstance(item, list) and len(item) == 2:
                self.gone.setdefault((str(item[0]), str(item[1])), at)


def announce(
    connections: Connections,
    raw: object,
    job: str,
    keyring: Keyring | None,
    now: float,
    own: str | None = None,
) -> tuple[Notice, tuple[str, str] | None]:
    """One CLIENT LIST reply taken into `connections` (`own`: the name of the lister's
    connections): the notice, and when it says anything the two texts to write (the Keys.gone
    document, the message for Keys.liveness_channel)."""
    live, oldest = listed(raw if isinstance(raw, bytes) else str(raw).encode(), job, own)
    notice = connections.update(live, oldest, now)
    if not notice:
        return notice, None
    if notice.gone:
        log.info("gone: %s", ", ".join(f"{w} ({i})" for w, i in notice.gone))
    current = signed_json(keyring, "liveness", job, connections.current().doc(now))
    return notice, (current, signed_json(keyring, "liveness", job, notice.doc(now)))


class ConnWatch:
    """Lists the job's worker connections every `period` seconds (or LISTING_SPACING times the
    last listing's round trip, when that is longer) and announces changes."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        period: float,
        metrics: Metrics,
        keyring: Keyring | None = None,
        own: str | None = None,
    ) -> None:
        self.client, self.keys, self.period = client, keys, period
        self.metrics, self.keyring = metrics, keyring
        self.own = own  # the name of the daemon's connections (their age counts too)
        self.connections = Connections()
        self.listing_seconds = 0.0  # the last CLIENT LIST's round trip

    def recently_gone(self, now: float) -> frozenset[str]:
        """The workers announced gone in the last RECENT_SECONDS (none listed since)."""
        return self.connections.recently_gone(now, RECENT_SECONDS)

    @property
    def pause(self) -> float:
        """Between two listings: a worker learns of a peer's death within two of them. The one
        that confirms a missing connection comes after `period`, as in a small job, however
        long the listings take: a large job's lost host costs one spaced pause, not two."""
        if self.connections.missing:
            return self.period
        return max(self.period, min(LISTING_SPACING * self.listing_seconds, MAX_LISTING_PAUSE))

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`. Denied CLIENT LIST (an ACL without it): said once, and peers are then
        found by the heartbeat timeout and the rendezvous alone."""
        await self._restore()
        failing = False
        while not stop.is_set():
            try:
                await self.tick()
                if failing:
                    log.info("connection watch: Redis answers again")
                failing = False
            except NoPermissionError as e:
                log.error(
                    "CLIENT LIST denied (%s): dead workers are found by the heartbeat timeout "
                    "only; give the daemon's user +client|list (docs/daemon.md)", e,
                )  # fmt: skip
                await stop.wait()
                return
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("connection watch: %s", e)
                failing = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.pause)

    async def tick(self) -> Notice:
        began = time.perf_counter()
        raw = await self.client.execute_command("CLIENT", "LIST", "TYPE", "normal")
        self.listing_seconds = time.perf_counter() - began
        notice, docs = announce(
            self.connections, raw, self.keys.job, self.keyring, time.time(), self.own
        )
        if docs is not None:
            self.metrics.peer_notices.labels("gone").inc(len(notice.gone))
            self.metrics.peer_notices.labels("live").inc(len(notice.live))
            current, message = docs
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.set(self.keys.gone, current)
                pipe.publish(self.keys.liveness_channel, message)
                await pipe.execute()
        return notice

    async def _restore(self) -> None:
        try:
            raw = await self.client.get(self.keys.gone)
            if raw is None:
                return
            doc = json.loads(raw)
            if self.keyring is not None:
                self.keyring.verify_doc("liveness", self.keys.job, doc)
            self.connections.restore(doc)
        except (RedisError, OSError, ValueError, AuthError) as e:
            log.warning("the gone workers announced before are not taken up: %s", e)
