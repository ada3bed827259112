"""Replay of availability traces (`time_ms,add|remove,nodeN`, ../shared/traces) onto local workers.

Mapping: the nodes added at t=0 are the starting cluster; in the order of those adds they map one to
one onto the local workers (1st node -> w0, ...), which all start before training. Events on nodes
that map to no local worker (beyond the cluster's size, or first added later) are skipped, and the
replay says how many. A `remove` kill -9s the mapped worker; a later `add` of a mapped node whose
worker is down starts that worker again (it rejoins under its own id). Time is compressed: an event
at `time_ms` fires `time_ms / 1000 / time_scale` seconds after training's first committed step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_ACTIONS = ("add", "remove")


class TraceError(ValueError):
    """The trace file is malformed; the message names the line."""


@dataclass(frozen=True)
class TraceEvent:
    time_ms: int
    action: str  # "add" | "remove"
    node: str


@dataclass(frozen=True)
class ReplayStep:
    """One action on the local cluster, at `seconds` after the first committed step."""

    seconds: float
    action: str  # "kill" | "start"
    worker: str
    node: str
    time_ms: int


@dataclass(frozen=True)
class Replay:
    steps: tuple[ReplayStep, ...]
    mapping: dict[str, str]  # node -> worker
    skipped: int  # events on nodes that map to no local worker, or no-ops


def parse_trace(lines: Iterable[str], *, source: str = "trace") -> tuple[TraceEvent, ...]:
    out: list[TraceEvent] = []
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(f"{source}:{n}: expected time_ms,add|remove,nodeN, got {line!r}")
        t, action, node = parts
        try:
            time_ms = int(t)
        except ValueError:
            raise TraceError(f"{source}:{n}: time_ms must be an integer, got {t!r}") from None
        if time_ms < 0:
            raise TraceError(f"{source}:{n}: time_ms must be >= 0, got {time_ms}")
        if action not in TRACE_ACTIONS:
            raise TraceError(f"{source}:{n}: action must be add or remove, got {action!r}")
        if not node or any(c.isspace() for c in node):
            raise TraceError(f"{source}:{n}: node must be a name without spaces, got {node!r}")
        out.append(TraceEvent(time_ms, action, node))
    if any(b.time_ms < a.time_ms for a, b in itertools.pairwise(out)):
        raise TraceError(f"{source}: events are not in time order")
    return tuple(out)


def load_trace(path: str | Path) -> tuple[TraceEvent, ...]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TraceError(f"{p}: {e.strerror}") from e
    return parse_trace(text.splitlines(), source=str(p))


def plan_replay(
    events: Sequence[TraceEvent], workers: Sequence[str], *, time_scale: float
) -> Replay:
    """Turn trace events into kill/start actions on `workers` with time compressed by time_scale."""
    if time_scale <= 0:
        raise TraceError(f"time scale must be > 0, got {time_scale}")
    mapping: dict[str, str] = {}
    free = list(workers)
    up: set[str] = set()
    steps: list[ReplayStep] = []
    skipped = 0
    for ev in events:
        if ev.node not in mapping and ev.action == "add" and ev.time_ms == 0 and free:
            mapping[ev.node] = free.pop(0)
            up.add(mapping[ev.node])
            continue
        worker = mapping.get(ev.node)
        if worker is None:
            skipped += 1
            continue
        seconds = ev.time_ms / 1000.0 / time_scale
        if ev.action == "remove" and worker in up:
            up.discard(worker)
            steps.append(ReplayStep(seconds, "kill", worker, ev.node, ev.time_ms))
        elif ev.action == "add" and worker not in up:
            up.add(worker)
            steps.append(ReplayStep(seconds, "start", worker, ev.node, ev.time_ms))
        else:
            skipped += 1  # remove of a node already down, or add of one already up
    return Replay(tuple(steps), mapping, skipped)
