"""The worker's link to its job's Redis: events it sends (`Reporter`), plans it watches
(`PlanWatcher`), its `Heartbeat`, and the peers it believes alive (liveness, `PeerWatch`).

Events are typed (chameleond/events.py) and XADDed to `Keys(job).events` as their flat string
fields (docs/protocol.md). Plans arrive as the `Keys(job).plan` key, announced on
`Keys(job).plans_channel`; the watcher re-reads the key on every announcement and once a second
anyway, so a missed message or a restart still converges.

Liveness: every Redis connection of a worker carries the name
`chameleon-worker:{job}:{id}:{incarnation}` (the incarnation is new for every process). The
kernel closes a killed process's sockets, so Redis drops its connections at once; a peer without any
named connection is gone. A survivor names a peer in a fault only on that evidence, never on a
collective error alone (the error may come from a live peer that itself gave up the step).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping

import redis
from redis.client import PubSub

from chameleond.auth import AuthError, Keyring
from chameleond.core.plan import Plan, PlanError, plan_from_dict
from chameleond.events import Event, Fault
from chameleond.events import Heartbeat as Beat
from chameleond.protocol import Keys
from chameleond.worker._outbox import Outbox

log = logging.getLogger("chameleon.worker")

HEARTBEAT_SECONDS = 0.5
_PLAN_POLL_SECONDS = 1.0
# After a Redis restart every live worker reconnects within a heartbeat or two (redis-py's retries
# back off to 1 s); until then a missing connection says nothing.
RECONNECT_SECONDS = 3
# A peer missing from the connection list counts as gone for PeerWatch after this long in a row
# (a live worker whose connections dropped is back within a heartbeat).
PEER_GONE_CONFIRM_SECONDS = 1.0


def connection_name(job: str, worker: str, incarnation: str) -> str:
    """`chameleon-worker:{job}:{worker}:{incarnation}`; the incarnation tells processes apart."""
    return f"chameleon-worker:{job}:{worker}:{incarnation}"


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

    def start(self) -> None:
        self.outbox.start()

    def close(self, timeout: float) -> int:
        """Send what is kept, for at most `timeout` seconds; the number of writes left unsent."""
        return self.outbox.close(timeout)

    def report(self, event: Event, *, keep: bool = True) -> None:
        """Send `event` (chameleond/events.py) as its flat fields; `keep`: hold it through a Redis
        outage (a heartbeat is not kept: a stale one says nothing)."""
        self._xadd(event.to_fields(), keep)

    def fault(self, failed: str, cause: str, *, generation: int, at: float) -> None:
        """Name `failed` out of `generation`, seen at `at` (this worker's clock) for `cause`."""
        self.report(Fault(failed, cause[:500], generation, reporter=self.worker, at=at))

    def set_key(self, key: str, value: str) -> None:
        """SET `key`, in order with the events (a later event is never seen before it)."""
        self.outbox.put(lambda: self._redis.set(key, value))

    def _xadd(self, entry: dict[str, str], keep: bool) -> None:
        if self.keyring is not None:
            entry = self.keyring.sign_event(self._keys.job, entry)

        def write() -> object:
            # No MAXLEN: a worker's trim cuts from the head, past entries the daemon has not
            # acknowledged yet (a fault, while the daemon restarts). The daemon trims, and
            # never past an unacknowledged entry (daemon/consumer.py).
            return self._redis.xadd(self._keys.events, entry)  # type: ignore[arg-type]

        self.outbox.put(write, keep=keep)


class Heartbeat(threading.Thread):
    """A heartbeat every HEARTBEAT_SECONDS until stopped; none is kept while Redis is away."""

    def __init__(self, reporter: Reporter) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self._reporter = reporter
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                reporter = self._reporter
                beat = Beat(reporter.worker, at=time.time(), refused=reporter.refused.count)
                reporter.report(beat, keep=False)
            except redis.RedisError as e:  # the outbox's error; the main thread ends with it
                log.warning("heartbeat not sent: %s", e)
                return
            self._stop_event.wait(HEARTBEAT_SECONDS)

    def stop(self) -> None:
        self._stop_event.set()


class PeerWatch(threading.Thread):
    """Calls `on_gone` once with the peers `find_gone` returns (polled every `period` seconds),
    once they have been gone for `confirm` seconds in a row, until stopped.

    gloo fails a survivor's pending operation within milliseconds of a peer's death, because the
    kernel closes the dead process's sockets. NCCL and HCCL do not: the survivors' device work
    waits until a timeout. A worker on those backends runs this watch for the life of a
    generation and aborts the generation's groups when a member's process is gone. A live worker
    whose Redis connections drop for a moment (a network blip at its host) is missing from the
    connection list until it reconnects, within half a second (its heartbeat's next send): a peer
    counts as gone only when it stays missing for `confirm` seconds, so the blip does not cost
    the generation.
    """

    def __init__(
        self,
        find_gone: Callable[[], list[str]],
        on_gone: Callable[[list[str]], None],
        period: float = 0.1,
        confirm: float = PEER_GONE_CONFIRM_SECONDS,
    ) -> None:
        super().__init__(name="peer-watch", daemon=True)
        self._find_gone = find_gone
        self._on_gone = on_gone
        self._period = period
        self._confirm = confirm
        self._stop_event = threading.Event()

    def run(self) -> None:
        missing: dict[str, float] = {}  # peer -> when it was first seen missing, in a row
        while not self._stop_event.wait(self._period):
            try:
                found = self._find_gone()
            except (redis.RedisError, OSError) as e:
                log.warning("peer watch: %s", e)
                continue
            now = time.monotonic()
            missing = {w: missing.get(w, now) for w in found}
            confirmed = sorted(w for w, since in missing.items() if now - since >= self._confirm)
            if confirmed:
                self._on_gone(confirmed)
                return

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
    ) -> None:
        super().__init__(name="plan-watcher", daemon=True)
        self._redis = client
        self._keys = Keys(job)
        self._keyring = keyring  # a plan must carry the job's signature (None: not checked)
        self.refused = refused or Refused()
        self._cond = threading.Condition()
        self._plan: Plan | None = None
        self._stop_event = threading.Event()
        self._bad_generation = -1
        # The bytes of the plan held: the once-a-second read skips verifying and parsing them again.
        self._accepted_raw: bytes | str | None = None

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
        raw = self._redis.get(self._keys.plan)
        if raw is None or raw == self._accepted_raw:
            return  # nothing new: the plan held was read from these very bytes
        try:
            doc = json.loads(raw)
            if self._keyring is not None:
                if not isinstance(doc, dict):
                    raise AuthError("not a JSON object")
                self._keyring.verify_doc("plan", self._keys.job, doc)
            plan = plan_from_dict(doc)
        except AuthError as e:
            # Unsigned or forged: whoever wrote it is not the job's daemon. Training keeps the
            # plan it has; the daemon's next plan replaces the forged one.
            self.refused.note(f"the plan under {self._keys.plan}", raw, str(e))
            return
        except (json.JSONDecodeError, PlanError) as e:
            # A bad plan is the daemon's bug; training keeps the plan it has. Logged once.
            gen = hash(raw) & 0x7FFFFFFF
            if gen != self._bad_generation:
                log.error("ignoring an undecodable plan under %s: %s", self._keys.plan, e)
                self._bad_generation = gen
            return
        with self._cond:
            if self._plan is None or plan.generation > self._plan.generation:
                self._plan = plan
                self._accepted_raw = raw
                self._cond.notify_all()

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
                        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
                        pubsub.subscribe(self._keys.plans_channel)
                        self.refresh()  # a plan published while not subscribed
                        last = time.monotonic()
                    msg = pubsub.get_message(timeout=0.2)
                    if msg is not None or time.monotonic() - last > _PLAN_POLL_SECONDS:
                        self.refresh()
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

    def stop(self) -> None:
        self._stop_event.set()


