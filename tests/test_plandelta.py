"""A plan as a delta from the one before it (chameleond/core/plandelta.py): applied to its base it
makes exactly the plan published, and nothing else."""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.core.decide import decide, initial_plan
from chameleond.core.plan import plan_from_dict, plan_to_dict
from chameleond.core.plandelta import DeltaError, apply_delta, digest, plan_delta
from chameleond.core.policy import Policy
from chameleond.core.spec import load_spec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_a_rerouted_plan_at_1024_devices_is_a_small_delta() -> None:
    spec = load_spec(EXAMPLES / "cluster-1024.toml")
    before = initial_plan(spec)
    lost = list(before.workers[100:102])
    d = decide(spec, before, lost, mtbf_seconds=3600.0, generation=2, force=Policy.REROUTE)
    assert d.plan is not None
    old, new = plan_to_dict(before), plan_to_dict(d.plan)
    delta = plan_delta(old, new)
    made = apply_delta(old, delta)
    assert plan_from_dict(made) == d.plan and digest(made) == digest(new)
    assert old == plan_to_dict(before)  # the base is left as it was
    packed = len(zlib.compress(json.dumps(new).encode(), 1))
    assert len(zlib.compress(json.dumps(delta).encode(), 1)) * 10 < packed


def test_a_delta_applies_to_its_base_only() -> None:
    old = {"generation": 1, "excluded": [], "routing": [[1, 1], [1, 1]]}
    new = {"generation": 2, "excluded": ["w3"], "routing": [[1, 1], [2, 0]]}
    delta = plan_delta(old, new)
    assert delta["base"] == 1 and delta["generation"] == 2 and delta["digest"] == digest(new)
    assert apply_delta(old, delta) == new
    with pytest.raises(DeltaError, match="another plan"):
        apply_delta(new, delta)
    # The base's generation, but not its content (a plan written again under its number):
    other = {**old, "routing": [[1, 2], [1, 1]]}
    with pytest.raises(DeltaError, match="digest"):
        apply_delta(other, delta)
    # Changed on the way: the plan it makes is not the one published.
    tampered = {**delta, "set": [[p, ["w0"] if p == ["excluded"] else v] for p, v in delta["set"]]}
    with pytest.raises(DeltaError, match="digest"):
        apply_delta(old, tampered)
    # A caller that verifies the made plan's signature asks for no digest: it gets what the
    # delta makes, and its signature check refuses it (tests/test_worker_watcher.py).
    assert apply_delta(old, tampered, check_digest=False)["excluded"] == ["w0"]
    assert apply_delta(old, delta, check_digest=False) == new
    for broken in (
        {**delta, "set": [[["routing", 9, 0], 1]]},
        {**delta, "set": [[["routing", "x"], 1]]},
        {**delta, "del": [["nothing"]]},
        {**delta, "set": [["not a path", 1]]},
        {**delta, "set": "x"},
        {k: v for k, v in delta.items() if k != "del"},
    ):
        with pytest.raises(DeltaError):
            apply_delta(old, broken)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.text(max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=2), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(a=st.dictionaries(st.text(max_size=2), json_values, max_size=5),
       b=st.dictionaries(st.text(max_size=2), json_values, max_size=5))  # fmt: skip
def test_any_document_is_made_from_any_other(a: dict[str, Any], b: dict[str, Any]) -> None:
    a, b = {**a, "generation": 1}, {**b, "generation": 2}
    delta = json.loads(json.dumps(plan_delta(a, b)))  # as read from Redis
    assert apply_delta(a, delta) == b


def test_a_worker_out_of_a_sync_group_is_spliced_out_not_the_group_sent_again() -> None:
    spec = load_spec(EXAMPLES / "cluster-8192.toml")
    before = initial_plan(spec)
    host = before.workers[8 * 50]  # a host's first worker: the host's 8 go
    lost = [w.id for w in spec.workers if w.host == spec.worker(host).host]
    d = decide(spec, before, lost, mtbf_seconds=3600.0, generation=2, force=Policy.REROUTE)
    assert d.plan is not None
    old, new = json.loads(json.dumps(plan_to_dict(before))), plan_to_dict(d.plan)
    delta = json.loads(json.dumps(plan_delta(old, new)))
    assert plan_from_dict(apply_delta(old, delta)) == d.plan
    shrunk = [g for g in delta["splice"] if g[0][0] == "sync_groups"]
    assert shrunk and all(len(items) == 0 and stop - start == 1 for _, start, stop, items in shrunk)
    assert len(json.dumps(delta)) < 8_000  # the 512-worker groups whole: 38 KB


def test_a_splice_that_does_not_fit_its_list_is_refused() -> None:
    old = {"generation": 1, "groups": [["a", "b", "c"]]}
    new = {"generation": 2, "groups": [["a", "c"]]}
    delta = plan_delta(old, new)
    assert delta["splice"] == [[["groups", 0], 1, 2, []]] and delta["set"] == [[["generation"], 2]]
    assert apply_delta(old, delta) == new and old["groups"] == [["a", "b", "c"]]
    for broken in (
        [[["groups", 0], -1, 2, []]],
        [[["groups", 0], 1, 2, "x"]],
        [[["groups"], 0, True, []]],
        [[["generation"], 0, 1, []]],
        [[[], 0, 1, []]],
        [["groups", 1, 2, []]],
        [[["groups", 0], 1, 2]],
        "x",
    ):
        with pytest.raises(DeltaError):
            apply_delta(old, {**delta, "splice": broken})


@settings(max_examples=300, deadline=None)
@given(a=st.lists(st.sampled_from([0, 1, "1", None, [1], (1,), [0, 1]]), max_size=6),
       b=st.lists(st.sampled_from([0, 1, "1", None, [1], (1,), [0, 1]]), max_size=6))  # fmt: skip
def test_a_list_is_spliced_into_the_same_json(a: list[Any], b: list[Any]) -> None:
    old, new = {"generation": 1, "x": a}, {"generation": 2, "x": b}
    delta = json.loads(json.dumps(plan_delta(old, new)))
    assert json.dumps(apply_delta(json.loads(json.dumps(old)), delta)) == json.dumps(new)


@pytest.mark.parametrize("policy", [Policy.REROUTE, Policy.DYNAMIC, Policy.DROP])
def test_a_plans_document_is_every_field_of_it(policy: Policy) -> None:
    """plan_to_dict builds the document field by field: it is what dataclasses.asdict makes."""
    spec = load_spec(EXAMPLES / "cluster-1024.toml")
    before = initial_plan(spec)
    d = decide(spec, before, list(before.workers[8:10]), mtbf_seconds=3600.0, generation=2,
               force=policy)  # fmt: skip
    assert d.plan is not None and (policy is not Policy.DYNAMIC or d.plan.migration)
    for plan in (before, d.plan):
        reference = dataclasses.asdict(plan)
        reference["estimates"]["peak_memory_bytes"] = dict(plan.estimates.peak_memory_bytes)
        made = plan_to_dict(plan)
        assert repr(made) == repr(reference)  # the same values, types and key order
        assert plan_from_dict(json.loads(json.dumps(made))) == plan
