"""The planner at 8,192 devices (examples/cluster-8192.toml), and its fast paths against the
slow ones they replace.

The decision for a two-worker fault is pinned to the bit, with the job's tables cold or kept:
the reroute candidate as the planner made it before its fast paths (the knapsack stopped at its
period, the job tables kept across decisions, the reroute's check for nothing to repair, the
risk's sweep over layers), the dynamic one with the uniform layout the search now settles on
(the search's optimum by its objective is the one it found before them). The knapsack's early
stop agrees with the full dynamic programme, and the sweep with counting holders layer by layer.
Tables prepared between faults leave a fault's search nothing to time, and change no decision;
the results prepared are the searches of those faults.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.core.decide import decide, initial_plan, prepare
from chameleond.core.holdings import holder_counts, merge, sole_holders, spans_coverage
from chameleond.core.knapsack import knapsack
from chameleond.core.plan import plan_to_dict
from chameleond.core.roster import roster
from chameleond.core.search import forget_results, forget_tables, search
from chameleond.core.spec import load_spec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cluster-8192.toml"


def full_programme(items: list[tuple[int, int]], size: int) -> dict[int, int] | None:
    """The knapsack's dynamic programme run to `size`, as the search ran it before."""
    best = [math.inf] * (size + 1)
    last = [0] * (size + 1)
    best[0] = 0
    for x in range(1, size + 1):
        for n, w in items:
            if n <= x and best[x - n] + w < best[x]:
                best[x], last[x] = best[x - n] + w, n
    if best[size] > 0:
        return None
    counts: dict[int, int] = {}
    x = size
    while x:
        counts[last[x]] = counts.get(last[x], 0) + 1
        x -= last[x]
    return counts


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 20), st.integers(-60, 60)), max_size=6, unique_by=lambda i: i[0]
    ),
    st.integers(1, 500),
)
def test_knapsack_stops_at_its_period_with_the_full_programmes_answer(
    items: list[tuple[int, int]], size: int
) -> None:
    assert knapsack(items, size) == full_programme(items, size)


def test_knapsack_with_lengths_of_equal_weight_per_length() -> None:
    # Ties everywhere: several items share the least weight per length.
    for items in ([(2, -2), (3, -3), (5, -5)], [(4, 2), (6, 3), (5, 1), (10, 2)], [(3, 0), (7, 0)]):
        for size in range(1, 300):
            assert knapsack(items, size) == full_programme(items, size), (items, size)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([f"w{i}" for i in range(12)]),
        st.lists(st.tuples(st.integers(0, 9), st.integers(1, 10)), min_size=1, max_size=3),
    )
)
def test_coverage_sweep_counts_the_holders_of_each_layer(
    raw: dict[str, list[tuple[int, int]]],
) -> None:
    held = {w: merge(ivs) for w, ivs in raw.items()}
    spans = [(a, b, w) for w, ivs in held.items() for a, b in ivs]
    counts, sole = spans_coverage(spans, 10)
    for layer in range(10):
        holders = {w for w, ivs in held.items() if any(a <= layer < b for a, b in ivs)}
        assert counts[layer] == len(holders)
        assert sole[layer] == (next(iter(holders)) if len(holders) == 1 else None)
    # The counts alone (lost layers) and the sole holders alone (the risk) agree with it.
    assert holder_counts(held, 10) == counts
    assert sole_holders(spans, 10) == set(sole) - {None}
    out = set(list(held)[::2])
    assert (
        holder_counts(held, 10, out)
        == spans_coverage([(a, b, w) for a, b, w in spans if w not in out], 10)[0]
    )


# What the planner decides for this fault (the reroute as before its fast paths).
# The dynamic candidate is the uniform layout of 546 pipelines of 15 stages (core.layouttime):
# 4.2531 s a step as a plan, where the search's optimum by its objective (545 pipelines, two
# splits of 15 stages, one of 14 and one of 17) stepped 4.7311 s and lost to the reroute.
BEFORE = {
    "plans_considered": 294543,
    "reroute": (4.394756061439995, 10.0, 931.6023044998017, 79121350656, 512),
    "dynamic": (4.2531173462845375, 20.38757639584, 962.1786305868508, 78920024064, 546),
}


