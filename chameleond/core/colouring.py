"""Colouring rounds over a conflict graph (PAPER.md section 7).

Two things run as rounds: the migration transfers of a new plan, and the gradient all-reduces of its
sync groups. In both, two items conflict when they need the same worker at the same time; a proper
colouring of the conflict graph puts conflicting items in different colours, and each colour is a
round in which everything runs concurrently.

`dsatur` is the method's colouring. When items have durations and a round lasts as long as its
slowest item, `first_fit_decreasing` is the weight-aware alternative (longest first, each into the
first round where it fits): it keeps long items together instead of letting one long item stretch
an otherwise short round. `weighted_rounds` runs both and keeps the shorter schedule.

The algorithm and its tie-breaks are exactly those of networkx's
`greedy_color(G, strategy="DSATUR")`: pick the uncoloured vertex with the most distinct colours
among its neighbours, break ties by degree, then by vertex order; give it the smallest colour its
neighbours do not use. The test suite checks that both give the same colouring. networkx's version
recomputes every vertex's saturation before each pick, O(V * (V + E)) in all, which is minutes for
the few thousand transfers of a 1,024-worker re-partition; this one keeps a heap with lazy
deletion, O((V + E) log V), and each vertex's neighbouring colours (as each member's rounds in
`first_fit_decreasing`) as an integer bit set.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Hashable, Iterable, Sequence


def dsatur(adjacency: Sequence[Collection[int]]) -> list[int]:
    """Colour vertices 0..n-1 (`adjacency[v]` = neighbours of v, symmetric, no self loops)."""
    n = len(adjacency)
    colour = [-1] * n
    # The distinct colours among a vertex's coloured neighbours as a bit set, and their count.
    seen = [0] * n
    saturation = [0] * n
    degree = [len(a) for a in adjacency]
    # Entries are (-saturation, -degree, vertex); an entry is stale once the vertex is coloured or
    # its saturation has grown (a newer entry was pushed then).
    heap = [(0, -degree[v], v) for v in range(n)]
    heapq.heapify(heap)
    while heap:
        neg_sat, _, v = heapq.heappop(heap)
        if colour[v] >= 0 or -neg_sat != saturation[v]:
            continue
        used = seen[v]
        c = (~used & (used + 1)).bit_length() - 1  # the smallest colour not in `used`
        colour[v] = c
        bit = 1 << c
        for u in adjacency[v]:
            if colour[u] < 0 and not seen[u] & bit:
                seen[u] |= bit
                saturation[u] += 1
                heapq.heappush(heap, (-saturation[u], -degree[u], u))
    return colour


def conflict_graph(members: Sequence[Iterable[Hashable]]) -> list[set[int]]:
    """Adjacency of items that share a member (a worker): every member's items form a clique."""
    by_member: dict[Hashable, list[int]] = {}
    for i, ms in enumerate(members):
        for m in ms:
            by_member.setdefault(m, []).append(i)
    adjacency: list[set[int]] = [set() for _ in members]
    for items in by_member.values():
        if len(items) > 1:  # a member of one item links nothing
            for i in items:
                adjacency[i].update(items)
    for i, a in enumerate(adjacency):
        a.discard(i)
    return adjacency


def rounds(members: Sequence[Iterable[Hashable]]) -> list[int]:
    """Round of each item such that no member takes part in two items of one round."""
    return dsatur(conflict_graph(members))


def first_fit_decreasing(
    members: Sequence[Iterable[Hashable]], seconds: Sequence[float]
) -> list[int]:
    """Rounds for items with durations: longest first, each into the lowest round it fits."""
    busy: dict[Hashable, int] = {}  # member -> the rounds it takes part in, as a bit set
    colour = [0] * len(members)
    for i in sorted(range(len(members)), key=lambda i: (-seconds[i], i)):
        ms = list(members[i])
        taken = 0
        for m in ms:
            taken |= busy.get(m, 0)
        c = (~taken & (taken + 1)).bit_length() - 1  # the lowest round not taken
        colour[i] = c
        bit = 1 << c
        for m in ms:
            busy[m] = busy.get(m, 0) | bit
    return colour


def schedule_seconds(colour: Sequence[int], seconds: Sequence[float]) -> float:
    """Time of a round schedule: rounds run one after another, each as long as its slowest item."""
    slowest: dict[int, float] = {}
    for c, s in zip(colour, seconds, strict=True):
        slowest[c] = max(slowest.get(c, 0.0), s)
    return sum(slowest.values())


def weighted_rounds(
    members: Sequence[Iterable[Hashable]], seconds: Sequence[float]
) -> tuple[list[int], float]:
    """The shorter of the DSATUR and first-fit-decreasing schedules (DSATUR on a tie)."""
    members = [tuple(m) for m in members]
    by_dsatur = rounds(members)
    by_length = first_fit_decreasing(members, seconds)
    t_dsatur = schedule_seconds(by_dsatur, seconds)
    t_length = schedule_seconds(by_length, seconds)
    return (by_length, t_length) if t_length < t_dsatur else (by_dsatur, t_dsatur)
