"""Measure the links to this worker's neighbours, for the planner's link figures.

Once a plan generation's groups are built, each pair of neighbours times a ping-pong: workers that
execute adjacent stages of a pipeline (stage s and s + 1 for the same micro-batch: the activations
and gradients flow there), and workers next to each other in the ring of a sync group (the
gradient all-reduce flows there; in a plan without pipelines this is all the traffic there is).
Each pair times over the generation's world group: a small message for the latency, one of
LARGE_BYTES for the bandwidth, REPEATS times after a warm-up, the fastest of each kept. The pair's
first worker (by id) leads: it sends, times the echo, and sends the figures to the other, so both
report the same link. The figures go into the worker's next `profile` event as `"links"` (the
daemon folds them into the spec: chameleond/jobstate/links.py).

Every worker derives the same pairs and their order from the plan (`probe_rounds`): pairs are put
in rounds, no worker twice in one round, and each worker runs its pairs round by round. The
lowest round with a pair not done has both its workers free, so the probe cannot deadlock.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from chameleond.core.plan import Plan
from chameleond.worker._backend import communicating, exchange
from chameleond.worker._generation import Generation

log = logging.getLogger("chameleon.worker")

SMALL_BYTES = 8
# Small enough that a slow link's probe stays well inside a group timeout (the other workers wait
# in their first step meanwhile): at 5 MB/s a pair's probe takes about 0.3 s.
LARGE_BYTES = 1 << 18
REPEATS = 2
Pair = tuple[str, str]  # (leader, follower): sorted ids


def neighbour_pairs(plan: Plan) -> list[Pair]:
    """Every pair of distinct workers executing adjacent stages of a pipeline, or adjacent in a
    sync group's ring, sorted."""
    links = [
        (a, b)
        for pipe in plan.routing
        for upstream, downstream in itertools.pairwise(pipe)
        for a, b in zip(upstream, downstream, strict=False)
    ]
    for group in plan.sync_groups:
        ring = group.workers
        links += zip(ring, ring[1:] + ring[:1], strict=True) if len(ring) > 1 else []
    return sorted({(min(a, b), max(a, b)) for a, b in links if a != b})


def probe_rounds(plan: Plan) -> list[list[Pair]]:
    """The pairs in rounds: each pair in the first round where neither of its workers is yet."""
    rounds: list[list[Pair]] = []
    busy: list[set[str]] = []
    for pair in neighbour_pairs(plan):
        for used, members in zip(rounds, busy, strict=True):
            if not members & set(pair):
                used.append(pair)
                members.update(pair)
                break
        else:
            rounds.append([pair])
            busy.append(set(pair))
    return rounds


def schedule(plan: Plan, me: str) -> list[tuple[str, bool]]:
    """This worker's probes in order: (peer, whether this worker leads)."""
    out = []
    for pairs in probe_rounds(plan):
        for leader, follower in pairs:
            if me == leader:
                out.append((follower, True))
            elif me == follower:
                out.append((leader, False))
    return out


def figures(small_rtt: float, large_rtt: float) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) from the fastest round trips: the latency is half the small
    message's, the bandwidth LARGE_BYTES over what the large one took beyond it one way."""
    latency = small_rtt / 2
    one_way = max(large_rtt / 2 - latency, 1e-6)
    return LARGE_BYTES / one_way, latency


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wait(works: list[Any], device: torch.device) -> None:
    with communicating():
        for w in works:
            w.wait()
        _sync(device)


def _round_trip(gen: Generation, peer: int, msg: torch.Tensor, leads: bool) -> float:
    device = gen.device.torch_device
    t0 = time.perf_counter()
    if leads:
        _wait(exchange(gen.world_group, [(True, msg, peer)]), device)
        _wait(exchange(gen.world_group, [(False, msg, peer)]), device)
    else:
        _wait(exchange(gen.world_group, [(False, msg, peer)]), device)
        _wait(exchange(gen.world_group, [(True, msg, peer)]), device)
    return time.perf_counter() - t0


def probe_links(gen: Generation, repeats: int = REPEATS) -> list[dict[str, Any]]:
    """Measure this worker's links of `gen` (see the module docstring): the `links` of a profile,
    [{"peer", "bandwidth_bytes_per_second", "latency_seconds"}]; empty without neighbours."""
    device = gen.device.torch_device
    small = torch.zeros(SMALL_BYTES, dtype=torch.uint8, device=device)
    large = torch.zeros(LARGE_BYTES, dtype=torch.uint8, device=device)
    t0 = time.perf_counter()
    links: list[dict[str, Any]] = []
    for peer, leads in schedule(gen.plan, gen.me):
        rank = gen.rank_of(peer)
        rtt = {SMALL_BYTES: float("inf"), LARGE_BYTES: float("inf")}
        for rep in range(repeats + 1):
            for msg in (small, large):
                seconds = _round_trip(gen, rank, msg, leads)
                if rep:  # the first pays for the connection's warm-up
                    rtt[msg.numel()] = min(rtt[msg.numel()], seconds)
        result = torch.tensor(figures(rtt[SMALL_BYTES], rtt[LARGE_BYTES]), dtype=torch.float64)
        result = result.to(device)
        _wait(exchange(gen.world_group, [(leads, result, rank)]), device)
        gen.check()
        bandwidth, latency = (float(v) for v in result.cpu())
        links.append(
            {
                "peer": peer,
                "bandwidth_bytes_per_second": round(bandwidth),
                "latency_seconds": latency,
            }
        )
    if links:
        log.info(
            "generation %d: links to %s measured in %.3fs",
            gen.plan.generation,
            ", ".join(f"{x['peer']} ({x['bandwidth_bytes_per_second'] / 1e6:.0f} MB/s, "
                      f"{x['latency_seconds'] * 1e6:.0f} us)" for x in links),
            time.perf_counter() - t0,
        )  # fmt: skip
    return links
