"""Layer splits balanced by time and memory: uneven layers get uneven, balanced stages."""

from __future__ import annotations

import math
from itertools import combinations
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.bench.exhaustive import exhaustive
from chameleond.core.balance import Balancer
from chameleond.core.decide import initial_plan
from chameleond.core.estimator import LayerTable
from chameleond.core.search import ShapeModel, search
from chameleond.core.spec import JobSpec, parse_spec


def make_spec(
    layers: list[dict[str, Any]],
    n_workers: int,
    stages: tuple[int, int],
    memory: int = 10**12,
    micro: int = 8,
) -> JobSpec:
    k = stages[0]
    ids = [f"w{i}" for i in range(n_workers)]
    return parse_spec(
        {
            "workers": [
                {"id": w, "host": f"h{i // 8}", "memory_bytes": memory} for i, w in enumerate(ids)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 1e-5},
                "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 1e-4},
            },
            "model": {"layers": layers},
            "training": {"global_batch": micro, "micro_batch": 1},
            "plan": {"pipelines": [ids[i : i + k] for i in range(0, n_workers, k)]},
            "search": {"min_stages": stages[0], "max_stages": stages[1]},
        }
    )


def layer(seconds: float, param_bytes: int = 0, activation_bytes: int = 0) -> dict[str, Any]:
    return {
        "forward_seconds": seconds / 3,
        "backward_seconds": 2 * seconds / 3,
        "param_bytes": param_bytes,
        "optimizer_bytes": 0,
        "activation_bytes": activation_bytes,
        "output_bytes": 1000,
    }


def compositions(n_layers: int, n_stages: int) -> list[tuple[int, ...]]:
    """Every split of n_layers into n_stages contiguous non-empty ranges (brute force)."""
    out = []
    for cuts in combinations(range(1, n_layers), n_stages - 1):
        edges = (0, *cuts, n_layers)
        out.append(tuple(edges[i + 1] - edges[i] for i in range(n_stages)))
    return out


def bottleneck(table: LayerTable, sizes: tuple[int, ...]) -> float:
    a, worst = 0, 0.0
    for k in sizes:
        worst = max(worst, table.forward_seconds(a, a + k) + table.backward_seconds(a, a + k))
        a += k
    return worst


# An embedding and an LM head 4x a decoder block's time, eight blocks between them.
UNEVEN = [layer(4.0, param_bytes=250), *[layer(1.0, param_bytes=100)] * 8, layer(4.0, 250)]


def test_uneven_layers_get_an_uneven_balanced_split() -> None:
    spec = make_spec(UNEVEN, 4, (4, 4))
    found = search(spec, [w.id for w in spec.workers])
    assert found.layout is not None
    (stages,) = found.layout.shape
    sizes = tuple(b - a for a, b in stages)
    model = ShapeModel(spec, [w.id for w in spec.workers])
    # Brute force over every contiguous split: the least bottleneck and the fastest step.
    every = compositions(len(UNEVEN), 4)
    least = min(bottleneck(model.table, sz) for sz in every)
    fastest = min(model.seconds(sz, 8) for sz in every)
    assert max(sizes) - min(sizes) > 1  # uneven in layer count
    assert sizes == (1, 4, 4, 1)
    assert math.isclose(bottleneck(model.table, sizes), least)  # balanced in time
    assert found.layout.seconds <= fastest * 1.01  # within 1% of the best contiguous split
    even = min(model.seconds(sz, 8) for sz in model.splits(4))
    assert found.layout.seconds < even * 0.9  # the count-even splits are clearly slower

    # The initial plan splits the spec's layout the same way.
    plan = initial_plan(spec)
    assert [st.end_layer - st.first_layer for st in plan.pipelines[0].stages] == [1, 4, 4, 1]


def test_memory_bound_rules_out_the_time_optimal_split() -> None:
    # 4 blocks (400 bytes of parameters, 800 with gradients) do not fit in 700: the time-optimal
    # (1, 4, 4, 1) is out of memory and the least bottleneck that fits is chosen instead.
    spec = make_spec(UNEVEN, 4, (4, 4), memory=700)
    survivors = [w.id for w in spec.workers]
    model = ShapeModel(spec, survivors)
    assert not model.fits((1, 4, 4, 1), 8)
    found = search(spec, survivors)
    assert found.layout is not None
    (stages,) = found.layout.shape
    sizes = tuple(b - a for a, b in stages)
    assert model.fits(sizes, 8)
    feasible = [sz for sz in compositions(len(UNEVEN), 4) if model.fits(sz, 8)]
    least = min(bottleneck(model.table, sz) for sz in feasible)
    assert math.isclose(bottleneck(model.table, sizes), least)
    assert least > bottleneck(model.table, (1, 4, 4, 1))
    assert found.layout.seconds <= min(model.seconds(sz, 8) for sz in feasible) * 1.01


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_balanced_split_is_the_least_bottleneck_that_fits(data: st.DataObject) -> None:
    n_layers = data.draw(st.integers(1, 9))
    layers = [
        layer(
            data.draw(st.floats(0.01, 4.0)),
            param_bytes=data.draw(st.integers(0, 100)),
            activation_bytes=data.draw(st.integers(0, 50)),
        )
        for _ in range(n_layers)
    ]
    n_stages = data.draw(st.integers(1, n_layers))
    n_micro = data.draw(st.integers(1, 10))
    memory = data.draw(st.integers(50, 1500))
    spec = make_spec(layers, n_stages, (n_stages, n_stages), memory=memory, micro=n_micro)
    table = LayerTable(spec)
    got = Balancer(table).split(n_stages, n_micro, memory)

    def fits(sizes: tuple[int, ...]) -> bool:
        a, ok = 0, True
        for s, k in enumerate(sizes):
            ok = ok and table.stage_memory(a, a + k, s, n_stages, n_micro) <= memory
            a += k
        return ok

    feasible = [sz for sz in compositions(n_layers, n_stages) if fits(sz)]
    if not feasible:
        assert got is None
        return
    assert got is not None and fits(got) and sum(got) == n_layers and min(got) >= 1
    assert bottleneck(table, got) == min(bottleneck(table, sz) for sz in feasible)


def test_search_matches_exhaustive_at_16_devices() -> None:
    # Few layers and one pipeline length keep the exhaustive enumeration of the same space
    # (4 pipelines x 5 splits each: 625 layouts) finite.
    layers = [layer(4.0, 300), layer(1.0, 100), layer(1.0, 100), layer(1.0, 100), layer(4.0, 300)]
    spec = make_spec(layers, 16, (4, 4), micro=10)
    survivors = [w.id for w in spec.workers]
    ref = exhaustive(spec, survivors, limit=5000)
    found = search(spec, survivors)
    assert ref.complete and ref.layout is not None and found.layout is not None
    assert math.isclose(found.layout.seconds, ref.layout.seconds, rel_tol=1e-9)
