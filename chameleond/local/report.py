"""The recovery report of a local run: one row per fault, report.json, a PNG chart, a printed table.

Every number comes from what the run recorded (see `timeline`): when the fault was injected (the
injector's clock, taken right at the kill or the XADD), when it was detected (the first fault event
naming the worker on the events stream, else the daemon's own received time in its decision record),
when the plan was published (the decision record's entry id), and when the first step committed on
the new plan (step events). Missing measurements stay null; nothing is filled in by estimate.

Definitions (seconds): detection = detected - injected; decision = decided - detected (fault in ->
plan out, as `chameleon_decision_seconds`); recovery = first step committed on the new plan -
injected (a worker's death to training again). Throughput (samples/s) is the global batch divided by
the median time between consecutive commits: over the last few steps before the fault, and over the
new plan's steps after its first.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from chameleond.core.drop import FIXED_BATCH
from chameleond.local.chart import draw_chart
from chameleond.local.timeline import (
    CommittedStep,
    committed_steps,
    group_rebuild_seconds,
    median_interval,
)
from chameleond.records import DecisionRecord, Entry, entry_seconds, read_decisions

WINDOW = 5  # steps before a fault that define "throughput before"


@dataclass(frozen=True)
class Injection:
    at: float  # unix seconds, taken at the kill / XADD
    worker: str
    action: str  # "kill" | "event" | "start" (a trace add: the worker rejoins)
    cause: str
    trigger: str  # "step=4", "t=20s", "trace 601200 ms", ...


def _candidate_view(c: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("policy", "feasible", "reason", "step_seconds", "transition_seconds", "score")
    return {k: c.get(k) for k in keys}


def _why(d: DecisionRecord) -> str:
    parts = []
    for c in d.candidates:
        if c.get("reason") == FIXED_BATCH:
            continue  # drop is not an option for this job: nothing to explain
        if c.get("feasible") is False:
            parts.append(f"{c.get('policy')} infeasible ({c.get('reason', '')})")
        elif c.get("score") is not None:
            parts.append(f"{c.get('policy')} score {float(c['score']):.2f}")
    d_text = f"D={d.mtbf_seconds:.0f}s" if d.mtbf_seconds is not None else "D unknown"
    note = d.note
    if d.unrestorable and note:  # a restore decided again: what the failed one could not load
        note = f"{d.cause}; {note}"
    if d.selected == "restore" and note:  # both candidates lost the same layers: say it once
        return f"{note}, {d_text}"
    return ", ".join([*parts, d_text])


def _throughput(steps: Sequence[CommittedStep], global_batch: int) -> float | None:
    period = median_interval(steps)
    return global_batch / period if period else None


def _round(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _restored_again(
    d: DecisionRecord | None, records: Sequence[DecisionRecord]
) -> DecisionRecord | None:
    """A restore plan some worker could not load is decided again at once (an older checkpoint,
    or unrecoverable): the fault's recovery is that decision's."""
    while d is not None and d.selected == "restore":
        i = records.index(d) + 1
        if i == len(records) or not records[i].unrestorable:
            return d
        d = records[i]
    return d


def build_report(
    *,
    job: str,
    global_batch: int,
    injections: Sequence[Injection],
    events: Sequence[Entry],
    decisions: Sequence[Entry],
    members: Mapping[int, Collection[str]] | None = None,
    extra: Mapping[str, Any] | None = None,
    plan_docs: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """`plan_docs`: generation -> the plan as published, where the run saw it (its estimates fill
    in a decision record that carries none: the initial plan, a switch)."""
    steps = committed_steps(events, members)
    records = read_decisions(decisions)
    t0 = steps[0].at if steps else (injections[0].at if injections else 0.0)
    fault_events = [(entry_seconds(i), f) for i, f in events if f.get("type") == "fault"]
    rows: list[dict[str, Any]] = []
    rejoins: list[dict[str, Any]] = []
    for inj in injections:
        is_fault = inj.action != "start"
        decision = next(
            (
                d
                for d in records
                if d.at >= inj.at
                and (
                    inj.worker in (d.faults if is_fault else d.joined) or not (d.failed or d.joined)
                )
            ),
            None,
        )
        decision = _restored_again(decision, records)
        detected = None
        if is_fault:
            detected = next(
                (
                    t
                    for t, f in fault_events
                    if t >= inj.at and inj.worker in (f.get("worker"), f.get("node"))
                ),
                None,
            )
        if detected is None and decision is not None and decision.received_at is not None:
            detected = decision.received_at
        # A decision that published nothing (current plan kept, unrecoverable) has no new plan
        # to recover on.
        gen = decision.generation if decision and decision.selected else None
        on_new = [s for s in steps if gen is not None and s.generation == gen and s.at >= inj.at]
        recovered = on_new[0].at if on_new else None
        before = [s for s in steps if s.at <= inj.at][-WINDOW:]
        after = on_new[1:] if len(on_new) > 2 else on_new
        measured_step = (
            statistics.median(s.seconds for s in on_new[1:]) if len(on_new) > 1 else None
        )
        row: dict[str, Any] = {
            "at_seconds": _round(inj.at - t0),
            "worker": inj.worker,
            "action": inj.action,
            "trigger": inj.trigger,
            "cause": inj.cause,
            "step_at_fault": before[-1].step if before else None,
            "detection_seconds": _round(detected - inj.at) if detected is not None else None,
            "decision_seconds": _round(decision.at - detected)
            if decision is not None and detected is not None
            else None,
            "recovery_seconds": _round(recovered - inj.at) if recovered is not None else None,
            # Part of the recovery: the new plan's process groups built, per backend.
            "group_rebuild_seconds": group_rebuild_seconds(events, gen) if gen else {},
            "generation": gen,
            "policy": (decision.selected or None) if decision else None,
            "why": _why(decision) if decision else "no decision recorded",
            "mtbf_seconds": _round(decision.mtbf_seconds) if decision else None,
            "candidates": [_candidate_view(c) for c in decision.candidates] if decision else [],
            "unrecoverable": (decision.unrecoverable or None) if decision else None,
            "throughput_before": _round(_throughput(before, global_batch), 2),
            "throughput_after": _round(_throughput(after, global_batch), 2),
            "estimated_step_seconds": _round(decision.estimate, 4) if decision else None,
            "measured_step_seconds": _round(measured_step, 4),
        }
        (rows if is_fault else rejoins).append(row)
    return {
        "job": job,
        "global_batch": global_batch,
        "steps_committed": len(steps),
        "final_loss": steps[-1].loss if steps else None,
        "first_loss": steps[0].loss if steps else None,
        "duration_seconds": _round(steps[-1].at - t0) if steps else None,
        "decisions": len(records),
        "faults": rows,
        "rejoins": rejoins,
        "timeline": [{**asdict(s), "t": _round(s.at - t0)} for s in steps],
        # Every plan published, with the performance model's step time for it (the chart draws
        # B / estimate beside the measured throughput).
        "plans": [
            {
                "generation": d.generation,
                "policy": d.selected,
                "t": _round(d.at - t0),
                "estimated_step_seconds": _round(_estimate(d, plan_docs or {}), 4),
            }
            for d in records
            if d.selected and d.generation is not None
        ],
        **(dict(extra) if extra else {}),
    }


def write_report(report: Mapping[str, Any], directory: Path) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / "report.json"
    json_path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    png_path = directory / "report.png"
    draw_chart(report, png_path)
    return json_path, png_path


def _estimate(d: DecisionRecord, docs: Mapping[int, Mapping[str, Any]]) -> float | None:
    """The model's step time of the plan a decision published: its record's, else the plan's."""
    if d.estimate is not None:
        return d.estimate
    estimates = (docs.get(d.generation) or {}).get("estimates") or {}
    value = estimates.get("step_seconds") if isinstance(estimates, Mapping) else None
    return float(value) if isinstance(value, int | float) else None


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def print_table(report: Mapping[str, Any], out: TextIO) -> None:
    head = (
        f"{'#':>2} {'t(s)':>6} {'worker':<7} {'cause':<22} {'detect':>7} {'decide':>7} "
        f"{'recover':>8} {'policy':<8} {'tput before':>11} {'after':>7} {'est/meas step s':>16}"
    )
    out.write(
        f"Recovery report: job {report['job']}, {report['steps_committed']} steps committed, "
        f"loss {_fmt(report['first_loss'], '.3f')} -> {_fmt(report['final_loss'], '.3f')}\n"
    )
    out.write(head + "\n" + "-" * len(head) + "\n")
    for n, r in enumerate(report["faults"], start=1):
        est = (
            f"{_fmt(r['estimated_step_seconds'], '.3f')}/{_fmt(r['measured_step_seconds'], '.3f')}"
        )
        out.write(
            f"{n:>2} {_fmt(r['at_seconds'], '.1f'):>6} {r['worker']:<7} {r['cause'][:22]:<22} "
            f"{_fmt(r['detection_seconds'], '.3f'):>7} {_fmt(r['decision_seconds'], '.3f'):>7} "
            f"{_fmt(r['recovery_seconds'], '.3f'):>8} {_fmt(r['policy']):<8} "
            f"{_fmt(r['throughput_before'], '.1f'):>11} {_fmt(r['throughput_after'], '.1f'):>7} "
            f"{est:>16}\n"
        )
        out.write(f"   why: {r['why']}\n")
    for r in report.get("rejoins", []):
        out.write(
            f"   rejoin {r['worker']} at {_fmt(r['at_seconds'], '.1f')} s: policy "
            f"{_fmt(r['policy'])}, back to training after {_fmt(r['recovery_seconds'], '.3f')} s\n"
        )
