"""The recovery report's chart (report.png): what a reader should see at a glance.

Top: throughput. Each step's measured value (the global batch over the time since the previous
commit on the same plan) is drawn faint, its rolling median over a few steps bold, and the
performance model's estimate for the plan in force (global batch / estimated step time) dashed
beside it. Each fault is a red line labelled with the worker (named as in `chameleonctl status`)
and the policy chosen for it; the shaded span is its recovery. Bottom: the loss.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SMOOTH_STEPS = 7  # the rolling median's window (steps)
NAN = float("nan")


def with_previous(rows: Sequence[Any]) -> list[tuple[Any, Any]]:
    """(the row before or None, the row) for each row."""
    return list(zip([None, *rows[:-1]], rows, strict=True)) if rows else []


def measured(timeline: Sequence[Mapping[str, Any]], batch: int) -> list[tuple[float, float]]:
    """(t, samples/s) per step; NaN where a plan changes (a recovery is a gap, not a slope)."""
    out: list[tuple[float, float]] = []
    for prev, r in with_previous(timeline):
        same = prev is not None and prev["generation"] == r["generation"] and r["at"] > prev["at"]
        if prev is not None and not same:
            out.append((r["t"], NAN))
        out.append((r["t"], batch / (r["at"] - prev["at"]) if same and prev is not None else NAN))
    return out


def smoothed(points: Sequence[tuple[float, float]], window: int = SMOOTH_STEPS) -> list[float]:
    """Rolling median of the last `window` values, restarted after every gap (a new plan)."""
    out: list[float] = []
    run: list[float] = []
    for _, v in points:
        if v != v:
            run = []
            out.append(NAN)
            continue
        run = [*run[-(window - 1) :], v]
        out.append(statistics.median(run))
    return out


def estimated(
    plans: Sequence[Mapping[str, Any]], batch: int, end: float
) -> tuple[list[float], list[float]]:
    """A step line: B / the model's step time of each plan, from its publication to the next."""
    xs: list[float] = []
    ys: list[float] = []
    known = [p for p in plans if p.get("estimated_step_seconds") and p.get("t") is not None]
    for p, nxt in itertools.zip_longest(known, known[1:]):
        start = max(0.0, float(p["t"]))
        stop = float(nxt["t"]) if nxt is not None else end
        value = batch / float(p["estimated_step_seconds"])
        xs += [start, stop, stop]
        ys += [value, value, NAN]
    return xs, ys


def draw_chart(report: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report["timeline"]
    batch = report["global_batch"]
    points = measured(tl, batch)
    ts = [t for t, _ in points]
    losses = []
    for prev, r in with_previous(tl):
        if prev is not None and prev["generation"] != r["generation"]:
            losses.append(NAN)
        losses.append(r["loss"] if r["loss"] is not None else NAN)
    end = ts[-1] if ts else 0.0
    fig, (ax_t, ax_l) = plt.subplots(
        2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]}
    )
    ax_t.plot(ts, [v for _, v in points], lw=0.8, color="tab:blue", alpha=0.25,
              label="measured, per step")  # fmt: skip
    ax_t.plot(ts, smoothed(points), lw=2, color="tab:blue",
              label=f"measured, median of {SMOOTH_STEPS} steps")  # fmt: skip
    ex, ey = estimated(report.get("plans", []), batch, end)
    if ex:
        ax_t.plot(ex, ey, lw=1.5, ls="--", color="tab:orange", label="estimated by the model")
    ax_t.set_ylabel("throughput (samples/s)")
    ax_t.set_ylim(bottom=0)
    ax_l.plot(ts, losses, lw=1.2, color="tab:purple")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("seconds since the first committed step")
    for row in [*report["faults"], *report.get("rejoins", [])]:
        _mark(ax_t, ax_l, row)
    faults = len(report["faults"])
    ax_t.set_title(
        f"job {report['job']}: {report.get('steps_committed', len(tl))} steps, "
        f"{faults} fault{'s' if faults != 1 else ''}",
        loc="left",
    )
    ax_t.legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _mark(ax_t: Any, ax_l: Any, row: Mapping[str, Any]) -> None:
    """A fault or rejoin: a line at its time, labelled "w3 killed: reroute"; its recovery shaded."""
    at = row["at_seconds"]
    if at is None:
        return
    joined = row["action"] == "start"
    colour = "tab:green" if joined else "tab:red"
    for ax in (ax_t, ax_l):
        ax.axvline(at, color=colour, ls="--", lw=1)
    what = {"kill": "killed", "event": "reported failed", "start": "rejoined"}.get(
        row["action"], row["action"]
    )
    policy = row.get("policy") or ("unrecoverable" if row.get("unrecoverable") else "no plan")
    ax_t.annotate(
        f"{row['worker']} {what}: {policy}",
        (at, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12),
        textcoords="offset points",
        fontsize=8,
        color=colour,
        rotation=0,
    )
    if row.get("recovery_seconds") is not None:
        ax_t.axvspan(at, at + row["recovery_seconds"], color=colour, alpha=0.12)
