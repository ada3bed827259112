"""The job's leader lease: one chameleond at a time decides for a job.

Two daemons on one job (a rolling update with surge, a second host started by mistake) would
each read part of the stream and acknowledge entries the other never applies. So a daemon leads
only while it holds `chameleon:{job}:leader`, a key with a time to live that names it. The
lease lasts the `lease_seconds` setting (daemon/config.py; default 10 s). The holder renews it
every third of that, and every commit checks it inside the commit script (daemon/broadcast.py),
so a daemon that lost the lease cannot write anything, not even one commit late. Any other
daemon stands by, serving /healthz and /metrics, and takes over once the lease lapses: it looks
every POLL_SECONDS, and just after the lease's expiry when that comes sooner, so at most
`lease_seconds` after the leader's last renewal (and the time of one SET).

It does not always wait that long. The leader names its Redis connections after its lease token
(`connection_name`); a standby that saw them in CLIENT LIST and then finds none for
`gone_seconds` in a row (a process killed with -9 loses every connection at once) takes the
lease over from that holder. If the holder was only cut off from Redis, the commit script
refuses everything it tries afterwards (it no longer holds the lease), so an early takeover can
cost a needless hand-over, never a second writer.

A new process under the holder's own consumer name takes the lease at once: the consumer name
identifies a daemon (its pending entries belong to that name), so that is the same daemon
restarted, and the old process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from chameleond.daemon.redis_errors import ErrorCode, error_message, has_code, lua_error
from chameleond.protocol import Keys

log = logging.getLogger("chameleond")

POLL_SECONDS = 0.25  # a standby looks at the lease (and the holder's connections) this often


def new_incarnation() -> str:
    """A token for this process: the second half of its lease token and its connections' name."""
    return secrets.token_hex(8)


def connection_name(incarnation: str) -> str:
    """The CLIENT SETNAME of every connection of the daemon process with this incarnation."""
    return f"chameleond:{incarnation}"


def gone_seconds(lease_seconds: float) -> float:
    """How long a standby must find none of the holder's connections before it takes over: long
    enough for a live holder to reconnect after a Redis restart (its reads retry every 0.5 s),
    short enough to leave most of the lease."""
    return min(2.0, lease_seconds / 4)


def hold_lua(key: str, token: str, ttl_ms: str, extend: bool = True) -> str:
    """Lua that holds the lease for `token` (Lua expressions: KEYS[i], ARGV[i]) or fails with
    LEASELOST: it re-takes one that lapsed during an outage if nobody took it meanwhile, and with
    `extend` refreshes our own. The renewal and every commit (daemon/broadcast.py) begin with it;
    a commit does not extend the lease (the renewal every third of it does), which spares Redis
    a command per batch read."""
    refuse = lua_error(ErrorCode.LEASE_LOST, "'lease lost: ' .. holder .. ' leads the job'")
    refresh = f"\nelse\n  redis.call('PEXPIRE', {key}, {ttl_ms})" if extend else ""
    return f"""
local holder = redis.call('GET', {key})
if holder == false then
  redis.call('SET', {key}, {token}, 'PX', {ttl_ms})
elseif holder ~= {token} then
  {refuse}{refresh}
end
"""


RENEW_LUA = hold_lua("KEYS[1]", "ARGV[1]", "ARGV[2]") + "return 1\n"
# An entry written to a stream only while holding the lease (the detector's suspicions).
XADD_LUA = (
    hold_lua("KEYS[1]", "ARGV[1]", "ARGV[2]")
    + """local i = 3
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
"""
)
XADD_BATCH = 512  # entries per script call: a bound on the time Redis spends in one


def lost(error: BaseException) -> bool:
    """Whether a Redis error says another daemon holds the lease."""
    return has_code(error, ErrorCode.LEASE_LOST)


class LeaseLost(RuntimeError):
    """Another daemon leads the job now: this one must stop deciding."""


