"""The search's knapsack (core/search.py, `_search_by_threshold`): the least total weight of
pipelines of the allowed lengths whose stages sum to the survivors, each length with an integer
weight (its micro-batch surplus scaled by N), and how many pipelines of each length reach it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def knapsack(items: Sequence[tuple[int, int]], size: int) -> dict[int, int] | None:
    """How many of each item (length, weight) a multiset of least total weight whose lengths sum
    to `size` takes, when that weight is <= 0 (else None).

    The dynamic programme over x = 1 .. size: best[x] = min over items of best[x - n] + w, the
    first item in order on ties, last[x] its length. It stops early once it repeats: with p and
    c the length and weight of the item of least weight per length, when best[y] = best[y - p] + c
    for `longest` consecutive y (all >= p), every candidate of the next x is that of x - p plus c,
    so best[x] = best[x - p] + c and last[x] = last[x - p] for every x after them (induction);
    larger x are read off whole periods down. The same values and choices as running to `size`:
    weights are integers, so the sums are exact."""
    best: list[float] = [math.inf] * (size + 1)
    last = [0] * (size + 1)
    best[0] = 0
    top, p, c = size, 1, 0  # the last x computed; the period and its weight
    if items:
        p, c = min(items, key=lambda it: it[1] / it[0])
        longest = max(n for n, _ in items)
        run = 0
        for x in range(1, size + 1):
            b, chosen = math.inf, 0
            for n, w in items:
                if n <= x:
                    v = best[x - n] + w
                    if v < b:
                        b, chosen = v, n
            best[x], last[x] = b, chosen
            run = run + 1 if x >= p and b == best[x - p] + c else 0
            if run >= longest:
                top = x
                break

    def down(x: int) -> tuple[int, int]:
        """x taken whole periods down to at most `top`, and how many periods."""
        if x <= top:
            return x, 0
        k = -(-(x - top) // p)
        return x - k * p, k

    at, k = down(size)
    if best[at] + k * c > 0:
        return None
    counts: dict[int, int] = {}
    x = size
    while x:
        n = last[down(x)[0]]
        counts[n] = counts.get(n, 0) + 1
        x -= n
    return counts
