"""The wire protocol between chameleond, the workers and operators (documented in docs/protocol.md).

Every Redis key lives under `chameleon:{job}:`. Events are flat string fields on one stream, so a
person can send any of them with `redis-cli XADD`. `parse_event` turns raw fields into a typed event
or raises `EventError` with a reason a person understands; that reason is what the dead-letter
stream records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from chameleond.events import (
    Ack,
    AckPhase,
    Checkpoint,
    Event,
    Fault,
    Heartbeat,
    Profile,
    Register,
    Rejoin,
    Step,
)

CONSUMER_GROUP = "chameleond"
EVENT_TYPES = ("fault", "rejoin", "register", "heartbeat", "profile", "step", "ack", "checkpoint")
ACK_PHASES = tuple(p.value for p in AckPhase)
MAX_ID_LEN = 128
# Bounds of every event (docs/protocol.md, Bounds). Each number a client writes is checked at parse
# time, so nothing later (the step meter, a gauge, the persisted snapshot) sees a value it cannot
# hold: an unbounded integer or float would raise there, again after every restart.
MAX_EVENT_BYTES = 64 * 1024  # the whole entry, keys and values
MAX_EVENT_BYTES_BY_TYPE = {"profile": 1024 * 1024}  # a profile lists every layer it measured
MAX_FIELDS = 64
MAX_TEXT_LEN = 1024  # free text: `cause`
MAX_REASON_LEN = 1024  # a dead letter's `error`
MAX_COUNT = 2**53 - 1  # generations, steps: exact in a float and in JSON
MAX_ATTEMPT = 1_000_000
MAX_SAMPLES = 2**40
MAX_BYTES = 2**60  # memory and checkpoint sizes
MAX_LAYER_ID = 2**20
MAX_SECONDS = 1e9  # about 30 years
MAX_LOSS = 1e30  # `loss`, `eval_loss`
MAX_FIGURE = 1e30  # `grad_norm`, `lr`, `loss_scale`: finite, so a gauge and JSON can hold them
MAX_TOKENS = MAX_COUNT  # tokens of one step
# Where every process of a job may take its Redis URL from instead of a flag, so that a password in
# it stays out of the process list.
REDIS_URL_ENV = "CHAMELEON_REDIS_URL"
JOB_ENV = "CHAMELEON_JOB"  # the job name, for the daemon, the workers and chameleonctl


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
    def plans_channel(self) -> str:
        return self.prefix + "plans"

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
    def leader(self) -> str:
        """String with a time to live: the daemon that leads the job (daemon/lease.py)."""
        return self.prefix + "leader"

    @property
    def decisions(self) -> str:
        """Stream: one entry per decision, with both candidates and their scores."""
        return self.prefix + "decisions"

    def profiling(self, host: str) -> str:
        """Hash: the workers of a new job on one CPU host that are ready to profile (they start
        together, so each measures its layers while competing for the cores, as in training)."""
        return f"{self.prefix}profiling:{host}"

    def store(self, generation: int, attempt: int = 1) -> str:
        """Prefix of the c10d rendezvous store of one attempt to build a plan generation (the
        workers build it again, as attempt 2, 3, ..., when it failed with nobody gone)."""
        return f"{self.prefix}store:{generation}:{attempt}:"

    def acl_rules(self) -> tuple[str, ...]:
        """A Redis ACL user's rules that allow the job's daemon, workers and tools what they use
        and no more: the job's own keys and channels, every command but the @dangerous ones, and
        two CLIENT subcommands: SETNAME (each worker names its connections) and LIST (a worker
        finds a failed peer by its connection being gone; docs/worker.md)."""
        return (
            "resetkeys", f"~{self.prefix}*", "resetchannels", f"&{self.prefix}*",
            "+@all", "-@dangerous", "+client|setname", "+client|list",
        )  # fmt: skip


def redact_url(url: str) -> str:
    """A Redis URL fit for logs: credentials (user:password@, ?password=) replaced by ***."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = urlencode(
        [(k, "***" if k.lower() == "password" else v) for k, v in parse_qsl(parts.query)],
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
        if key.lower() == "password" and value:
            text = text.replace(value, "***")
    return text


def url_error(url: str) -> str | None:
    """Why redis-py cannot use `url` (one line, credentials masked), or None."""
    from redis.connection import parse_url

    if not url.startswith(("redis://", "rediss://", "unix://")):
        return f"{redact_url(url)!r} must start with redis://, rediss:// or unix://"
    try:
        parse_url(url)
    except (ValueError, TypeError) as e:
        return f"{redact_url(url)!r}: {scrub_url(str(e), url)}"
    return None


class EventError(ValueError):
    """An event is malformed; the message is the dead-letter reason."""