def test_the_8192_device_decision_is_the_one_made_before_cold_or_warm() -> None:
    spec = load_spec(EXAMPLE)
    current = initial_plan(spec, generation=1)
    failed = ["w4913", "w6678"]
    forget_tables()
    cold = decide(spec, current, failed, mtbf_seconds=spec.mtbf_prior_seconds, generation=2)
    warm = decide(spec, current, failed, mtbf_seconds=spec.mtbf_prior_seconds, generation=2)
    for d in (cold, warm):
        assert d.selected == "dynamic" and d.plans_considered == BEFORE["plans_considered"]
        for c in d.candidates[:2]:
            assert c.plan is not None
            step, transition, score, peak, pipelines = BEFORE[c.policy.value]
            assert (c.step_seconds, c.transition_seconds, c.score) == (step, transition, score)
            assert c.peak_memory_bytes == peak and len(c.plan.pipelines) == pipelines
            assert c.at_risk == 0.0
    # Kept tables change nothing: every candidate's whole plan is the same.
    for a, b in zip(cold.candidates, warm.candidates, strict=True):
        assert (a.plan is None) == (b.plan is None)
        if a.plan is not None and b.plan is not None:
            assert plan_to_dict(a.plan) == plan_to_dict(b.plan)
    survivors = [w.id for w in spec.workers if w.id not in failed]
    found = search(spec, survivors)
    assert found.optimum is not None and found.optimum.seconds == 4.102526135189453
    assert found.layout is not None and found.layout.seconds == 4.102545713324536
    assert len(found.layout.shape) == 546 and len(set(found.layout.shape)) == 1


def test_prepared_tables_leave_a_fault_no_shape_to_time_and_change_no_decision() -> None:
    # The daemon prepares between faults (core.decide.prepare) for the loss of the plan's last
    # host: the search after any host's loss, or one, two or four workers', then times no
    # pipeline shape. Its start-up (the initial plan) leaves them to the first fault.
    spec = load_spec(EXAMPLE)
    current = initial_plan(spec, generation=1)
    ids = [w.id for w in spec.workers]
    faults = (
        [w.id for w in spec.workers if w.host == "h300"],
        ["w77"],
        ["w4913", "w6678"],
        ["w3", "w9", "w2730", "w4096"],
    )
    for failed in faults:
        survivors = [w for w in ids if w not in failed]
        forget_tables()
        initial_plan(spec, generation=1)
        assert search(spec, survivors).shapes_timed > 0
        forget_tables()
        prepare(spec, current)
        forget_results()  # the tables alone
        assert search(spec, survivors).shapes_timed == 0
    failed = faults[2]
    forget_tables()
    cold = decide(spec, current, failed, mtbf_seconds=spec.mtbf_prior_seconds, generation=2)
    forget_tables()
    prepare(spec, current)
    prepared = decide(spec, current, failed, mtbf_seconds=spec.mtbf_prior_seconds, generation=2)
    assert prepared.selected == cold.selected == "dynamic"
    for a, b in zip(cold.candidates, prepared.candidates, strict=True):
        assert a == b or (a.plan is not None and b.plan is not None
                          and plan_to_dict(a.plan) == plan_to_dict(b.plan))  # fmt: skip


def test_prepared_results_are_the_searches_of_those_faults() -> None:
    # `prepare` also keeps the results of those searches: a fault of as many workers finds its
    # search done, and it is the search the fault would have run.
    spec = load_spec(EXAMPLE)
    current = initial_plan(spec, generation=1)
    ids = [w.id for w in spec.workers]
    forget_tables()
    prepare(spec, current)
    host = [w.id for w in spec.workers if w.host == "h300"]
    for failed in (host, ["w77"], ["w4913", "w6678"], ["w3", "w9", "w2730", "w4096"]):
        survivors = [w for w in ids if w not in failed]
        kept = search(spec, survivors)
        assert kept.shapes_timed == 0
        forget_results()
        assert search(spec, survivors) == kept
        prepare(spec, current)


def test_worker_lookups_follow_the_specs_workers() -> None:
    # The daemon replaces a slow worker's speed in a new spec: the lookups kept for the old
    # spec must not price the new one.
    spec = load_spec(EXAMPLE.parent / "gpt-32.toml")
    slowed = spec.workers[3].id
    slow = dataclasses.replace(
        spec,
        workers=tuple(
            dataclasses.replace(w, speed=0.5) if w.id == slowed else w for w in spec.workers
        ),
    )
    assert list(roster(spec).order) == [w.id for w in spec.workers]
    assert roster(spec) is roster(spec)
    assert roster(spec).speed[slowed] == 1.0 and roster(slow).speed[slowed] == 0.5
    fast_step = initial_plan(spec).estimates.step_seconds
    assert initial_plan(slow).estimates.step_seconds > fast_step
    assert initial_plan(spec).estimates.step_seconds == fast_step
