"""Reading a job description's fields: each reader checks one value's kind and bounds and raises
SpecError naming the field (`workers[3].memory_bytes: must be > 0, got -1`). Shared by the spec
(chameleond/core/spec.py) and its `[[hosts]]` form (chameleond/core/hosts.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

MAX_ID_LEN = 128  # a worker, host or job id: printable, no spaces, at most this long


class SpecError(ValueError):
    """The job description is malformed; the message names the field."""


def is_ident(text: str) -> bool:
    """An id the protocol carries: printable, no spaces, at most MAX_ID_LEN characters."""
    return 0 < len(text) <= MAX_ID_LEN and text.isprintable() and not any(c.isspace() for c in text)


def required(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise SpecError(f"{where}: missing required field {key!r}")
    return d[key]


def kind(v: Any) -> str:
    return "a table" if isinstance(v, Mapping) else "a list" if isinstance(v, list) else repr(v)


def table(v: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise SpecError(f"{where}: expected a table, got {kind(v)}")
    return v


def array(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list | tuple):
        raise SpecError(f"{where}: expected a list, got {kind(v)}")
    return list(v)


def text(d: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = required(d, key, where) if default is None else d.get(key, default)
    if not isinstance(v, str) or not v:
        raise SpecError(f"{where}.{key}: expected a non-empty string, got {kind(v)}")
    return v


def number(v: Any, where: str) -> float:
    # NaN and inf compare False against every bound, so they would slip past the range checks
    # below and only surface later, as a wrong plan or a crash in the daemon.
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SpecError(f"{where}: expected a finite number, got {kind(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer beyond any float
        raise SpecError(f"{where}: expected a finite number, got an integer too large") from None
    if not math.isfinite(f):
        raise SpecError(f"{where}: expected a finite number, got {kind(v)}")
    return f


def num(
    d: Mapping[str, Any],
    key: str,
    where: str,
    *,
    positive: bool = True,
    default: float | None = None,
) -> float:
    if default is not None and key not in d:
        return default
    v = number(required(d, key, where), f"{where}.{key}")
    if positive and v <= 0:
        raise SpecError(f"{where}.{key}: must be > 0, got {d[key]!r}")
    if not positive and v < 0:
        raise SpecError(f"{where}.{key}: must be >= 0, got {d[key]!r}")
    return v


def integer(
    d: Mapping[str, Any], key: str, where: str, *, minimum: int = 1, default: int | None = None
) -> int:
    """A whole number >= minimum; 8.0 is 8, but 7.9 is an error rather than a silent 7."""
    if default is not None and key not in d:
        return default
    v = number(required(d, key, where), f"{where}.{key}")
    if not v.is_integer():
        raise SpecError(f"{where}.{key}: expected a whole number, got {d[key]!r}")
    n = int(d[key])
    if n < minimum:
        raise SpecError(f"{where}.{key}: must be >= {minimum}, got {d[key]!r}")
    return n


@contextmanager
def naming(where: str) -> Iterator[None]:
    """Whatever a malformed value breaks below, the error names the field instead of a trace."""
    try:
        yield
    except SpecError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
        raise SpecError(f"{where}: {e}") from None
