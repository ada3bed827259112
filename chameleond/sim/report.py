"""Tables and plots of simulation results. matplotlib is imported only when a plot is drawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chameleond.sim.engine import PolicyResult
from chameleond.sim.timeline import Kind


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of `rows` (dicts) over `columns`."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def policy_rows(results: Mapping[str, PolicyResult]) -> list[dict[str, Any]]:
    ours = results["chameleon"].average_throughput if "chameleon" in results else None
    rows = []
    for p, r in results.items():
        b = r.breakdown
        rows.append({
            "policy": p,
            "average_throughput": r.average_throughput,
            "gap_to_ideal": r.gap_to_ideal,
            "chameleon_ratio": (ours / r.average_throughput
                                if ours is not None and r.average_throughput > 0 else None),
            "training_s": b[Kind.TRAINING],
            "transition_s": b[Kind.TRANSITION],
            "restart_s": b[Kind.RESTART],
            "lost_s": b[Kind.LOST],
            "down_s": b[Kind.DOWN],
        })  # fmt: skip
    return rows


def plot(results: Mapping[str, PolicyResult], path: str | Path, title: str = "") -> None:
    """Throughput over time per policy (top) and the averages (bottom), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8))
    for name, r in results.items():
        xs: list[float] = []
        ys: list[float] = []
        for s in r.segments:
            xs += [s.start / 3600, s.end / 3600]
            ys += [s.throughput, s.throughput]
        top.plot(xs, ys, label=name, linewidth=1)
    top.set_xlabel("hours")
    top.set_ylabel("samples / s")
    top.set_title(title or "throughput over time")
    top.legend(fontsize="small")
    names = list(results)
    bottom.bar(names, [results[n].average_throughput for n in names])
    if names:
        ideal = next(iter(results.values())).ideal_throughput
        bottom.axhline(
            ideal, color="black", linestyle="--", linewidth=1, label="proportional ideal"
        )
        bottom.legend(fontsize="small")
    bottom.set_ylabel("average samples / s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
