"""The wire protocol between chameleond, the workers and operators (documented in docs/protocol.md).

Every Redis key lives under `chameleon:{job}:`. Events are flat string fields on one stream, so a
person can send any of them with `redis-cli XADD`; each is defined once, in chameleond/events.py,
which writes it (`to_fields`) and reads it (`from_fields`). `read_event` reads a stream entry in
one call (its size, its signature, its fields) into a typed event, or raises `EventError` with a
reason a person understands (what the dead-letter stream records) or `AuthError`. The event
types and the parser table here are made from `EVENT_CLASSES`.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from chameleond.auth import Keyring
from chameleond.core.plancompact import compact, expand
from chameleond.events import EVENT_CLASSES, Event
from chameleond.wire import MAX_BYTES as MAX_BYTES
from chameleond.wire import MAX_ID_LEN as MAX_ID_LEN
from chameleond.wire import MAX_REASON_LEN as MAX_REASON_LEN
from chameleond.wire import MAX_SECONDS as MAX_SECONDS
from chameleond.wire import MAX_TEXT_LEN as MAX_TEXT_LEN
from chameleond.wire import EventError as EventError
from chameleond.wire import shorten as shorten
from chameleond.wire import show

CONSUMER_GROUP = "chameleond"
EVENT_TYPES = tuple(c.type for c in EVENT_CLASSES)
# Bounds of a whole entry (docs/protocol.md, Bounds); those of each field are in chameleond/wire.py.
MAX_EVENT_BYTES = 64 * 1024  # the whole entry, keys and values
MAX_EVENT_BYTES_BY_TYPE = {"profile": 1024 * 1024}  # a profile lists every layer it measured
MAX_FIELDS = 64
# Where every process of a job may take its Redis URL from instead of a flag, so that a password in
# it stays out of the process list.
REDIS_URL_ENV = "CHAMELEON_REDIS_URL"
JOB_ENV = "CHAMELEON_JOB"  # the job name, for the daemon, the workers and chameleonctl
# A worker's cadence on Redis at steady state: a heartbeat per `heartbeat_seconds` (skipped beside
# a step or an ack, events.HEARD), and the committed generation read every PLAN_POLL_SECONDS (the
# plan itself only when that is newer than the one held).
HEARTBEAT_SECONDS = 1.0  # a job of up to HEARTBEATS_PER_SECOND workers
HEARTBEATS_PER_SECOND = 1024  # a larger job's workers beat less often, sharing this many
PLAN_POLL_SECONDS = 5.0
PROFILE_EVERY_STEPS = 5  # a training profile per this many steps (chameleond/worker/_profile.py)
PROFILES_PER_SECOND = 512  # a larger job's members profile less often, sharing this many
STEP_REPORTS_PER_SECOND = 1024  # a larger job's members report every few steps, sharing this many
# A dead member is named in a fault at once by FAULT_REPORTERS live members spread round the plan's
# worker order (fault_reporters); every other survivor names it only when no newer plan has come
# FAULT_FALLBACK_SECONDS after its own generation failed.
FAULT_REPORTERS = 3
FAULT_FALLBACK_SECONDS = 10.0


def profile_every_steps(members: int, step_seconds: float) -> int:
    """How many steps apart a member of a plan of `members` sends a training profile:
    PROFILE_EVERY_STEPS while the job's profiles stay within PROFILES_PER_SECOND; beyond, as many
    more as keep them within it (at 8,192 workers and 2 s steps: every 8th step, 512 profiles a
    second instead of 819). Each costs the daemon a parse, a fold into the measured spec and a
    look by the slowness detector, several times a step report; a large job's slowness is
    decided on later by as much (jobstate/slowness.py detect_seconds)."""
    if step_seconds <= 0:
        return PROFILE_EVERY_STEPS
    return max(PROFILE_EVERY_STEPS, math.ceil(members / (step_seconds * PROFILES_PER_SECOND)))


def profile_phase(worker: str, every: int = PROFILE_EVERY_STEPS) -> int:
    """The steps, 0 to `every` - 1, a worker's second training profile of a plan waits beyond
    the first's window (its first comes after PROFILE_EVERY_STEPS, with the links it measured),
    for profiles `every` steps apart (profile_every_steps): a job's workers commit their steps
    together, and without it every one of them reported at the same step (8,192 profiles at once
    every fifth step, queued ahead of any fault in the stream); with it one in `every` of them
    report at each step."""
    return zlib.crc32(worker.encode()) % every


def step_report_every(members: int, step_seconds: float) -> int:
    """How many steps apart a member of a plan of `members` reports `step` (its first step of
    each plan, and one with an evaluation, always): 1 while every member's every step stays
    within STEP_REPORTS_PER_SECOND; beyond, as many steps as fit in a heartbeat period, so that
    a member is still heard from once per period (at 8,192 workers and 2 s steps: every fourth
    step, 1,024 reports a second instead of 4,096). The daemon's throughput counts each step
    once, from whichever member reports it first (jobstate/records.py StepMeter)."""
    if step_seconds <= 0 or members / step_seconds <= STEP_REPORTS_PER_SECOND:
        return 1
    return max(1, int(heartbeat_seconds(members) // step_seconds))


def step_reported(worker: str, step: int, members: int, step_seconds: float) -> bool:
    """Whether `worker` reports committed step `step` (beside its first of a plan and one with
    an evaluation): each member at its own phase, so that every step is reported by some."""
    every = step_report_every(members, step_seconds)
    return every == 1 or (step + zlib.crc32(worker.encode())) % every == 0


def fault_reporters(
    workers: Sequence[str], gone: Collection[str], n: int = FAULT_REPORTERS
) -> dict[str, tuple[str, ...]]:
    """For each of `workers` in `gone`, the workers that name it in a fault at once: `n` of the
    others not in `gone`, spread round `workers` (a plan's sorted workers, as a ring): the k-th
    is the first such worker from k/n of the way round after it, not chosen already.

    A peer's death fails every survivor's generation (its world group and commit vote span the
    plan), and each survivor holds the same notices of who is gone: without this, every survivor
    named every dead member, 65,472 faults for a host of 8 lost from 8,192 workers, each read and
    folded by the daemon ahead of the acknowledgements of the plan that answers them. Spread
    round the ring, a member's reporters are on different hosts (sorted ids group a host's
    workers), so one busy host does not hold back its naming. A survivor whose notices differ
    (one still on its way), or whose reporters died or hung too, is covered by the fallback:
    every survivor names what is left after FAULT_FALLBACK_SECONDS without a newer plan."""
    dead = set(gone)
    ring = len(workers)
    live = ring - sum(1 for w in workers if w in dead)
    out: dict[str, tuple[str, ...]] = {}
    for i, w in enumerate(workers):
        if w not in dead:
            continue
        found: list[str] = []
        for k in range(min(n, live)):
            j = i + 1 + k * ring // n
            while workers[j % ring] in dead or workers[j % ring] in found:
                j += 1
            found.append(workers[j % ring])
        out[w] = tuple(found)
    return out


def heartbeat_seconds(workers: int) -> float:
    """A worker's heartbeat period in a job of `workers`: HEARTBEAT_SECONDS, or in a job so large
    that the beats would pass HEARTBEATS_PER_SECOND, as many whole seconds as keep them within it
    (whole: a job a few workers short of 8,192, after a loss, keeps the 8 s of 8,192, and with it
    a member's step reports one in four at 2 s steps; 7.999 s made that one in three). A dead
    process is announced by the connection watch within a fraction of a second whatever the
    period: the beats find hung ones. The daemon's heartbeat timeout grows by the same factor
    (Job.heartbeat_timeout)."""
    return max(HEARTBEAT_SECONDS, float(math.ceil(workers / HEARTBEATS_PER_SECOND)))


def worker_connection_name(job: str, worker: str, incarnation: str) -> str:
    """`chameleon-worker:{job}:{worker}:{incarnation}`: every Redis connection of a worker process
    carries it (the incarnation tells processes apart); the daemon finds dead workers by it."""
    return f"chameleon-worker:{job}:{worker}:{incarnation}"


@dataclass(frozen=True)
class Keys:
    """Redis key names of one job."""

    job: str

    @property
    def prefix(self) -> str:
        return f"chameleon:{self.job}:"

    @property
    def events(self) -> str:
        return self.prefix + "events"

    @property
    def dead(self) -> str:
        return self.prefix + "dead"

    @property
    def plan(self) -> str:
        return self.prefix + "plan"

    @property
    def plan_packed(self) -> str:
        """The plan key's document in its compact form (core/plancompact.py), zlib-packed
        (`packed_plan`; written with it, in the same commit): what the workers read (a
        re-partition's plan at 8,192 devices is 1.5 MB of JSON, 12 KB packed)."""
        return self.prefix + "plan.zlib"

    @property
    def plan_delta(self) -> str:
        """The plan as a delta from the one before it, zlib-compressed (core/plandelta.py),
        written with it when the plan keeps the pipelines of the one before (a reroute) and the
        delta is under half the packed plan's size, else deleted: a worker holding the plan
        before reads a few hundred bytes instead of the whole plan."""
        return self.prefix + "plan.delta"

    @property
    def plans_channel(self) -> str:
        return self.prefix + "plans"

    @property
    def liveness_channel(self) -> str:
        """Channel: the daemon's notices of worker processes gone or live again (JSON signed as
        kind "liveness": `gone` and `live` lists of [worker, incarnation], `at`;
        chameleond/daemon/connwatch.py)."""
        return self.prefix + "liveness"

    @property
    def gone(self) -> str:
        """String: the worker processes the daemon saw gone in the last minutes, as the same
        signed "liveness" document, for a worker that (re)subscribes to the notices."""
        return self.prefix + "gone"

    @property
    def state(self) -> str:
        """Hash: the daemon's persisted job state (see chameleond.daemon)."""
        return self.prefix + "state"

    @property
    def spec(self) -> str:
        """The job description the daemon plans with (JSON, spec format); workers read `arch`."""
        return self.prefix + "spec"

    @property
    def corpus(self) -> str:
        """String: the digest of the corpus the job's workers read (the first worker sets it; a
        worker whose corpus differs stops, exit 6)."""
        return self.prefix + "corpus"

    @property
    def weights(self) -> str:
        """String: the digest of the pretrained weights the job's workers start from
        (`Layers.weights_digest`; the first worker sets it; a worker whose weights differ stops,
        exit 8)."""
        return self.prefix + "weights"

    @property
    def leader(self) -> str:
        """String with a time to live: the daemon that leads the job (daemon/lease.py)."""
        return self.prefix + "leader"

    @property
    def decisions(self) -> str:
        """Stream: one entry per decision, with both candidates and their scores."""
        return self.prefix + "decisions"

    @property
    def agents(self) -> str:
        """Hash: host -> that host's chameleon-agent and its workers (JSON: pid, at, workers with
        pid, state, restarts, last_exit; total restarts), rewritten on every change."""
        return f"{self.prefix}agents"

    @property
    def slow(self) -> str:
        """Hash: worker -> a request to run that worker slowed down (JSON signed as kind "slow":
        worker, factor, until), which the worker's chameleon-agent applies (docs/agent.md)."""
        return f"{self.prefix}slow"

    def profiling(self, host: str) -> str:
        """Hash: the workers of a new job on one CPU host that are ready to profile (they start
        together, so each measures its layers while competing for the cores, as in training)."""
        return f"{self.prefix}profiling:{host}"

    def store(self, generation: int, attempt: int = 1) -> str:
        """Prefix of the c10d rendezvous store of one attempt to build a plan generation (the
        workers build it again, as attempt 2, 3, ..., when it failed with nobody gone)."""
        return f"{self.prefix}store:{generation}:{attempt}:"

    def acl_rules(self, *, daemon: bool = False) -> tuple[str, ...]:
        """A Redis ACL user's rules that allow the job's workers and tools what they use and no
        more: the job's own keys and channels, every command but the @dangerous ones, and CLIENT
        SETNAME (each worker names its connections). The daemon's user (`daemon`) may also run
        CLIENT LIST: it finds a dead worker by its connections being gone and announces it
        (chameleond/daemon/connwatch.py), and a standby sees the leader's process by it."""
        rules = (
            "resetkeys", f"~{self.prefix}*", "resetchannels", f"&{self.prefix}*",
            "+@all", "-@dangerous", "+client|setname",
        )  # fmt: skip
        return (*rules, "+client|list") if daemon else rules


def packed(text: str) -> bytes:
    """A JSON document as stored under Keys.plan_delta: zlib, level 1."""
    return zlib.compress(text.encode(), 1)


def packed_plan(doc: Mapping[str, Any]) -> bytes:
    """A plan's document as stored under Keys.plan_packed: its compact form, zlib level 6 (a
    re-partition's plan at 8,192 devices: 1.5 MB of JSON, 0.32 MB compact, 12.3 KB packed in
    3 ms; level 1 would leave 15.2 KB for every worker to read)."""
    return zlib.compress(json.dumps(compact(doc), separators=(",", ":")).encode(), 6)


def unpacked_plan(raw: bytes) -> Any:
    """The plan's document under Keys.plan_packed, whole again (a document packed whole reads
    as it is). ValueError (a PlanError when a compact document does not expand) or zlib.error
    when `raw` is not one."""
    doc = json.loads(zlib.decompress(raw))
    return expand(doc) if isinstance(doc, dict) else doc


_SECRET_QUERY = ("password", "sentinel_password")  # query options a logged URL hides


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: credentials (user:password@, ?password=, a Sentinel URL's
    ?sentinel_password=) replaced by ***."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = urlencode(
        [(k, "***" if k.lower() in _SECRET_QUERY else v) for k, v in parse_qsl(parts.query)],
        safe="*",
    )
    tail = (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{parts.path}{tail}"


def scrub_url(text: str, url: str) -> str:
    """`text` (an error message about `url`) with the URL's credentials replaced by ***."""
    parts = urlsplit(url)
    text = text.replace(url, redact_url(url))
    if parts.password:
        text = text.replace(parts.password, "***")
    for key, value in parse_qsl(parts.query):
        if key.lower() in _SECRET_QUERY and value:
            text = text.replace(value, "***")
    return text


def url_error(url: str) -> str | None:
    """Why no client can be made for `url` (one line, credentials masked), or None: a plain
    Redis URL as redis-py reads it, or a Sentinel one (chameleond/redisurl.py)."""
    from chameleond.redisurl import SCHEMES, scheme, url_problem

    if scheme(url) not in SCHEMES:
        return f"{redact_url(url)!r} must start with {', '.join(s + '://' for s in SCHEMES)}"
    why = url_problem(url)
    return None if why is None else f"{redact_url(url)!r}: {scrub_url(why, url)}"


def event_size(raw: Mapping[Any, Any]) -> int:
    """The entry's size in bytes (keys and values, as stored)."""
    try:  # as read from Redis: all bytes, measured in one pass each
        return len(b"".join(raw)) + len(b"".join(raw.values()))
    except TypeError:  # text among them (an entry built in memory)
        return sum(len(_raw_bytes(k)) + len(_raw_bytes(v)) for k, v in raw.items())


def _raw_bytes(x: Any) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode("utf-8", "surrogatepass")


def check_size(raw: Mapping[Any, Any]) -> None:
    """Raises EventError when the entry has too many fields or bytes for its type."""
    if len(raw) > MAX_FIELDS:
        raise EventError(f"{len(raw)} fields: an event has at most {MAX_FIELDS}")
    kind = raw.get(b"type", raw.get("type", b""))
    kind = kind.decode("utf-8", "replace") if isinstance(kind, bytes) else str(kind)
    limit = MAX_EVENT_BYTES_BY_TYPE.get(kind, MAX_EVENT_BYTES)
    size = event_size(raw)
    if size > limit:
        raise EventError(f"{size} bytes: a {show(kind)} event has at most {limit}")


def _decode(raw: Mapping[Any, Any]) -> dict[str, str]:
    try:  # as read from Redis: all bytes, all UTF-8
        return {k.decode(): v.decode() for k, v in raw.items()}
    except (AttributeError, UnicodeDecodeError):  # text among them, or a field to name
        pass
    out: dict[str, str] = {}
    for k, v in raw.items():
        try:
            ks = k.decode() if isinstance(k, bytes) else str(k)
            vs = v.decode() if isinstance(v, bytes) else str(v)
        except UnicodeDecodeError as e:
            raise EventError(f"field is not UTF-8: {e}") from e
        out[ks] = vs
    return out


def read_event(raw: Mapping[Any, Any], job: str, keyring: Keyring | None) -> Event:
    """One stream entry of `job`, read as the daemon reads it: its size, then its signature when
    there is a keyring (so an oversize entry is refused before it costs a MAC), then its fields.
    Raises EventError(reason), or AuthError(reason) for an unsigned or forged entry."""
    check_size(raw)
    if keyring is not None:
        keyring.verify_event(job, raw)
    return _parse(raw)


def parse_event(raw: Mapping[Any, Any]) -> Event:
    """Validate one stream entry's fields into its typed event (no signature checked). Raises
    EventError(reason)."""
    check_size(raw)
    return _parse(raw)


def _parse(raw: Mapping[Any, Any]) -> Event:
    f = _decode(raw)
    kind = f.get("type", "")
    if not kind:
        raise EventError("missing field 'type'")
    parse = _PARSERS.get(kind)
    if parse is None:
        raise EventError(f"unknown type {show(kind)}; expected one of {', '.join(EVENT_TYPES)}")
    return parse(f)


_PARSERS: dict[str, Callable[[Mapping[str, str]], Event]] = {
    c.type: c.from_fields for c in EVENT_CLASSES
}
