"""Durable commits and plan publication, in one atomic Lua script.

Everything a decision changes lands in Redis at once, or not at all: the plan key (and its compact,
packed copy and its delta from the plan before, which the workers read), the generation counter,
the job snapshot, the decision and transition records, the dead letters, the XACK of the stream
entries it answers, and the PUBLISH of the new generation. A daemon killed at any point
either committed all of it (the entries are acknowledged and never seen again) or nothing (they
are still pending and a restarted daemon reads them again). The lease check (daemon/lease.py)
refuses the commit of a daemon that no longer leads the job, and the generation check makes a
daemon fail loudly instead of publishing a generation twice, or finds that Redis lost the state
(it holds an earlier generation than this daemon published).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from chameleond.daemon.lease import Lease, hold_lua
from chameleond.daemon.redis_errors import ErrorCode, lua_error
from chameleond.protocol import CONSUMER_GROUP, Keys
from chameleond.records import Record

STATE_LOST = lua_error(
    ErrorCode.STATE_LOST,
    "'state lost: Redis holds generation ' .. cur .. ', this daemon published ' .. expected",
)
GENERATION_CONFLICT = lua_error(
    ErrorCode.GENERATION_CONFLICT,
    "'generation conflict: Redis holds ' .. cur .. ', this daemon expected ' .. expected"
    " .. ' (is a second chameleond running for this job?)'",
)
COMMIT_LUA = (
    hold_lua("KEYS[6]", "ARGV[11]", "ARGV[12]", extend=False)
    + f"""
local cur = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
local expected = tonumber(ARGV[1])
if cur < expected then
  {STATE_LOST}
end
if cur ~= expected then
  {GENERATION_CONFLICT}
end
"""
    + """
local gen = tonumber(ARGV[2])
if ARGV[3] ~= '' then
  if gen <= cur then return redis.error_reply('generation must increase') end
  redis.call('SET', KEYS[2], ARGV[3])
  redis.call('SET', KEYS[7], ARGV[13])
  if ARGV[14] ~= '' then
    redis.call('SET', KEYS[8], ARGV[14])
  else
    redis.call('DEL', KEYS[8])
  end
  redis.call('HSET', KEYS[1], 'generation', ARGV[2])
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'snapshot', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'progress', ARGV[5]) end
for _, rec in ipairs(cjson.decode(ARGV[6])) do
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[9], '*', unpack(rec))
end
for _, rec in ipairs(cjson.decode(ARGV[7])) do
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[9], '*', unpack(rec))
end
for i = 15, #ARGV, 500 do
  redis.call('XACK', KEYS[4], ARGV[10], unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
if ARGV[3] ~= '' then redis.call('PUBLISH', ARGV[8], ARGV[2]) end
return cur
"""
)


def flat(fields: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in fields.items():
        out += [str(k), v if isinstance(v, str) else json.dumps(v)]
    return out


@dataclass
class Commit:
    """One atomic write. `plan_json` non-empty publishes generation `generation`."""

    expected_generation: int
    generation: int
    plan_json: str = ""
    plan_packed: bytes = b""  # the plan as the workers read it (protocol.packed_plan)
    plan_delta: bytes = b""  # zlib-packed core.plandelta delta from the plan before (b"": none)
    snapshot: str | None = None  # the job's snapshot, as stored (signed JSON)
    progress: dict[str, Any] | None = None
    records: list[Record] = field(default_factory=list)
    dead_letters: list[list[str | bytes]] = field(default_factory=list)
    acks: Sequence[str] = ()

    def empty(self) -> bool:
        return not (
            self.plan_json
            or self.snapshot is not None
            or self.progress is not None
            or self.records
            or self.dead_letters
            or self.acks
        )


class Broadcaster:
    def __init__(
        self, client: aioredis.Redis, keys: Keys, lease: Lease, records_maxlen: int = 10_000
    ) -> None:
        self.client = client
        self.keys = keys
        self.lease = lease  # every commit checks that this daemon still leads the job
        self.records_maxlen = records_maxlen
        self._script = client.register_script(COMMIT_LUA)

    async def commit(self, c: Commit) -> None:
        k = self.keys
        dead = [[_text(x) for x in rec] for rec in c.dead_letters]
        plan = c.plan_packed if c.plan_json else b""
        args: list[str | int | bytes] = [
            c.expected_generation,
            c.generation,
            c.plan_json,
            c.snapshot if c.snapshot is not None else "",
            json.dumps(c.progress, separators=(",", ":")) if c.progress is not None else "",
            json.dumps([flat(r.to_fields()) for r in c.records]),
            json.dumps(dead),
            k.plans_channel,
            self.records_maxlen,
            CONSUMER_GROUP,
            self.lease.token,
            self.lease.ttl_ms,
            plan,
            c.plan_delta if len(c.plan_delta) * 2 < len(plan) else b"",
            *c.acks,
        ]
        keys = [k.state, k.plan, k.decisions, k.events, k.dead, k.leader, k.plan_packed,
                k.plan_delta]  # fmt: skip
        await self._script(keys=keys, args=args)

    async def nudge(self, generation: int) -> None:
        """Publish the current generation again: a fenced worker that missed it learns it."""
        await self.client.publish(self.keys.plans_channel, str(generation))


def _text(x: str | bytes) -> str:
    # Dead letters keep the original fields; bytes that are not UTF-8 are shown escaped so the
    # record stays readable (the reason says the field was not UTF-8).
    return x.decode("utf-8", "backslashreplace") if isinstance(x, bytes) else x
