"""What a check of `chameleonctl doctor` found: a verdict, a line, its time, its figures."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

VERDICTS = ("ok", "warn", "fail", "skip")


@dataclass
class Check:
    name: str
    verdict: str = "ok"
    detail: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


def timed(name: str, body: Callable[[Check], None]) -> Check:
    check = Check(name)
    t0 = time.perf_counter()
    try:
        body(check)
    except Exception as e:  # a check that breaks is that check's failure, not the doctor's
        check.verdict, check.detail = "fail", f"{type(e).__name__}: {first_line(str(e))}"
    check.seconds = time.perf_counter() - t0
    return check


def first_line(text: str) -> str:
    return next((x.strip() for x in text.splitlines() if x.strip()), "")
