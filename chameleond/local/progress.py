"""Live progress of a local run: step, loss, throughput, job state, plan generation.

A terminal gets one line rewritten in place (carriage return + erase-to-end-of-line). Anything
else (a pipe, a CI log, a file) gets plain lines with no control codes: one per committed step at
most every `min_interval` seconds, plus one whenever the state or the generation changes, and
notes (a fault injected, a plan published) on lines of their own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TextIO

_ERASE = "\x1b[K"


@dataclass(frozen=True)
class Snapshot:
    step: int | None = None
    steps_total: int | None = None
    loss: float | None = None
    samples_per_second: float | None = None
    state: str = "starting"
    generation: int | None = None
    policy: str = ""

    def line(self) -> str:
        step = "-" if self.step is None else str(self.step)
        if self.steps_total is not None:
            step = f"{step}/{self.steps_total}"
        loss = "-" if self.loss is None else f"{self.loss:.4f}"
        tput = "-" if self.samples_per_second is None else f"{self.samples_per_second:.1f}"
        gen = "-" if self.generation is None else str(self.generation)
        policy = f" ({self.policy})" if self.policy else ""
        return (
            f"step {step}  loss {loss}  {tput} samples/s  state {self.state}  "
            f"plan generation {gen}{policy}"
        )


class ProgressView:
    def __init__(self, out: TextIO, *, tty: bool | None = None, min_interval: float = 1.0) -> None:
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.min_interval = min_interval
        self.current = Snapshot()
        self._printed: Snapshot | None = None
        self._printed_at = 0.0
        self._line_open = False  # a TTY line is on screen without a newline

    def update(self, **changes: object) -> None:
        """Merge the changed fields into the snapshot and show it if it is worth showing."""
        self.current = replace(self.current, **changes)  # type: ignore[arg-type]
        if self.tty:
            self.out.write("\r" + self.current.line() + _ERASE)
            self._line_open = True
            self.out.flush()
            return
        last = self._printed
        now = time.monotonic()
        changed = last is None or (
            last.state != self.current.state or last.generation != self.current.generation
        )
        stepped = last is not None and last.step != self.current.step
        if changed or (stepped and now - self._printed_at >= self.min_interval):
            self._emit(self.current.line())
            self._printed = self.current
            self._printed_at = now

    def note(self, text: str) -> None:
        """A one-off message on its own line (a fault injected, a plan published, ...)."""
        if self.tty and self._line_open:
            self.out.write("\r" + _ERASE)
        self._emit(text)
        if self.tty:
            self.out.write("\r" + self.current.line() + _ERASE)
            self._line_open = True
            self.out.flush()

    def close(self) -> None:
        """End the live line (TTY) or print the final state (plain)."""
        if self.tty:
            if self._line_open:
                self.out.write("\n")
                self._line_open = False
        elif self._printed != self.current:
            self._emit(self.current.line())
            self._printed = self.current
        self.out.flush()

    def _emit(self, text: str) -> None:
        self.out.write(_clean(text) + "\n")
        self.out.flush()


def _clean(text: str) -> str:
    """Strip control characters so a note can never smuggle one into a plain log."""
    return "".join(c for c in text if c.isprintable() or c == "\t")