def shorten(text: str, limit: int = MAX_REASON_LEN) -> str:
    """`text` cut to `limit` characters, marked when cut (dead-letter reasons, logs)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(v: str) -> str:
    """A field's value inside a reason: its repr, at most 64 characters of it."""
    return shorten(repr(v), 64)


def event_size(raw: Mapping[Any, Any]) -> int:
    """The entry's size in bytes (keys and values, as stored)."""
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
        raise EventError(f"{size} bytes: a {_show(kind)} event has at most {limit}")


def _decode(raw: Mapping[Any, Any]) -> dict[str, str]:
    check_size(raw)
    out: dict[str, str] = {}
    for k, v in raw.items():
        try:
            ks = k.decode() if isinstance(k, bytes) else str(k)
            vs = v.decode() if isinstance(v, bytes) else str(v)
        except UnicodeDecodeError as e:
            raise EventError(f"field is not UTF-8: {e}") from e
        out[ks] = vs
    return out


def _int(f: Mapping[str, str], key: str, *, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
    if key not in f:
        raise EventError(f"missing field {key!r}")
    text = f[key]
    # A bound on the digits first: int() of thousands of digits is slow, then refused.
    try:
        v = int(text) if len(text) <= 24 else None
    except ValueError:
        v = None
    if v is None:
        raise EventError(f"field {key!r} must be an integer, got {_show(text)}")
    if not minimum <= v <= maximum:
        raise EventError(f"field {key!r} must be in {minimum}..{maximum}, got {_show(text)}")
    return v


def _float(
    f: Mapping[str, str], key: str, *, minimum: float = 0.0, maximum: float = MAX_SECONDS
) -> float:
    if key not in f:
        raise EventError(f"missing field {key!r}")
    text = f[key]
    try:
        v = float(text) if len(text) <= 64 else math.nan
    except ValueError:
        raise EventError(f"field {key!r} must be a number, got {_show(text)}") from None
    if not math.isfinite(v) or not minimum <= v <= maximum:
        raise EventError(
            f"field {key!r} must be a finite number in {minimum}..{maximum:g}, got {_show(text)}"
        )
    return v


def _text(f: Mapping[str, str], key: str, limit: int = MAX_TEXT_LEN) -> str:
    v = f.get(key, "")
    if len(v) > limit:
        raise EventError(f"field {key!r} is longer than {limit} characters")
    return v


def _ident(f: Mapping[str, str], key: str) -> str:
    v = f.get(key, "")
    if not v:
        raise EventError(f"missing field {key!r}")
    if len(v) > MAX_ID_LEN or not v.isprintable() or any(c.isspace() for c in v):
        raise EventError(
            f"field {key!r} must be a printable id without spaces (<= {MAX_ID_LEN}), got {_show(v)}"
        )
    return v


# What a checkpoint cost its worker (chameleond.worker.saver.Written), optional in a `checkpoint`
# event.
CHECKPOINT_COSTS = ("bytes", "bubble_seconds", "stall_seconds")


def checkpoint_layers(text: str) -> list[int]:
    """A `checkpoint` event's `layers`: comma-separated layer ids, e.g. "0,1,2"."""
    parts = text.split(",")
    if not all(0 < len(x) <= 7 and x.isdigit() and x.isascii() for x in parts):
        raise EventError(f"field 'layers' must be comma-separated ids, got {_show(text)}")
    layers = [int(x) for x in parts]
    if any(x > MAX_LAYER_ID for x in layers):
        raise EventError(f"field 'layers' must list layer ids in 0..{MAX_LAYER_ID}")
    return layers


def parse_event(raw: Mapping[Any, Any]) -> Event:
    """Validate one stream entry's fields into its typed event. Raises EventError(reason)."""
    f = _decode(raw)
    kind = f.get("type", "")
    if not kind:
        raise EventError("missing field 'type'")
    parse = _PARSERS.get(kind)
    if parse is None:
        raise EventError(f"unknown type {_show(kind)}; expected one of {', '.join(EVENT_TYPES)}")
    return parse(f)


def _fault(f: Mapping[str, str]) -> Fault:
    if "worker" not in f and "node" not in f:
        raise EventError("a fault needs 'worker' or 'node'")
    worker = _ident(f, "worker") if "worker" in f else _ident(f, "node")
    generation = _int(f, "generation", minimum=1) if "generation" in f else None
    return Fault(worker, cause=_text(f, "cause"), generation=generation)


def _rejoin(f: Mapping[str, str]) -> Rejoin:
    return Rejoin(_ident(f, "worker"))


def _heartbeat(f: Mapping[str, str]) -> Heartbeat:
    return Heartbeat(_ident(f, "worker"))


def _register(f: Mapping[str, str]) -> Register:
    worker = _ident(f, "worker")
    host = _ident(f, "host")
    memory = _int(f, "memory_bytes", minimum=1, maximum=MAX_BYTES)
    device = _ident(f, "device") if f.get("device") else "cpu"
    return Register(worker, host, memory, device)


def _profile(f: Mapping[str, str]) -> Profile:
    worker = _ident(f, "worker")
    try:
        data = json.loads(f.get("data", ""))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a 5000-digit int, nesting
        raise EventError(f"field 'data' is not JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list):
        raise EventError("field 'data' must be a JSON object with a 'layers' list")
    return Profile(worker, data)


def _step(f: Mapping[str, str]) -> Step:
    worker = _ident(f, "worker")
    overflow = _flag(f, "overflow")
    return Step(
        worker,
        generation=_int(f, "generation", minimum=1),
        step=_int(f, "step"),
        samples=_int(f, "samples", maximum=MAX_SAMPLES),
        seconds=_float(f, "seconds"),
        loss=_float(f, "loss", maximum=MAX_LOSS),
        vote_seconds=_float(f, "vote_seconds") if "vote_seconds" in f else None,
        grad_norm=_grad_norm(f, overflow),
        learning_rate=_float(f, "lr", maximum=MAX_FIGURE) if "lr" in f else None,
        tokens=_int(f, "tokens", maximum=MAX_TOKENS) if "tokens" in f else None,
        skipped_samples=_int(f, "skipped", maximum=MAX_SAMPLES) if "skipped" in f else 0,
        overflow=overflow,
        loss_scale=_positive(f, "loss_scale", MAX_FIGURE) if "loss_scale" in f else None,
        eval_loss=_float(f, "eval_loss", maximum=MAX_LOSS) if "eval_loss" in f else None,
    )


def _flag(f: Mapping[str, str], key: str) -> bool:
    """An optional "1"/"0" field; absent is "0"."""
    v = f.get(key, "0")
    if v not in ("0", "1"):
        raise EventError(f"field {key!r} must be 1 or 0, got {_show(v)}")
    return v == "1"


def _positive(f: Mapping[str, str], key: str, maximum: float) -> float:
    v = _float(f, key, maximum=maximum)
    if v == 0:
        raise EventError(f"field {key!r} must be above 0, got {_show(f[key])}")
    return v


def _grad_norm(f: Mapping[str, str], overflow: bool) -> float | None:
    """`grad_norm`, when sent. A step that overflowed had inf/nan gradients, so their norm is
    inf or nan: accepted then, as no norm (None), rather than dead-lettering a committed step."""
    if "grad_norm" not in f:
        return None
    if overflow and f["grad_norm"].strip().lower().lstrip("+-") in ("inf", "infinity", "nan"):
        return None
    return _float(f, "grad_norm", maximum=MAX_FIGURE)


def _checkpoint(f: Mapping[str, str]) -> Checkpoint:
    worker = _ident(f, "worker")
    step = _int(f, "step")
    generation = _int(f, "generation", minimum=1)
    layers = tuple(checkpoint_layers(f.get("layers", "")))
    costs = {
        key: _float(f, key, maximum=float(MAX_BYTES) if key == "bytes" else MAX_SECONDS)
        for key in CHECKPOINT_COSTS
        if key in f
    }
    return Checkpoint(
        worker,
        generation=generation,
        step=step,
        layers=layers,
        size_bytes=costs.get("bytes"),
        bubble_seconds=costs.get("bubble_seconds"),
        stall_seconds=costs.get("stall_seconds"),
    )


def _ack(f: Mapping[str, str]) -> Ack:
    worker = _ident(f, "worker")
    generation = _int(f, "generation", minimum=1)
    if f.get("phase") not in ACK_PHASES:
        raise EventError(f"field 'phase' must be one of {', '.join(ACK_PHASES)}")
    phase = AckPhase(f["phase"])
    attempt = _int(f, "attempt", minimum=1, maximum=MAX_ATTEMPT) if "attempt" in f else 1
    step, cause = 0, ""
    if phase is AckPhase.UNRESTORABLE:
        step = _int(f, "step")
        cause = _text(f, "cause")
    build = _float(f, "build_seconds") if "build_seconds" in f else None
    migration = _float(f, "migration_seconds") if "migration_seconds" in f else None
    return Ack(
        worker, generation, phase, attempt, reason=f.get("reason", ""), step=step, cause=cause,
        build_seconds=build, migration_seconds=migration,
    )  # fmt: skip


_PARSERS: dict[str, Callable[[Mapping[str, str]], Event]] = {
    Fault.type: _fault,
    Rejoin.type: _rejoin,
    Register.type: _register,
    Heartbeat.type: _heartbeat,
    Profile.type: _profile,
    Step.type: _step,
    Ack.type: _ack,
    Checkpoint.type: _checkpoint,
}
