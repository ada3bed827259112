"""What a local run recorded, turned into a timeline: committed steps and decisions.

Every time here is a measurement: a Redis stream entry id is the millisecond at which Redis stored
the entry, so the events stream (step, fault, ack events) and the daemon's decisions stream give
when things happened without trusting any process's clock but Redis's. A step is committed on a
plan generation when every worker that reports steps for that generation has reported it; its
commit time is the latest of those reports.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Entry = tuple[str, Mapping[str, str]]  # (stream entry id, fields)


def entry_seconds(entry_id: str) -> float:
    """Unix seconds of a stream entry id `<ms>-<seq>`."""
    ms, _, _ = entry_id.partition("-")
    return int(ms) / 1000.0


@dataclass(frozen=True)
class CommittedStep:
    generation: int
    step: int
    at: float  # commit time (unix seconds): the last worker's report
    loss: float | None
    samples: int
    seconds: float  # the slowest worker's measured step seconds


@dataclass(frozen=True)
class DecisionRecord:
    at: float  # when the daemon recorded it (entry id)
    generation: int | None
    selected: str | None
    failed: tuple[str, ...]  # every worker out, this decision's faults and earlier ones
    joined: tuple[str, ...]  # the workers offered back: new joins and those on standby
    cause: str
    mtbf_seconds: float | None
    candidates: tuple[Mapping[str, Any], ...]
    step_seconds_estimate: float | None  # the selected plan's estimate
    received_at: float | None  # when the daemon received the fault that triggered it, if recorded
    unrecoverable: str | None
    raw: Mapping[str, Any] = field(default_factory=dict)
    faults: tuple[str, ...] = ()  # the new faults this decision answers
    unrestorable: tuple[str, ...] = ()  # workers that could not load the restore it replaces


def committed_steps(
    events: Sequence[Entry], members: Mapping[int, Collection[str]] | None = None
) -> list[CommittedStep]:
    """Group step events by (generation, step). A step commits once every worker of its plan has
    reported it (`members`: generation -> workers); where a plan is unknown, every worker that
    reported any step of that generation."""
    reports: dict[tuple[int, int], list[tuple[float, Mapping[str, str]]]] = defaultdict(list)
    reporters: dict[int, set[str]] = defaultdict(set)
    for entry_id, f in events:
        if f.get("type") != "step":
            continue
        try:
            key = (int(f["generation"]), int(f["step"]))
        except (KeyError, ValueError):
            continue
        reports[key].append((entry_seconds(entry_id), f))
        reporters[key[0]].add(f.get("worker", ""))
    out: list[CommittedStep] = []
    for (gen, step), rows in reports.items():
        need = set(members[gen]) if members and gen in members else reporters[gen]
        if not need <= {f.get("worker", "") for _, f in rows}:
            continue  # not every worker of the generation reported it: not committed
        losses = [_float(f.get("loss")) for _, f in rows]
        known = [x for x in losses if x is not None]
        samples = [int(_float(f.get("samples")) or 0) for _, f in rows]
        out.append(
            CommittedStep(
                generation=gen,
                step=step,
                at=max(t for t, _ in rows),
                # Workers without the model's head report no loss (or 0); the head's is the loss.
                loss=max(known) if known else None,
                samples=max(samples) if samples else 0,
                seconds=max(_float(f.get("seconds")) or 0.0 for _, f in rows),
            )
        )
    out.sort(key=lambda c: (c.at, c.step))
    return out


def _float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _json(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def _ids(v: Any) -> tuple[str, ...]:
    v = _json(v)
    if isinstance(v, str):
        return tuple(x for x in v.replace(",", " ").split() if x)
    if isinstance(v, list | tuple):
        return tuple(str(x) for x in v)
    return ()


def is_decision(fields: Mapping[str, str]) -> bool:
    """The decisions stream also records the policy machine's phase transitions; skip those."""
    return fields.get("kind", "decision") == "decision"


def parse_decision(entry_id: str, fields: Mapping[str, str]) -> DecisionRecord:
    """Read one decisions-stream entry: flat fields, optionally with the whole decision as JSON."""
    doc: dict[str, Any] = {}
    for key in ("decision", "data", "record"):
        if key in fields and isinstance(_json(fields[key]), dict):
            doc = dict(_json(fields[key]))
            break
    merged: dict[str, Any] = {**doc, **{k: v for k, v in fields.items() if k not in doc}}
    cands_raw = _json(merged.get("candidates", []))
    candidates = (
        tuple(c for c in cands_raw if isinstance(c, dict)) if isinstance(cands_raw, list) else ()
    )
    plan = _json(merged.get("plan"))
    selected = merged.get("selected") or merged.get("policy") or None
    estimate = None
    if isinstance(plan, dict):
        estimate = _float((plan.get("estimates") or {}).get("step_seconds"))
    if estimate is None:
        for c in candidates:
            if c.get("policy") == selected:
                estimate = _float(c.get("step_seconds"))
    if estimate is None:  # a plan that is neither candidate (restore): the record says it
        estimate = _float(merged.get("step_seconds"))
    generation = merged.get("generation")
    if generation is None and isinstance(plan, dict):
        generation = plan.get("generation")
    # The daemon records when it decided (`at`) and how long since the fault reached it.
    at, took = _float(merged.get("at")), _float(merged.get("decision_seconds"))
    received = at - took if at is not None and took is not None else None
    return DecisionRecord(
        at=entry_seconds(entry_id),
        generation=int(generation) if generation not in (None, "") else None,
        selected=str(selected) if selected else None,
        failed=_ids(merged.get("failed", ())),
        joined=_ids(merged.get("joined", ())),
        cause=str(merged.get("cause", "")),
        mtbf_seconds=_float(merged.get("mtbf_seconds")),
        candidates=candidates,
        step_seconds_estimate=estimate,
        received_at=received,
        unrecoverable=str(merged["unrecoverable"]) if merged.get("unrecoverable") else None,
        raw=merged,
        faults=_ids(merged.get("faults", merged.get("failed", ()))),
        unrestorable=_ids(merged.get("unrestorable", ())),
    )


def median_interval(steps: Sequence[CommittedStep]) -> float | None:
    """Median time between consecutive commits (the measured step period)."""
    gaps = [b.at - a.at for a, b in itertools.pairwise(steps) if b.at > a.at]
    return statistics.median(gaps) if gaps else None
