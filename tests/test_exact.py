"""The exact referee (bench/exact.py): equal to the literal enumeration where that finishes, no gap
to the search at 32 and 64 devices, and a gap to deliberately weakened searches."""

from __future__ import annotations

import math
from collections.abc import Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_strategies import SLOW_LINKS, layer_kinds

from chameleond.bench.exact import exact
from chameleond.bench.exhaustive import exhaustive
from chameleond.core.search import ShapeModel, search
from chameleond.core.spec import JobSpec, parse_spec

GIB = 2**30


def uneven_job(devices: int) -> JobSpec:
    """A GPT-class job on hosts of 8 devices whose embedding and head cost 3x and 4x a block, so
    the balanced split and the choice of lengths matter."""
    block = {
        "name": "block", "count": 12, "forward_seconds": 0.004, "backward_seconds": 0.008,
        "param_bytes": 100_000_000, "optimizer_bytes": 600_000_000,
        "activation_bytes": 140_000_000, "output_bytes": 8_000_000,
    }  # fmt: skip
    embedding = dict(
        block, name="embedding", count=1, forward_seconds=0.012, backward_seconds=0.024
    )
    head = dict(block, name="head", count=1, forward_seconds=0.016, backward_seconds=0.032)
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i // 8}", "memory_bytes": 32 * GIB}
                for i in range(devices)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 1e11, "latency_seconds": 5e-6},
                "inter_host": {"bandwidth_bytes_per_second": 1.25e10, "latency_seconds": 1e-5},
            },
            "model": {"layers": [embedding, block, head]},
            "training": {"global_batch": 2 * devices, "micro_batch": 1},
            "plan": {"stages": 4},
            "search": {"min_stages": 2, "max_stages": 8},
        }
    )


def gap(spec: JobSpec, survivors: list[str], model: type[ShapeModel] = ShapeModel) -> float:
    ref = exact(spec, survivors).layout
    found = search(spec, survivors, model).optimum
    assert ref is not None and found is not None
    return (found.seconds - ref.seconds) / ref.seconds


def test_no_gap_at_32_devices() -> None:
    spec = uneven_job(32)
    ids = [w.id for w in spec.workers]
    for survivors in (ids, ids[1:], [w for w in ids if w not in ("w5", "w17", "w30")]):
        assert abs(gap(spec, survivors)) <= 1e-12


def test_no_gap_at_64_devices() -> None:
    spec = uneven_job(64)
    ids = [w.id for w in spec.workers]
    assert abs(gap(spec, ids[:-1])) <= 1e-12


class EvenOnly(ShapeModel):
    """Weakened: forgets the balanced split."""

    def candidates(self, n: int, n_micro: int) -> list[tuple[int, ...]]:
        return self.splits(n)


class Overbound(ShapeModel):
    """Weakened: an inadmissible class bound (half again too high) prunes lengths that win."""

    def floor(self, n: int, n_micro: int) -> float:
        return 1.5 * super().floor(n, n_micro)


def test_weakened_searches_show_a_gap() -> None:
    spec = uneven_job(32)
    survivors = [w.id for w in spec.workers][:-1]
    ref = exact(spec, survivors).layout
    assert ref is not None
    for weakened in (EvenOnly, Overbound):
        found = search(spec, survivors, weakened).optimum
        assert found is not None
        assert (found.seconds - ref.seconds) / ref.seconds > 0.01, weakened.__name__
    # The same referee sees no gap to the search itself on this job.
    found = search(spec, survivors).optimum
    assert found is not None and math.isclose(found.seconds, ref.seconds, rel_tol=1e-12)


def small_spec(data: st.DataObject) -> JobSpec:
    n_workers = data.draw(st.integers(2, 10))
    kinds = layer_kinds(data, [0.01, 0.1, 0.3, 1.0], [0.02, 0.2, 0.7, 2.0], 2)
    layers = [data.draw(st.sampled_from(kinds)) for _ in range(data.draw(st.integers(1, 7)))]
    micro = data.draw(st.integers(-(-n_workers // len(layers)), 12))
    k = -(-n_workers // micro)  # the spec's own layout only has to be valid
    ids = [f"w{i}" for i in range(n_workers)]
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": f"h{i % 2}", "memory_bytes": memory}
                for i, memory in enumerate(_memories(data, n_workers))
            ],
            "links": SLOW_LINKS,
            "model": {"layers": layers},
            "training": {
                "global_batch": 2 * micro,
                "micro_batch": 2,
                "overlap_sync": data.draw(st.booleans()),
            },
            "plan": {"pipelines": [ids[i : i + k] for i in range(0, n_workers, k)]},
            "search": {
                "min_stages": data.draw(st.integers(1, 2)),
                "max_stages": data.draw(st.integers(2, 8)),
            },
        }
    )


def _memories(data: st.DataObject, n: int) -> Iterator[int]:
    for _ in range(n):
        yield data.draw(st.integers(300, 3000))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_exact_equals_the_literal_enumeration(data: st.DataObject) -> None:
    spec = small_spec(data)
    ids = [w.id for w in spec.workers]
    survivors = data.draw(st.permutations(ids))[: data.draw(st.integers(1, len(ids)))]
    ref = exhaustive(spec, survivors, limit=3000)
    if not ref.complete:
        return
    found = exact(spec, survivors).layout
    if ref.layout is None:
        assert found is None
        return
    assert found is not None
    assert math.isclose(found.seconds, ref.layout.seconds, rel_tol=1e-12)
    # The layout it names is one of the space's and steps in the time it reports.
    assert sum(len(p) for p in found.shape) <= len(survivors)
    assert sum(found.micro_batches) == spec.training.micro_batches
