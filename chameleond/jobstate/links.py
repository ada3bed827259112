"""Links measured by the workers, folded into the spec the planner sees.

After building a plan generation's groups, each worker times a ping-pong with its pipeline
neighbours (chameleond/worker/_linkprobe.py) and sends the figures in its next `profile` event as
`"links"`: [{"peer", "bandwidth_bytes_per_second", "latency_seconds"}]. The job keeps each
worker's newest list. The planner has one figure per link kind (docs/planner.md), so each kind's
figures become the slowest measured over the pairs of that kind: the lowest bandwidth and the
highest latency, since a pipeline runs at its slowest link. A pair is inter-host when the two
workers' spec hosts differ; only pairs of workers the plan in force runs count.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, replace
from typing import Any

from chameleond.core.spec import JobSpec, LinkSpec
from chameleond.protocol import MAX_ID_LEN, EventError, shorten

MAX_BANDWIDTH = 1e13  # bytes per second
MAX_LATENCY = 60.0  # seconds

# Reporter -> peer -> the link the reporter measured to that peer.
Measurements = Mapping[str, Mapping[str, LinkSpec]]


def _figure(item: Mapping[str, Any], pos: int, key: str, low: float, high: float) -> float:
    v: Any = item.get(key)
    number = isinstance(v, int | float) and not isinstance(v, bool)
    # The range first: an integer of hundreds of digits overflows isfinite's float.
    if not number or not low <= v <= high or not math.isfinite(v):
        raise EventError(
            f"profile: links[{pos}].{key} must be a number in {low:g}..{high:g}, "
            f"got {shorten(repr(v), 64)}"
        )
    return float(v)


def parse_links(data: Mapping[str, Any], n_workers: int) -> dict[str, LinkSpec] | None:
    """The optional `links` list of a `profile` event, by peer; None when the event has none.
    At most one entry per worker of the job; bandwidth in (0, 1e13], latency in [0, 60]."""
    links = data.get("links")
    if links is None:
        return None
    if not isinstance(links, list):
        raise EventError("profile: 'links' must be a list")
    if len(links) > max(n_workers, 1):
        raise EventError(f"profile: {len(links)} links listed, the job has {n_workers} workers")
    out: dict[str, LinkSpec] = {}
    for pos, item in enumerate(links):
        if not isinstance(item, Mapping):
            raise EventError(f"profile: links[{pos}] must be an object")
        peer = item.get("peer")
        if not isinstance(peer, str) or not 0 < len(peer) <= MAX_ID_LEN:
            raise EventError(f"profile: links[{pos}].peer must be a worker id (<= {MAX_ID_LEN})")
        if peer in out:
            raise EventError(f"profile: links[{pos}] names peer {peer!r} again")
        bandwidth = _figure(item, pos, "bandwidth_bytes_per_second", 0.0, MAX_BANDWIDTH)
        if bandwidth == 0:
            raise EventError(f"profile: links[{pos}].bandwidth_bytes_per_second must be > 0")
        latency = _figure(item, pos, "latency_seconds", 0.0, MAX_LATENCY)
        out[peer] = LinkSpec(bandwidth, latency)
    return out


def measured_pairs(
    spec: JobSpec, measurements: Measurements, members: Collection[str] | None
) -> list[dict[str, Any]]:
    """Every measured link between two workers of the spec (both in `members` unless it is None),
    sorted: {"worker", "peer", "inter_host", "bandwidth_bytes_per_second", "latency_seconds"}."""
    hosts = {w.id: w.host for w in spec.workers}
    out = []
    for worker, links in sorted(measurements.items()):
        for peer, link in sorted(links.items()):
            if worker not in hosts or peer not in hosts:
                continue
            if members is not None and (worker not in members or peer not in members):
                continue
            out.append(
                {"worker": worker, "peer": peer, "inter_host": hosts[worker] != hosts[peer]}
                | asdict(link)
            )
    return out


def slowest(pairs: list[dict[str, Any]], inter_host: bool) -> LinkSpec | None:
    """The slowest figures over the pairs of one kind: lowest bandwidth, highest latency."""
    kind = [p for p in pairs if p["inter_host"] == inter_host]
    if not kind:
        return None
    return LinkSpec(
        min(p["bandwidth_bytes_per_second"] for p in kind),
        max(p["latency_seconds"] for p in kind),
    )


def measured_links(
    spec: JobSpec, measurements: Measurements, members: Collection[str] | None
) -> JobSpec:
    """The spec with each link kind that has measurements replaced by its slowest figures."""
    pairs = measured_pairs(spec, measurements, members)
    intra, inter = slowest(pairs, False), slowest(pairs, True)
    return replace(spec, intra_host=intra or spec.intra_host, inter_host=inter or spec.inter_host)


def links_view(
    spec: JobSpec, measurements: Measurements, members: Collection[str] | None
) -> dict[str, Any]:
    """What status shows: the figure the planner uses per kind (and whether it was measured),
    and every measured pair that counts."""
    pairs = measured_pairs(spec, measurements, members)
    view: dict[str, Any] = {}
    for kind, inter in (("intra_host", False), ("inter_host", True)):
        found = slowest(pairs, inter)
        link = found or (spec.inter_host if inter else spec.intra_host)
        view[kind] = asdict(link) | {"measured": found is not None}
    view["pairs"] = pairs
    return view


def links_to_json(links: Mapping[str, LinkSpec]) -> dict[str, dict[str, float]]:
    """Field by field (`asdict` deep-copies: every worker's links go into each snapshot)."""
    return {
        peer: {"bandwidth_bytes_per_second": link.bandwidth_bytes_per_second,
               "latency_seconds": link.latency_seconds}
        for peer, link in sorted(links.items())
    }  # fmt: skip


def links_from_json(d: Mapping[str, Mapping[str, Any]]) -> dict[str, LinkSpec]:
    return {
        str(peer): LinkSpec(float(v["bandwidth_bytes_per_second"]), float(v["latency_seconds"]))
        for peer, v in d.items()
    }
