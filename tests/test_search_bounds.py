"""The search's split tables and bounds: vectorised costs equal the scalar ones, bounds never
exceed the longest path, and `best` is the first least-time split in the order the bounds give."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from spec_strategies import SLOW_LINKS, layer_kinds

from chameleond.core.balance import Balancer
from chameleond.core.estimator import LayerTable
from chameleond.core.search import ShapeModel
from chameleond.core.spec import JobSpec, parse_spec


def uneven_spec(data: st.DataObject) -> JobSpec:
    """Up to 14 layers of a few kinds (so even splits tie, and uneven ones differ), random memory,
    sync after the pipeline or overlapped with backward."""
    kinds = layer_kinds(data, [0.0, 0.01, 0.1, 0.25, 1.0], [0.02, 0.2, 0.5, 2.0], 3)
    layers = [data.draw(st.sampled_from(kinds)) for _ in range(data.draw(st.integers(2, 14)))]
    n_workers = data.draw(st.integers(2, 24))
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i % 3}", "memory_bytes": memory}
                for i, memory in enumerate(
                    data.draw(
                        st.lists(st.integers(400, 4000), min_size=n_workers, max_size=n_workers)
                    )
                )
            ],
            "links": SLOW_LINKS,
            "model": {"layers": layers},
            "training": {
                "global_batch": 2 * n_workers,
                "micro_batch": 2,
                "overlap_sync": data.draw(st.booleans()),
            },
            "plan": {"pipelines": [[f"w{i}"] for i in range(n_workers)]},
            "search": {"min_stages": 1, "max_stages": 8},
        }
    )


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_tables_bounds_and_best_agree_with_brute_force(data: st.DataObject) -> None:
    spec = uneven_spec(data)
    ids = [w.id for w in spec.workers]
    model = ShapeModel(spec, ids[: data.draw(st.integers(1, len(ids)))])
    for n in range(1, min(8, len(spec.layers)) + 1):
        for m in range(1, 5):
            cands = model.candidates(n, m)
            table = model.splits_table(n, m)
            # The table holds exactly the splits that fit, each with the scalar chain bound.
            listed = sorted(i for _, index, _ in table.values() for i in index)
            assert listed == [i for i, sz in enumerate(cands) if model.fits(sz, m)]
            order = list(model.by_bound(n, m))
            rows = []
            for lb, tight, sizes in order:
                t = model.seconds(sizes, m)
                assert lb == model.lower_bound(sizes, m)
                assert lb <= tight <= t * (1 + 1e-9)  # both admissible, the fill bound tighter
                rows.append((t, lb, cands.index(sizes), sizes))
            # by_bound: increasing (bound, candidate index); best: the least time (to rounding:
            # a bound summed in another order can pass the time by an ulp and stop the scan),
            # the first split in that order with its time.
            assert [r[1:3] for r in rows] == sorted(r[1:3] for r in rows)
            t_best, sizes_best = model.best(n, m)
            if not rows:
                assert sizes_best is None
                continue
            assert min(rows)[0] <= t_best <= min(rows)[0] * (1 + 1e-9)
            assert sizes_best == next(r[3] for r in rows if r[0] == t_best)
            assert model.floor(n, m) <= model.best(n, m)[0]


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_balanced_split_shared_by_micro_batch_counts_past_the_length(data: st.DataObject) -> None:
    """N_m >= N_pp stashes N_pp - i at every stage: the memoised split is the one computed for
    each count on its own."""
    spec = uneven_spec(data)
    memory = min(w.memory_bytes for w in spec.workers)
    balancer = Balancer(LayerTable(spec))
    for n in range(1, min(8, len(spec.layers)) + 1):
        for m in range(1, 2 * n + 2):
            alone = Balancer(LayerTable(spec))._split(n, m, memory)
            assert balancer.split(n, m, memory) == alone
