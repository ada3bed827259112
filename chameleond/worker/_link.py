"""The worker's link to its job's Redis: events it sends (`Reporter`), plans it watches
(`PlanWatcher`, with the daemon's liveness notices), and its `Heartbeat`.

Events are typed (chameleond/events.py) and XADDed to `Keys(job).events` as their flat string
fields (docs/protocol.md). Plans arrive as the `Keys(job).plan` key (read in its compact, packed
form, `Keys(job).plan_packed`), announced on `Keys(job).plans_channel`; the watcher reads it on an
announcement of a newer generation, on every (re)subscription, and when the generation the daemon
committed (a few bytes, polled every PLAN_POLL_SECONDS) is newer than the one it holds, so a
missed message or a restart still converges without every worker re-reading the whole plan.

Liveness: every Redis connection of a worker carries the name
`chameleon-worker:{job}:{id}:{incarnation}` (the incarnation is new for every process). The
kernel closes a killed process's sockets, so Redis drops its connections at once; the daemon
lists them and announces the processes gone (chameleond/daemon/connwatch.py), and the plan
watcher hands its notices to the worker's `PeerNotices` (chameleond/worker/_liveness.py). A
survivor names a peer in a fault only on that evidence, never on a collective error alone (the
error may come from a live peer that itself gave up the step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import threading
import time
import zlib
from typing import Any

import redis
from redis.client import PubSub

from chameleond.auth import AuthError, Keyring
from chameleond.core.plan import Plan, PlanError, plan_from_dict
from chameleond.core.plandelta import DeltaError, apply_delta, parse_delta
from chameleond.events import HEARD, Event, Fault
from chameleond.events import Heartbeat as Beat
from chameleond.protocol import (
    HEARTBEAT_SECONDS,
    PLAN_POLL_SECONDS,
    Keys,
    unpacked_plan,
    worker_connection_name,
)
from chameleond.redisurl import xadd_replicated
from chameleond.worker._liveness import PeerNotices
from chameleond.worker._outbox import Outbox

log = logging.getLogger("chameleon.worker")

connection_name = worker_connection_name


def new_incarnation() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


class Refused:
    """What this worker refused to act on because it was unsigned or forged (a plan, the spec):
    counted (its heartbeats carry the count as `refused`) and logged once per distinct value."""

    def __init__(self) -> None:
        self.count = 0
        self._last: tuple[str, int] | None = None
        self._lock = threading.Lock()

    def note(self, what: str, raw: object, why: str) -> None:
        seen = (what, hash(raw))
        with self._lock:
            self.count += 1
            fresh, self._last = seen != self._last, seen
        if fresh:
            log.error("refused %s: %s (docs/security.md)", what, why)


class Reporter:
    """The worker's events, one stream entry of flat string fields each, sent in order through an
    `Outbox`: a Redis outage delays them and never stops training (chameleond/worker/_outbox.py).
    With a keyring each entry is signed (chameleond/auth.py)."""

    def __init__(
        self, client: redis.Redis, job: str, worker: str, keyring: Keyring | None = None
    ) -> None:
        self._redis = client
        self._keys = Keys(job)
        self.worker = worker
        self.keyring = keyring
        self.refused = Refused()
        self.outbox = Outbox()
        self.last_report = 0.0  # time.monotonic() of the last HEARD event handed to the outbox

    def start(self) -> None:
        self.outbox.start()

    def close(self, timeout: float) -> int:
        """Send what is kept, for at most `timeout` seconds; the number of writes left unsent."""
        return self.outbox.close(timeout)

    def report(self, event: Event, *, keep: bool = True) -> None:
        """Send `event` (chameleond/events.py) as its flat fields; `keep`: hold it through a Redis
        outage (a heartbeat is not kept: a stale one says nothing)."""
        self._xadd(event.to_fields(), keep)
        if isinstance(event, HEARD):
            self.last_report = time.monotonic()

    def fault(self, failed: str, cause: str, *, generation: int, at: float) -> None:
        """Name `failed` out of `generation`, seen at `at` (this worker's clock) for `cause`."""
        fault = Fault(failed, cause[:500], generation, reporter=self.worker, at=at)
        self._xadd(fault.to_fields(), keep=True, replicated=True)

    def set_key(self, key: str, value: str) -> None:
        """SET `key`, in order with the events (a later event is never seen before it)."""
        self.outbox.put(lambda: self._redis.set(key, value))

    def _xadd(self, entry: dict[str, str], keep: bool, replicated: bool = False) -> None:
        """`replicated`: under Sentinel, held until a replica has it too (a fault must survive a
        failover; chameleond/redisurl.py)."""
        if self.keyring is not None:
            entry = self.keyring.sign_event(self._keys.job, entry)

        def write() -> object:
            # No MAXLEN: a worker's trim cuts from the head, past entries the daemon has not
            # acknowledged yet (a fault, while the daemon restarts). The daemon trims, and
            # never past an unacknowledged entry (daemon/consumer.py).
            if replicated:
                return xadd_replicated(self._redis, self._keys.events, [entry])
            return self._redis.xadd(self._keys.events, entry)  # type: ignore[arg-type]

        self.outbox.put(write, keep=keep)


class Heartbeat(threading.Thread):
    """A heartbeat every `period` seconds until stopped (protocol.heartbeat_seconds: set from the
    job's size before it starts); none is kept while Redis is away. The daemon hears a worker in
    its steps and acks too (HEARD), so a beat is skipped when one of them went out within the
    period, unless the count of refused messages it carries moved: a training worker that
    reports its steps sends about half the beats."""

    def __init__(self, reporter: Reporter, period: float = HEARTBEAT_SECONDS) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self._reporter = reporter
        self.period = period
        self._stop_event = threading.Event()

    def run(self) -> None:
        refused = 0
        while not self._stop_event.is_set():
            try:
                reporter = self._reporter
                quiet = time.monotonic() - reporter.last_report >= self.period * 0.9
                if quiet or reporter.refused.count != refused:
                    refused = reporter.refused.count
                    beat = Beat(reporter.worker, at=time.time(), refused=refused)
                    reporter.report(beat, keep=False)
            except redis.RedisError as e:  # the outbox's error; the main thread ends with it
                log.warning("heartbeat not sent: %s", e)
                return
            self._stop_event.wait(self.period)

    def stop(self) -> None:
        self._stop_event.set()


class PlanWatcher(threading.Thread):
    """Keeps the newest valid plan of the job; `wait_newer` blocks until one above a generation."""

    def __init__(
        self,
        client: redis.Redis,
        job: str,
        keyring: Keyring | None = None,
        refused: Refused | None = None,
        notices: PeerNotices | None = None,
    ) -> None:
        super().__init__(name="plan-watcher", daemon=True)
        self._redis = client
        self._keys = Keys(job)
        # The daemon's liveness notices, taken on the same subscription (None: not followed).
        self.notices = notices
        self._keyring = keyring  # a plan must carry the job's signature (None: not checked)
        self.refused = refused or Refused()
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._stop_event = threading.Event()
        self._bad_generation = -1
        # The bytes of the plan held (its packed copy or its delta): the once-a-second read skips
        # verifying and parsing them again.
        self._accepted_raw: bytes | str | None = None
        self._doc: dict[str, Any] | None = None  # the plan held, as its document

    @property
    def newest(self) -> Plan | None:
        with self._cond:
            return self._plan

    @property
    def newest_generation(self) -> int:
        plan = self.newest
        return plan.generation if plan else 0

    def wait_newer(self, generation: int, timeout: float | None = None) -> Plan | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._plan is None or self._plan.generation <= generation:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._stop_event.is_set():
                    return None
                self._cond.wait(0.2 if left is None else min(left, 0.2))
            return self._plan

    def refresh(self) -> None:
        """Read the plan: as a delta from the plan held (Keys.plan_delta) where the daemon wrote
        one, else its packed copy (Keys.plan_packed), else the plan key itself."""
        if self._doc is not None and (raw := self._redis.get(self._keys.plan_delta)) is not None:
            if raw == self._accepted_raw:
                return
            try:
                delta = parse_delta(zlib.decompress(raw))  # type: ignore[arg-type]
                if _number(delta.get("generation")) <= self._doc.get("generation", 0):
                    return  # the newest plan is the one held
                if delta.get("base") == self._doc.get("generation"):
                    # With the keyring, `_take` checks the made plan's signature: no digest too.
                    made = apply_delta(self._doc, delta, check_digest=self._keyring is None)
                    if self._take(raw, made):
                        return  # else refused: the whole plan is read
                # a delta from another plan: the whole plan is read
            except (DeltaError, zlib.error) as e:  # read it whole
                log.warning("plan delta under %s not used: %s", self._keys.plan_delta, e)
        raw = self._redis.get(self._keys.plan_packed)
        packed = raw is not None
        if raw is None:
            raw = self._redis.get(self._keys.plan)
        if raw is None or raw == self._accepted_raw:
            return  # nothing new: the plan held was read from these very bytes
        try:
            doc = unpacked_plan(raw) if packed else json.loads(raw)  # type: ignore[arg-type]
        except (ValueError, zlib.error) as e:  # PlanError: a compact plan that does not expand
            self._undecodable(raw, e)
            return
        self._take(raw, doc)

    def _take(self, raw: bytes | str, doc: object) -> bool:
        """The plan in `doc` (read from `raw`), held if the job's daemon published it and it is
        newer than the one held; whether the job's daemon published it."""
        try:
            if self._keyring is not None:
                if not isinstance(doc, dict):
                    raise AuthError("not a JSON object")
                self._keyring.verify_doc("plan", self._keys.job, doc)
            if not isinstance(doc, dict):
                raise PlanError("not a JSON object")
            plan = plan_from_dict(doc)
        except AuthError as e:
            # Unsigned or forged: whoever wrote it is not the job's daemon. Training keeps the
            # plan it has; the daemon's next plan replaces the forged one.
            self.refused.note(f"the plan under {self._keys.plan}", raw, str(e))
            return False
        except PlanError as e:
            self._undecodable(raw, e)
            return False
        with self._cond:
            if self._plan is None or plan.generation > self._plan.generation:
                self._plan, self._doc = plan, doc
                self._accepted_raw = raw
                self._cond.notify_all()
        return True

    def _undecodable(self, raw: bytes | str, e: Exception) -> None:
        """A bad plan is the daemon's bug; training keeps the plan it has. Logged once."""
        gen = hash(raw) & 0x7FFFFFFF
        if gen != self._bad_generation:
            log.error("ignoring an undecodable plan under %s: %s", self._keys.plan, e)
            self._bad_generation = gen

    def run(self) -> None:
        pubsub = None
        last = 0.0
        failing = False
        try:
            while not self._stop_event.is_set():
                try:
                    if pubsub is None:
                        # Inside the retry: Redis may be unreachable when the worker starts, or
                        # lost later; a subscription made on a dead connection must be made again.
                        pubsub = self._subscribe()
                        last = time.monotonic()
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is not None and self._is_notice(msg):
                        assert self.notices is not None
                        self.notices.take(msg["data"])
                    elif msg is not None:
                        if _generation(msg) > self.newest_generation:
                            self.refresh()
                    elif time.monotonic() - last > PLAN_POLL_SECONDS:
                        if self._stored_generation() > self.newest_generation:
                            self.refresh()  # an announcement lost while subscribed
                        last = time.monotonic()
                    if failing:
                        log.info("plan watch: Redis answers again")
                        failing = False
                except (redis.RedisError, OSError, ValueError) as e:
                    if self._stop_event.is_set():
                        return
                    if not failing:  # once per outage, not every 0.2 s
                        log.warning("plan watch: %s", e)
                        failing = True
                    if pubsub is not None:
                        _close_quietly(pubsub)
                        pubsub = None
                    self._stop_event.wait(0.2)
        finally:
            if pubsub is not None:
                _close_quietly(pubsub)

    def _subscribe(self) -> PubSub:
        """Subscribe, then read what was published while not subscribed: the plan, and the
        incarnations announced gone."""
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        channels = [self._keys.plans_channel]
        if self.notices is not None:
            channels.append(self._keys.liveness_channel)
        pubsub.subscribe(*channels)
        self.refresh()
        if self.notices is not None and (gone := self._redis.get(self._keys.gone)) is not None:
            self.notices.take(gone)
        return pubsub

    def _stored_generation(self) -> int:
        """The generation the daemon last committed (a few bytes: the plan is read only when it
        is newer than the one held)."""
        raw = self._redis.hget(self._keys.state, "generation")
        try:
            return int(raw) if raw is not None else 0
        except ValueError:
            return 0

    def _is_notice(self, msg: dict[str, object]) -> bool:
        channel = msg.get("channel")
        if isinstance(channel, bytes):
            channel = channel.decode()
        return self.notices is not None and channel == self._keys.liveness_channel

    def stop(self) -> None:
        self._stop_event.set()


def _generation(msg: dict[str, object]) -> float:
    """The generation an announcement names; infinite when it names none (the plan is read)."""
    data = msg.get("data")
    try:
        return int(data) if isinstance(data, bytes | str) else math.inf
    except ValueError:
        return math.inf


def _number(x: object) -> float:
    return x if isinstance(x, int | float) and not isinstance(x, bool) else math.inf


def _close_quietly(pubsub: PubSub) -> None:
    with contextlib.suppress(redis.RedisError, OSError):  # its connection is already broken
        pubsub.close()
