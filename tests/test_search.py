"""Algorithm 1: the search is never beaten by an exhaustive enumeration of the same space."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from chameleond.bench.exhaustive import exhaustive
from chameleond.core.layouttime import Timing, layout_seconds
from chameleond.core.search import (
    ShapeModel,
    forget_results,
    forget_tables,
    search,
    spare_counts,
)
from chameleond.core.spec import JobSpec, parse_spec


def random_spec(data: st.DataObject, n_workers: int) -> JobSpec:
    n_layers = data.draw(st.integers(1, 7))
    layers = [
        {
            "forward_seconds": data.draw(st.floats(0.01, 1.0)),
            "backward_seconds": data.draw(st.floats(0.01, 2.0)),
            "param_bytes": data.draw(st.integers(0, 100)),
            "optimizer_bytes": data.draw(st.integers(0, 100)),
            "activation_bytes": data.draw(st.integers(0, 60)),
            "output_bytes": data.draw(st.integers(0, 1000)),
        }
        for _ in range(n_layers)
    ]
    # The spec's own layout is not searched, it only has to be valid: pipelines of k workers.
    micro = data.draw(st.integers(-(-n_workers // n_layers), 12))
    k = -(-n_workers // micro)
    ids = [f"w{i}" for i in range(n_workers)]
    return parse_spec(
        {
            "workers": [
                {
                    "id": f"w{i}",
                    "host": f"h{i % 2}",
                    "memory_bytes": data.draw(st.integers(300, 3000)),
                }
                for i in range(n_workers)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e4, "latency_seconds": 0.001},
                "inter_host": {"bandwidth_bytes_per_second": 1e3, "latency_seconds": 0.01},
            },
            "model": {"layers": layers},
            "training": {"global_batch": 2 * micro, "micro_batch": 2},
            "plan": {"pipelines": [ids[i : i + k] for i in range(0, n_workers, k)]},
            "search": {
                "min_stages": data.draw(st.integers(1, 2)),
                "max_stages": data.draw(st.integers(2, 8)),
            },
        }
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_no_plan_beats_the_search(data: st.DataObject) -> None:
    n_workers = data.draw(st.integers(2, 12))
    spec = random_spec(data, n_workers)
    ids = [w.id for w in spec.workers]
    alive = data.draw(st.integers(max(1, n_workers // 2), n_workers))
    survivors = data.draw(st.permutations(ids))[:alive]
    found = search(spec, survivors)
    ref = exhaustive(spec, survivors, limit=4000)
    event(f"complete={ref.complete} feasible={ref.layout is not None} survivors={len(survivors)}")
    if not ref.complete:
        return  # too large to enumerate: nothing to compare with
    if ref.layout is None:
        assert found.layout is None and found.reason
        return
    assert found.layout is not None and found.optimum is not None
    assert found.optimum.seconds <= ref.layout.seconds * (1 + 1e-9)
    assert found.optimum.seconds >= ref.layout.seconds * (1 - 1e-9)  # same space: same optimum


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_layouts_are_well_formed(data: st.DataObject) -> None:
    n_workers = data.draw(st.integers(1, 12))
    spec = random_spec(data, n_workers)
    survivors = [w.id for w in spec.workers]
    found = search(spec, survivors)
    if found.layout is None:
        return
    # Every survivor has a slot, or the layout leaves a few idle as spares (fewer than one
    # pipeline's length), where that steps faster.
    layout = found.layout
    used = sum(len(p) for p in layout.shape)
    assert used in spare_counts(spec, len(survivors))
    model = ShapeModel(spec, survivors[:used])
    assert sum(layout.micro_batches) == spec.training.micro_batches
    assert all(m >= 1 for m in layout.micro_batches)
    for stages, m in zip(layout.shape, layout.micro_batches, strict=True):
        assert spec.search.min_stages <= len(stages) <= spec.search.max_stages
        assert stages[0][0] == 0 and stages[-1][1] == len(spec.layers)
        assert all(a < b for a, b in stages)
        assert all(stages[i][1] == stages[i + 1][0] for i in range(len(stages) - 1))
        sizes = tuple(b - a for a, b in stages)
        assert sizes in model.candidates(len(stages), m)  # an even or the balanced split
        assert model.fits(sizes, m)
    # Its time is its step as a plan (core.layouttime), on the link of all the survivors; with
    # one split, the objective's: the slowest pipeline with its sync share.
    whole = ShapeModel(spec, survivors)
    timing = Timing(whole.table, whole.link, spec.training.overlap_sync)
    assert layout.seconds == layout_seconds(timing, layout.shape, layout.micro_batches)
    if len(set(layout.shape)) == 1 and whole.link == model.link:
        objective = max(
            model.seconds([b - a for a, b in stages], m)
            for stages, m in zip(layout.shape, layout.micro_batches, strict=True)
        )
        assert math.isclose(objective, layout.seconds)


def test_out_of_memory_everywhere_is_a_reason() -> None:
    spec = parse_spec(
        {
            "workers": [{"id": f"w{i}", "memory_bytes": 10} for i in range(4)],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e4, "latency_seconds": 0.0},
                "inter_host": {"bandwidth_bytes_per_second": 1e3, "latency_seconds": 0.0},
            },
            "model": {"layers": [{"forward_seconds": 1, "backward_seconds": 1, "param_bytes": 100,
                                  "optimizer_bytes": 0, "activation_bytes": 0, "output_bytes": 0,
                                  "count": 4}]},
            "training": {"global_batch": 4, "micro_batch": 1},
            "plan": {"stages": 2},
        }
    )  # fmt: skip
    found = search(spec, ["w0", "w1", "w2"])
    assert found.layout is None
    assert "out of memory" in found.reason


def test_fewer_micro_batches_than_survivors_repairs_empty_pipelines() -> None:
    # 3 micro-batches over 5 survivors: length-1 pipelines floor to 0 and are repaired.
    spec = parse_spec(
        {
            "workers": [{"id": f"w{i}", "memory_bytes": 10**9} for i in range(5)],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e4, "latency_seconds": 0.0},
                "inter_host": {"bandwidth_bytes_per_second": 1e3, "latency_seconds": 0.0},
            },
            "model": {"layers": [{"forward_seconds": 1, "backward_seconds": 2, "param_bytes": 0,
                                  "optimizer_bytes": 0, "activation_bytes": 0, "output_bytes": 0,
                                  "count": 5}]},
            "training": {"global_batch": 3, "micro_batch": 1},
            "plan": {"pipelines": [["w0", "w1", "w2", "w3", "w4"]]},
        }
    )  # fmt: skip
    survivors = [w.id for w in spec.workers]
    found, ref = search(spec, survivors), exhaustive(spec, survivors)
    assert ref.complete and ref.layout is not None and found.optimum is not None
    assert math.isclose(found.optimum.seconds, ref.layout.seconds)
    assert found.layout is not None and len(found.layout.shape) <= 3


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_kept_result_is_the_search_of_those_survivors(data: st.DataObject) -> None:
    # The search keeps its results by what they are computed from (`result_key`): survivors of
    # another count, least memory or span of hosts must never get another's result.
    n_workers = data.draw(st.integers(2, 8))
    spec = random_spec(data, n_workers)
    ids = [w.id for w in spec.workers]
    forget_tables()
    for _ in range(4):
        survivors = data.draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
        survivors.sort(key=ids.index)
        kept = search(spec, survivors)
        forget_results()
        fresh = search(spec, survivors)
        assert (kept.layout, kept.optimum, kept.reason) == (fresh.layout, fresh.optimum,
                                                            fresh.reason)  # fmt: skip
        assert kept.plans_considered == fresh.plans_considered
        again = search(spec, survivors)
        assert again.shapes_timed == 0 and again.layout == fresh.layout


LAYER = {
    "forward_seconds": 0.1, "backward_seconds": 0.2, "param_bytes": 10, "optimizer_bytes": 10,
    "activation_bytes": 5, "output_bytes": 100,
}  # fmt: skip


def test_searches_of_survivors_alike_share_one_result() -> None:
    # Two workers' loss, or two others' on the same hosts: one search, the second returns it.
    spec = parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i // 4}", "memory_bytes": 3000} for i in range(16)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e4, "latency_seconds": 0.001},
                "inter_host": {"bandwidth_bytes_per_second": 1e3, "latency_seconds": 0.01},
            },
            "model": {"layers": [LAYER] * 8},
            "training": {"global_batch": 16, "micro_batch": 2},
            "plan": {"stages": 4},
        }
    )
    ids = [w.id for w in spec.workers]
    forget_tables()
    first = search(spec, [w for w in ids if w not in ("w1", "w9")])
    assert first.shapes_timed > 0
    second = search(spec, [w for w in ids if w not in ("w3", "w14")])
    assert second.shapes_timed == 0 and second.layout == first.layout
    # As many survivors on one host as on four: another link, searched on its own.
    across = search(spec, ["w0", "w4", "w8", "w12"])
    within = search(spec, ids[:4])
    assert within.shapes_timed > 0
    assert within.layout is not None and across.layout is not None
    assert within.layout.seconds < across.layout.seconds