def _close_quietly(pubsub: PubSub) -> None:
    with contextlib.suppress(redis.RedisError, OSError):  # its connection is already broken
        pubsub.close()


def live_incarnations(client: redis.Redis, job: str) -> set[tuple[str, str]] | None:
    """(worker, incarnation) of every process of `job` with an open Redis connection; None when
    Redis itself started less than RECONNECT_SECONDS ago (no connection is older): live workers
    may not have reconnected yet, so a missing connection is not yet evidence of anything."""
    prefix = f"chameleon-worker:{job}:"
    out = set()
    oldest = 0
    for c in client.client_list():
        oldest = max(oldest, int(c.get("age", 0)))
        name = str(c.get("name", ""))
        if name.startswith(prefix):
            worker, _, incarnation = name[len(prefix) :].rpartition(":")
            out.add((worker, incarnation))
    return out if oldest >= RECONNECT_SECONDS else None


def gone(live: set[tuple[str, str]] | None, peers: Mapping[str, str | None]) -> list[str]:
    """Peers whose process is gone. A peer known by incarnation is gone when that process has no
    connection (a new process under the same id does not keep it alive); one known by id only is
    gone when no process of that id has one. Nobody, when `live` is unknown (None)."""
    if live is None:
        return []
    ids = {w for w, _ in live}
    return sorted(w for w, inc in peers.items() if ((w, inc) not in live if inc else w not in ids))


def dead_peers(
    client: redis.Redis,
    job: str,
    peers: Mapping[str, str | None],
    *,
    settle_seconds: float = 0.3,
) -> list[str]:
    """Peers whose process is gone, polled briefly so that Redis has seen a fresh death."""
    deadline = time.monotonic() + settle_seconds
    while True:
        try:
            dead = gone(live_incarnations(client, job), peers)
        except redis.RedisError as e:  # denied by an ACL, or Redis away
            log.warning("cannot list connections to find the failed peer: %s", e)
            return []
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.02)
