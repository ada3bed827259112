"""Pieces of random job specs for the property tests of the search and its referees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

# Slow enough links that where a stage boundary falls matters.
SLOW_LINKS = {
    "intra_host": {"bandwidth_bytes_per_second": 1e4, "latency_seconds": 0.001},
    "inter_host": {"bandwidth_bytes_per_second": 1e3, "latency_seconds": 0.01},
}


def layer_kinds(
    data: st.DataObject, forward: Sequence[float], backward: Sequence[float], count: int
) -> list[dict[str, Any]]:
    """`count` kinds of layer (small byte sizes, times drawn from `forward` and `backward`), so
    that a model of a few kinds has even splits that tie and uneven ones that differ."""
    return [
        {
            "forward_seconds": data.draw(st.sampled_from(forward)),
            "backward_seconds": data.draw(st.sampled_from(backward)),
            "param_bytes": data.draw(st.integers(0, 100)),
            "optimizer_bytes": data.draw(st.integers(0, 100)),
            "activation_bytes": data.draw(st.integers(0, 60)),
            "output_bytes": data.draw(st.integers(0, 1000)),
        }
        for _ in range(count)
    ]
