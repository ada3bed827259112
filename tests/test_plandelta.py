"""A plan as a delta from the one before it (chameleond/core/plandelta.py): applied to its base it
makes exactly the plan published, and nothing else."""

from __future__ import annotations

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
