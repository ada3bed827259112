"""Replay of availability traces (`time_ms,add|remove,nodeN`; chameleond/traces) onto local workers.

Mapping: the local workers are slots for the trace's nodes. They all start with the job, and the
first nodes the trace adds take them in order (1st node -> w0, ...), whenever they come (the AWS
and GCP traces add their first nodes minutes in). A `remove` of a node that holds a worker
kill -9s that worker and frees its slot. A later `add` takes a free slot and starts its worker
again (the worker rejoins under its id): its own former slot if that is free, else the first free
one. Spot traces bring capacity back as new node names, so the local job shrinks and grows with
the trace's availability, up to its size. Events that change nothing locally are skipped, and the
replay says how many: a node added while every worker holds one (beyond the local cluster), the
removal of a node that holds none, an add of a node that already holds one. Time is compressed:
an event at `time_ms` fires `time_ms / 1000 / time_scale` seconds after training's first
committed step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from chameleond.traces import packaged_trace_path, packaged_traces

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
    """A trace file, or a packaged trace by name (`oobleck-p3-trace`: see chameleond.traces) when
    no file of that name exists."""
    p = Path(path)
    if not p.exists() and len(p.parts) == 1:
        p = packaged_trace_path(p.name) or p
    try:
        text = p.read_text()
    except OSError as e:
        names = ", ".join(packaged_traces())
        raise TraceError(f"{p}: {e.strerror} (packaged traces: {names})") from e
    return parse_trace(text.splitlines(), source=str(p))


def plan_replay(
    events: Sequence[TraceEvent], workers: Sequence[str], *, time_scale: float
) -> Replay:
    """Turn trace events into kill/start actions on `workers` with time compressed by time_scale."""
    if time_scale <= 0:
        raise TraceError(f"time scale must be > 0, got {time_scale}")
    mapping: dict[str, str] = {}  # node -> the worker it runs (or last ran) as
    node_of: dict[str, str | None] = dict.fromkeys(workers)  # running worker -> its node
    steps: list[ReplayStep] = []
    skipped = 0
    for ev in events:
        worker = mapping.get(ev.node)
        holds = worker is not None and node_of.get(worker) == ev.node
        seconds = ev.time_ms / 1000.0 / time_scale
        if ev.action == "remove" and worker is not None and holds:
            del node_of[worker]
            steps.append(ReplayStep(seconds, "kill", worker, ev.node, ev.time_ms))
            continue
        if ev.action == "remove" or holds:
            skipped += 1  # a node that runs no worker goes, or one that does is added again
            continue
        unbound = [w for w, n in node_of.items() if n is None]
        down = [w for w in workers if w not in node_of]
        if down:  # its own worker again if that is down, else the first one down
            slot = worker if worker in down else down[0]
            steps.append(ReplayStep(seconds, "start", slot, ev.node, ev.time_ms))
        elif unbound:  # the workers start with the job: the first nodes added take them
            slot = unbound[0]
        else:
            skipped += 1  # every worker runs: a node beyond the local cluster
            continue
        mapping[ev.node], node_of[slot] = slot, ev.node
    return Replay(tuple(steps), mapping, skipped)
