"""Who builds a generation's groups: an all-or-nothing agreement among the plan's workers.

Each worker of a plan joins the generation in Redis; the generation becomes `complete` when every
worker has joined, or `abandoned` when any worker gives it up first (a newer plan appeared, a member
is gone, or time ran out). Both transitions are atomic Lua scripts, so every worker sees the same
outcome: either all of them build the groups, or none does. Without this, a worker that moved on
to a newer plan in the middle of a rendezvous would leave the others stuck in a half-connected
group until its timeout. A Redis restart shorter than the timeout only delays the rendezvous.

The group prefix is derived from the members' incarnations, so a process restarted under the same
worker id never meets entries its dead predecessor left behind; a generation that completed with a
predecessor cannot be joined by the successor (it waits for a newer plan).

`start_together` is a plain counting barrier, for the start-up profile (see startup.py).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import redis

from chameleond.worker._outbox import through_outage
from chameleond.worker._store import KEY_TTL_SECONDS

T = TypeVar("T")

_JOIN = """
local state = redis.call('GET', KEYS[1])
if state then return state end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[4])
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[3]) then
  redis.call('SET', KEYS[1], 'complete', 'EX', ARGV[4])
  return 'complete'
end
return 'open'
"""

_ABANDON = """
local state = redis.call('GET', KEYS[1])
if state then return state end
redis.call('SET', KEYS[1], 'abandoned', 'EX', ARGV[1])
return 'abandoned'
"""


def start_together(
    client: redis.Redis, key: str, me: str, count: int, timeout_seconds: float, ttl: int = 60
) -> int:
    """Arrive at a barrier (a hash of who arrived, kept `ttl` seconds) and wait until `count`
    workers have, or `timeout_seconds` passed: returns how many had arrived. A worker counts once,
    however often it arrives."""
    pipe = client.pipeline()
    pipe.hset(key, me, "1")
    pipe.expire(key, ttl)
    pipe.hlen(key)
    arrived = int(pipe.execute()[-1])
    deadline = time.monotonic() + timeout_seconds
    pause = 0.002  # doubling to 0.02 s: the others may be seconds away, and share the cores
    while arrived < count and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
        arrived = int(client.hlen(key))
    return arrived


class GenerationAbandoned(RuntimeError):
    """The generation will not be built (the message says why). `absent`: the members that had
    not joined when it was given up."""

    def __init__(self, why: str, absent: tuple[str, ...] = ()) -> None:
        super().__init__(why)
        self.absent = absent


class BuiltWithoutMe(GenerationAbandoned):
    """The generation was built by an earlier process of this worker: this one waits for a plan
    made after it registered."""


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def join_generation(
    client: redis.Redis,
    base: str,
    me: str,
    incarnation: str,
    members: tuple[str, ...],
    *,
    timeout: timedelta,
    give_up: Callable[[], str | None],
) -> tuple[str, dict[str, str]]:
    """Join; once complete, return the group prefix and each member's incarnation.
    `give_up()` returns a reason to abandon, or None."""
    state_key, members_key = f"{base}state", f"{base}members"
    seconds = timeout.total_seconds()

    def call(c: Callable[[], T]) -> T:  # a Redis restart only delays the rendezvous
        return through_outage(c, seconds, "a rendezvous")

    join = (_JOIN, 2, state_key, members_key, me, incarnation, len(members), KEY_TTL_SECONDS)
    state = _text(call(lambda: client.eval(*join)))
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.002
    reason = ""
    while state == "open":
        why = give_up()
        if why is None and time.monotonic() > deadline:
            why = f"not every member joined within {timeout.total_seconds():.0f}s"
        if why is not None:
            reason = why
            state = _text(call(lambda: client.eval(_ABANDON, 1, state_key, KEY_TTL_SECONDS)))
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
        state = _text(call(lambda: client.get(state_key)) or "open")
    joined = {_text(k): _text(v) for k, v in call(lambda: client.hgetall(members_key)).items()}
    if state == "abandoned":
        # Nobody joins an abandoned generation (_JOIN), so every member reads the same list.
        absent = tuple(m for m in members if m not in joined)
        raise GenerationAbandoned(f"generation abandoned: {reason or 'by another member'}", absent)
    if joined.get(me) != incarnation:
        raise BuiltWithoutMe("the generation was built by an earlier process of this worker")
    digest = hashlib.sha1(
        "|".join(joined[w] for w in members).encode(), usedforsecurity=False
    ).hexdigest()[:12]
    return f"{base}{digest}/", {w: joined[w] for w in members}
