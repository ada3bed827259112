"""The chaos bench's figures: the summary over the trials, and one line per trial (the figures
themselves are described in chameleond/bench/chaos.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from chameleond.bench.chaos_runner import Trial


def summary(trials: list[Trial], lease_seconds: float, wall_seconds: float) -> dict[str, Any]:
    recoveries = [t.recovery_seconds for t in trials if t.recovery_seconds is not None]
    # kill -9 of the leader: the standby sees its connections gone. A stalled leader's lease
    # must lapse first: those takeovers are reported apart.
    takeovers = [
        t.takeover_seconds for t in trials if t.takeover_seconds is not None and t.kind != "stall"
    ]
    stalls = [t.takeover_seconds for t in trials if t.takeover_seconds and t.kind == "stall"]
    by_kind: dict[str, dict[str, Any]] = {}
    for t in trials:
        k = by_kind.setdefault(t.kind, {"trials": 0, "max_recovery_seconds": None})
        k["trials"] += 1
        if t.recovery_seconds is not None:
            k["max_recovery_seconds"] = round(max(k["max_recovery_seconds"] or 0.0,
                                                  t.recovery_seconds), 3)  # fmt: skip
    return {
        "trials": len(trials),
        "lost_events": sum(t.lost for t in trials),
        "duplicate_applications": sum(t.duplicates for t in trials),
        "crashes": sum(t.crashes for t in trials),
        "forged_accepted": sum(t.forged_accepted for t in trials),
        "max_recovery_seconds": round(max(recoveries), 3) if recoveries else None,
        "max_takeover_seconds": round(max(takeovers), 3) if takeovers else None,
        "max_stall_takeover_seconds": round(max(stalls), 3) if stalls else None,
        "by_kind": by_kind,
        "forged_sent": sum(t.forged_sent for t in trials),
        "lease_seconds": lease_seconds,
        "wall_seconds": round(wall_seconds, 1),
        "per_trial": [asdict(t) for t in trials],
    }


def line(i: int, t: Trial) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}s"

    notes = f"  ({'; '.join(t.notes)})" if t.notes else ""
    return (
        f"trial {i:2d} {t.kind:13s} recovery {s(t.recovery_seconds):>7s} "
        f"takeover {s(t.takeover_seconds):>7s} lost {t.lost} dup {t.duplicates} "
        f"crashes {t.crashes} forged {t.forged_accepted}/{t.forged_sent}{notes}"
    )
