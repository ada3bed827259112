"""A fault's cause as the job's records show it: short and readable.

A worker that sees a peer fail reports the error its collective raised, verbatim: for gloo a
multi-line text naming a C++ source file, an address, advice about remote workers and a closing
emoji. That is evidence, not a cause a person reads in a list of decisions. `readable` turns it
into a short phrase naming what happened and the backend that saw it ("connection closed
(gloo)"); the decision record keeps the raw text beside it (its `detail` field). An operator's
cause ("ECC error on HBM") is already readable and passes through unchanged.
"""

from __future__ import annotations

import re
import unicodedata

MAX_CHARS = 120  # a cause longer than this is cut (the whole text stays in the detail)

# What the transports say, as a phrase: the first pattern found in the text names the cause.
_PHRASES: tuple[tuple[str, str], ...] = (
    ("connection closed by peer", "connection closed"),
    ("connection reset by peer", "connection reset"),
    ("connection refused", "connection refused"),
    ("broken pipe", "connection broken"),
    ("remote process exited", "remote process exited"),
    ("watchdog caught collective operation timeout", "collective timed out"),
    ("timed out", "timed out"),
    ("out of memory", "out of memory"),
)
_BACKENDS = ("gloo", "nccl", "hccl")
# "CollectiveFailed: RuntimeError: ..." -> the text after the exception class names
_CLASS_PREFIX = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Failed|Aborted|Unavailable):\s*)+"
)
# "[/path/to/pair.cc:553] " -> gone
_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cxx|c|h|hpp|py):\d+\]\s*")
# torch's advice after the error ("This is typically caused by ... GLHF!")
_ADVICE = re.compile(r"\s*(?:This is typically caused|Check the logs of|GLHF).*$", re.S)


def readable(raw: str) -> tuple[str, str]:
    """(the cause to record, the raw text when the cause is not it, else "")."""
    text = raw.strip()
    if not text:
        return "reported failed", ""
    if _clean(text) and len(text) <= MAX_CHARS and not _CLASS_PREFIX.match(text):
        return text, ""
    low = text.lower()
    backend = next((b for b in _BACKENDS if b in low), None)
    phrase = next((short for pattern, short in _PHRASES if pattern in low), None)
    if phrase is None:
        phrase = _first_sentence(text)
    cause = f"{phrase} ({backend})" if backend and backend not in phrase.lower() else phrase
    return cause, text


def _clean(text: str) -> bool:
    """One printable line without what marks a raw error (source locations, advice, symbols)."""
    return (
        "\n" not in text
        and all(_kept(c) for c in text)
        and not _SOURCE.search(text)
        and not _ADVICE.search(text)
    )


def _kept(c: str) -> bool:
    """Letters, digits, punctuation and spaces; no control characters, no emoji or symbols."""
    return c == " " or unicodedata.category(c)[0] in "LNP" or c in "+<=>|~^$`"


def _first_sentence(text: str) -> str:
    line = _SOURCE.sub("", text)
    line = _ADVICE.sub("", line)
    line = _CLASS_PREFIX.sub("", line.strip())
    line = next((part.strip() for part in line.splitlines() if part.strip()), "")
    line = "".join(c for c in line if _kept(c))
    line = " ".join(line.split()).rstrip(" .:;,")
    if len(line) > MAX_CHARS:
        line = line[: MAX_CHARS - 3].rstrip() + "..."
    return line or "reported failed"
