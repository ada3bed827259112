"""One event's flat string fields, read and written (docs/protocol.md, Events and Bounds).

The readers hold each value a client writes to its bound and raise `EventError` with a reason a
person understands; that reason is what the dead-letter stream records. Every number is checked
here, so nothing later (the step meter, a gauge, the persisted snapshot) sees a value it cannot
hold: an unbounded integer or float would raise there, again after every restart. The `loose_`
readers are for the fields the daemon does not act on (a report's `at`, its `reporter`): a value
that is not well-formed is read as absent, never dead-lettered. The writers give each number the
text the worker has always sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from chameleond.core.fields import MAX_ID_LEN as MAX_ID_LEN

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

Fields = Mapping[str, str]


class EventError(ValueError):
    """An event is malformed; the message is the dead-letter reason."""


def shorten(text: str, limit: int = MAX_REASON_LEN) -> str:
    """`text` cut to `limit` characters, marked when cut (dead-letter reasons, logs)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show(v: str) -> str:
    """A field's value inside a reason: its repr, at most 64 characters of it."""
    return shorten(repr(v), 64)


# ---- reading: a value within its bounds, or EventError ------------------------------------------


def read_int(f: Fields, key: str, *, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
    if key not in f:
        raise EventError(f"missing field {key!r}")
    text = f[key]
    # A bound on the digits first: int() of thousands of digits is slow, then refused.
    try:
        v = int(text) if len(text) <= 24 else None
    except ValueError:
        v = None
    if v is None:
        raise EventError(f"field {key!r} must be an integer, got {show(text)}")
    if not minimum <= v <= maximum:
        raise EventError(f"field {key!r} must be in {minimum}..{maximum}, got {show(text)}")
    return v


def read_float(f: Fields, key: str, *, minimum: float = 0.0, maximum: float = MAX_SECONDS) -> float:
    if key not in f:
        raise EventError(f"missing field {key!r}")
    text = f[key]
    try:
        v = float(text) if len(text) <= 64 else math.nan
    except ValueError:
        raise EventError(f"field {key!r} must be a number, got {show(text)}") from None
    if not math.isfinite(v) or not minimum <= v <= maximum:
        raise EventError(
            f"field {key!r} must be a finite number in {minimum}..{maximum:g}, got {show(text)}"
        )
    return v


def read_positive(f: Fields, key: str, maximum: float) -> float:
    v = read_float(f, key, maximum=maximum)
    if v == 0:
        raise EventError(f"field {key!r} must be above 0, got {show(f[key])}")
    return v


def read_text(f: Fields, key: str, limit: int = MAX_TEXT_LEN) -> str:
    v = f.get(key, "")
    if len(v) > limit:
        raise EventError(f"field {key!r} is longer than {limit} characters")
    return v


def read_ident(f: Fields, key: str) -> str:
    v = f.get(key, "")
    if not v:
        raise EventError(f"missing field {key!r}")
    # Of the printable characters, only the ASCII space is also whitespace.
    if len(v) > MAX_ID_LEN or not v.isprintable() or " " in v:
        raise EventError(
            f"field {key!r} must be a printable id without spaces (<= {MAX_ID_LEN}), got {show(v)}"
        )
    return v


def read_flag(f: Fields, key: str) -> bool:
    """An optional "1"/"0" field; absent is "0"."""
    v = f.get(key, "0")
    if v not in ("0", "1"):
        raise EventError(f"field {key!r} must be 1 or 0, got {show(v)}")
    return v == "1"


def read_layers(text: str) -> tuple[int, ...]:
    """A `checkpoint` event's `layers`: comma-separated layer ids, e.g. "0,1,2"."""
    parts = text.split(",")
    if not all(0 < len(x) <= 7 and x.isdigit() and x.isascii() for x in parts):
        raise EventError(f"field 'layers' must be comma-separated ids, got {show(text)}")
    layers = tuple(int(x) for x in parts)
    if any(x > MAX_LAYER_ID for x in layers):
        raise EventError(f"field 'layers' must list layer ids in 0..{MAX_LAYER_ID}")
    return layers


# ---- reading what the daemon does not act on: the value, or None -----------------------------


def loose_float(f: Fields, key: str) -> float | None:
    """A finite number, or None (absent or not one)."""
    text = f.get(key, "")
    try:
        v = float(text) if 0 < len(text) <= 64 else math.nan
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def loose_int(f: Fields, key: str) -> int | None:
    """A non-negative integer of at most 24 digits, or None (absent or not one)."""
    text = f.get(key, "")
    ok = 0 < len(text) <= 24 and text.isascii() and text.isdigit()
    return int(text) if ok else None


# ---- writing: the text of each value ------------------------------------------------------------


def fixed(v: float, places: int) -> str:
    """A time or duration with `places` decimals (`at`: 3, step seconds: 6, ack seconds: 4)."""
    return f"{v:.{places}f}"


def count(v: float) -> str:
    """A count (or a byte size held as a float): its integer digits when it is whole."""
    if isinstance(v, int):
        return str(v)
    return str(int(v)) if v.is_integer() else repr(v)
