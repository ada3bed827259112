"""Availability traces packaged with chameleond, in the `time_ms,add|remove,nodeN` format.

From the Oobleck artifact (SymbioticLab/Oobleck, branch sosp23-artifact, tools/simulator/traces;
MIT licence, LICENSE-oobleck beside this file):

* oobleck-6h, -3h, -1h, -30m, -10m, -5m: synthetic; every node added at t=0, then one removal at
  each fixed interval.
* oobleck-p3-trace, oobleck-g4dn-trace: real AWS EC2 p3 / g4dn spot-instance availability, about
  11 hours each.
* oobleck-scaled-gcp-trace, oobleck-scaled-p3-trace: real GCP and p3 traces, rescaled.

`chameleonctl up --trace NAME` takes one of these names (with or without `.csv`) as well as a path.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def packaged_traces() -> list[str]:
    """The packaged traces' names, without `.csv`, sorted."""
    root = resources.files(__package__)
    return sorted(p.name.removesuffix(".csv") for p in root.iterdir() if p.name.endswith(".csv"))


def packaged_trace_path(name: str) -> Path | None:
    """The packaged trace called `name` (with or without `.csv`), or None if there is none."""
    stem = name.removesuffix(".csv")
    if stem not in packaged_traces():
        return None
    return Path(str(resources.files(__package__).joinpath(f"{stem}.csv")))


__all__ = ["packaged_trace_path", "packaged_traces"]