class Lease:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        consumer: str,
        seconds: float,
        incarnation: str | None = None,
    ) -> None:
        self.client = client
        self.key = keys.leader
        self.consumer = consumer
        # The consumer name, then this process (whose connections are named after it).
        self.token = f"{consumer} {incarnation or new_incarnation()}"
        self.ttl_ms = int(seconds * 1000)
        self.gone_seconds = gone_seconds(seconds)
        self.holder = ""  # who leads, as last seen while standing by
        self.taken_over = ""  # the holder this daemon took the lease from, if any
        self._seen: str = ""  # a holder whose connections this standby has seen
        self._missing_since: float | None = None  # when they were first found gone
        # When Redis answered again after an error (None: no error since the last look). A lease
        # that lapsed while Redis was away is left to its holder for `gone_seconds`: the holder
        # was cut off like this daemon, not dead, and re-takes it when renewing.
        self._back_since: float | None = None
        self._pause = POLL_SECONDS  # until the next look: sooner when the lease expires sooner
        self._renew = client.register_script(RENEW_LUA)
        self._xadd = client.register_script(XADD_LUA)

    async def acquire(self, stop: asyncio.Event, standing_by: Callable[[str], None]) -> bool:
        """Wait until this daemon holds the lease (True) or `stop` is set (False). Calls
        `standing_by(holder)` whenever it finds another daemon leading."""
        while not stop.is_set():
            try:
                if await self._try():
                    self.holder = self.token
                    return True
                standing_by(self.holder)
            except RedisError as e:
                self._missing_since = None  # what CLIENT LIST showed says nothing now
                if self._back_since is None:
                    log.warning("leader lease: %s; trying again", e)
                self._back_since = -1.0
            await _sleep(stop, self._pause)
            self._pause = POLL_SECONDS
        return False

    async def _try(self) -> bool:
        if self._back_since is not None:
            now = time.monotonic()
            if self._back_since < 0:
                self._back_since = now
            if now - self._back_since < self.gone_seconds:
                return False  # Redis is just back: the holder gets the first chance to renew
            self._back_since = None
        if await self.client.set(self.key, self.token, nx=True, px=self.ttl_ms):
            if self.holder:
                self.taken_over = self.holder
                log.warning("leader lease taken: %r let it lapse", self.holder)
            return True
        raw = await self.client.get(self.key)
        if raw is None:
            return False  # it lapsed just now: the next look takes it
        holder = raw.decode() if isinstance(raw, bytes) else str(raw)
        if holder.split(" ")[0] == self.consumer:
            # The same daemon restarted: its old process is gone. Take over only that holder.
            if await self._take(raw):
                log.info("leader lease taken over from an earlier process (%s)", holder)
                return True
            return False
        if await self._holder_gone(holder):
            if await self._take(raw):
                self.taken_over = holder
                log.warning(
                    "leader lease taken over from %r: its connections to Redis are gone", holder
                )
                return True
            return False
        ttl_ms = await self.client.pttl(self.key)
        if isinstance(ttl_ms, int) and ttl_ms >= 0:
            self._pause = min(POLL_SECONDS, ttl_ms / 1000 + 0.002)
        if holder != self.holder:
            log.warning(
                "standing by: job led by %r; taking over within %.0f s of its lease lapsing",
                holder, self.ttl_ms / 1000,
            )  # fmt: skip
        self.holder = holder
        return False

    async def _take(self, raw: Any) -> bool:
        """Replace the lease held by `raw` with ours, unless it changed meanwhile."""
        async with self.client.pipeline(transaction=True) as p:
            await p.watch(self.key)
            if await p.get(self.key) != raw:
                return False
            p.multi()
            p.set(self.key, self.token, px=self.ttl_ms)
            await p.execute()
        return True

    async def _holder_gone(self, holder: str) -> bool:
        """Whether the holder's process is gone: its named connections were there and have been
        missing for `gone_seconds`. A holder never seen connected (another version, or it died
        before this daemon looked) is waited out until its lease lapses."""
        name = connection_name(holder.rsplit(" ", 1)[-1])
        clients: Any = await self.client.client_list()
        present = any(_text(c.get("name", "")) == name for c in clients)
        now = time.monotonic()
        if present or self._seen != holder:
            if present:
                self._seen = holder
            self._missing_since = None
            return False
        if self._missing_since is None:
            self._missing_since = now
        return now - self._missing_since >= self.gone_seconds

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew until `stop`; raises LeaseLost when another daemon took the lease. A Redis
        outage is waited out: if the lease lapsed meanwhile and nobody took it, renewing takes
        it again; if somebody did, every commit of this daemon already fails."""
        failing = False
        while not stop.is_set():
            pause = self.ttl_ms / 3000
            try:
                await self._renew(keys=[self.key], args=[self.token, self.ttl_ms])
                if failing:
                    log.info("leader lease renewed again")
                failing = False
            except RedisError as e:
                if lost(e):
                    raise LeaseLost(error_message(e)) from None
                if not failing:
                    log.warning("leader lease not renewed: %s; retrying", e)
                failing = True
                pause = POLL_SECONDS  # renew as soon as Redis answers again
            await _sleep(stop, pause)

    async def xadd(self, stream: str, entries: Sequence[Mapping[str, str]]) -> None:
        """XADD each of `entries` to `stream` only if this daemon still leads, in order, a batch
        per round trip; raises LeaseLost if not. A daemon that stalled past its lease must not
        write what it concluded meanwhile."""
        for start in range(0, len(entries), XADD_BATCH):
            args: list[Any] = [self.token, self.ttl_ms]
            for fields in entries[start : start + XADD_BATCH]:
                args.append(2 * len(fields))
                for k, v in fields.items():
                    args += [k, v]
            try:
                await self._xadd(keys=[self.key, stream], args=args)
            except RedisError as e:
                if lost(e):
                    raise LeaseLost(error_message(e)) from None
                raise

    async def release(self) -> None:
        """Give the lease up at a clean stop, so a standby takes over at once."""
        try:
            await self.client.eval(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end",
                1, self.key, self.token,
            )  # fmt: skip
        except RedisError as e:
            log.warning("leader lease not released (%s): it lapses in %.0f s", e,
                        self.ttl_ms / 1000)  # fmt: skip


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def _sleep(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
