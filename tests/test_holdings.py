"""Holdings: who holds which layer, from acknowledgements and commits, not from the plan alone."""

from __future__ import annotations

import json

import pytest
from test_decide import job, violations

from chameleond.core.decide import decide, initial_plan
from chameleond.core.holdings import Checkpoints, Holdings, merge, of_plan
from chameleond.core.machine import DecisionResult, PolicyMachine
from chameleond.core.plan import PlanError, plan_from_dict, plan_to_dict


def test_merge_joins_touching_and_overlapping_intervals() -> None:
    assert merge([(4, 6), (0, 2), (2, 3), (5, 8), (9, 9)]) == [(0, 3), (4, 8)]


def test_a_receiver_holds_its_layers_once_it_acks_and_sources_keep_theirs_until_a_commit() -> None:
    h = Holdings()
    h.initial(1, {"a": [(0, 4)], "b": [(4, 8)]})
    h.published(2, {"a": [(0, 2)], "b": [(4, 8)], "c": [(2, 4)]})  # c takes layers 2-3 from a
    assert h.held == {"a": [(0, 4)], "b": [(4, 8)]}  # published: nothing moved yet
    h.ready("c", 1)  # a stale generation's ack says nothing about generation 2
    assert "c" not in h.held
    h.ready("c", 2)
    assert h.held["c"] == [(2, 4)] and h.held["a"] == [(0, 4)]  # a keeps 2-3 until the commit
    h.committed(2, out={"b"})  # b failed after the commit: it holds nothing usable
    assert h.held == {"a": [(0, 2)], "c": [(2, 4)]}
    h.published(3, {"a": [(0, 8)]})
    h.committed(2)  # a late step report of generation 2 changes nothing any more
    assert h.held == {"a": [(0, 2)], "c": [(2, 4)]}
    h.lost("c")  # c came back as a new process
    assert h.held == {"a": [(0, 2)]}
    assert Holdings.from_json(h.to_json()) == h


def test_the_machine_tracks_holdings_through_plans_acks_commits_and_rejoins() -> None:
    m = PolicyMachine()
    m.initial(1, ("a", "b"), 0.0, {"a": [(0, 8)], "b": [(0, 8)]})
    assert m.holdings.held == {"a": [(0, 8)], "b": [(0, 8)]}  # built from the seed
    m.fault("b", "power", 1.0)
    request, _ = m.next_request(1.0)
    assert request is not None
    m.decided(request, DecisionResult(2, "dynamic", ("a",), layers={"a": [(0, 8)]}), 1.1)
    m.step("a", 2, 2.0)  # generation 2 committed: b's copy is a step behind
    assert m.holdings.held == {"a": [(0, 8)]}
    m.join("b", 3.0)
    request, _ = m.next_request(3.0)
    assert request is not None and request.joined == {"b"}
    both = {"a": [(0, 4)], "b": [(4, 8)]}
    m.decided(request, DecisionResult(3, "dynamic", ("a", "b"), layers=both), 3.1)
    assert m.holdings.held == {"a": [(0, 8)]}  # b has received nothing yet
    m.ready("b", 3, 4.0)
    assert m.holdings.held == {"a": [(0, 8)], "b": [(4, 8)]}
    restored = PolicyMachine.restore(m.snapshot(), ready_timeout_seconds=30.0)
    assert restored.holdings == m.holdings
    m.step("b", 3, 5.0)
    assert m.holdings.held == both


def test_a_receiver_cut_off_from_its_only_source_leaves_the_layers_lost() -> None:
    # Two one-stage pipelines; w1 fails, w0 trains alone, w1 comes back and is planned to
    # receive the whole model from w0; w0 dies before w1 acknowledged.
    spec = job(2, 1, 8, 4)
    alone = decide(spec, initial_plan(spec), ["w1"], mtbf_seconds=1e6, generation=2,
                   force="dynamic").plan  # fmt: skip
    assert alone is not None and alone.workers == ("w0",)
    back = decide(spec, alone, [], mtbf_seconds=1e6, generation=3, joined=["w1"]).plan
    assert back is not None and any(t.src == "w0" and t.dst == "w1" for t in back.migration)
    held = of_plan(alone)  # generation 2 committed; w1 never acknowledged generation 3
    d = decide(spec, back, ["w0"], mtbf_seconds=1e6, generation=4, holdings=held)
    assert d.plan is None
    assert d.unrecoverable == "layers 0-7 lost every replica (workers w0 failed)"
    # Once w1 acknowledged generation 3 it holds the model: w0's loss is survivable.
    acked = {**held, "w1": of_plan(back)["w1"]}
    d = decide(spec, back, ["w0"], mtbf_seconds=1e6, generation=4, holdings=acked)
    assert d.plan is not None and d.plan.workers == ("w1",) and not d.plan.migration
    # What the plan's stage owners alone would claim: w1 holds the model and trains at once.
    assert decide(spec, back, ["w0"], mtbf_seconds=1e6, generation=4).plan is not None


def test_a_kept_layout_sends_its_owners_the_layers_they_never_acknowledged() -> None:
    # 4 x 2 job: w0's loss is answered with a dynamic plan; a second fault lands before any
    # receiver acknowledged it, so the receivers still hold only what the initial plan gave them.
    spec = job(4, 2, 8, 16)
    start = initial_plan(spec)
    first = decide(spec, start, ["w0"], mtbf_seconds=1e6, generation=2, force="dynamic").plan
    assert first is not None and first.migration
    source = {t.src for t in first.migration}
    second = next(w for w in first.workers if w not in source | {t.dst for t in first.migration})
    held = {w: ivs for w, ivs in of_plan(start).items() if w != "w0"}
    d = decide(spec, first, ["w0", second], mtbf_seconds=1e6, generation=3, force="reroute",
               holdings=held)  # fmt: skip
    plan = d.plan
    assert d.selected == "reroute" and plan is not None and violations(spec, plan) == []
    receives: dict[str, set[int]] = {}
    for t in plan.migration:
        assert t.src not in plan.excluded and set(t.layers) <= _layers(held[t.src])
        receives.setdefault(t.dst, set()).update(t.layers)
    for w in plan.workers:  # every running worker holds or receives each layer it executes
        assert set(plan.owned_layers(w)) <= _layers(held.get(w, [])) | receives.get(w, set())
    assert plan.estimates.transition_seconds > spec.rebuild_seconds  # the repairs take time


def _layers(intervals: list[tuple[int, int]]) -> set[int]:
    return {layer for a, b in intervals for layer in range(a, b)}


def test_the_newest_checkpoint_is_the_newest_step_whose_files_cover_every_layer() -> None:
    c = Checkpoints()
    assert c.add(4, [0, 1], 1) and c.add(4, [2, 3], 1) and not c.add(4, [1], 1)
    assert c.add(9, [0, 1], 1)  # the kill came in the middle of this round
    assert c.newest(4) == 4
    assert c.add(9, [2, 3], 1) and c.newest(4) == 9
    for step in (14, 19, 24):
        c.add(step, [0], 1)
    assert sorted(c.covered) == [9, 14, 19, 24] and not c.add(2, [0, 1, 2, 3], 1)  # KEEP newest
    c.restored(2, 14)  # restored step 14... which never covered everything: 9 is newest
    assert sorted(c.covered) == [9, 14] and c.newest(4) == 9
    assert not c.add(19, [1], 1)  # stale: written before generation 2 went back to step 14
    assert c.add(19, [1], 2)
    assert Checkpoints.from_json(json.loads(json.dumps(c.to_json()))) == c
    older_daemon = {"9": [0, 1, 2, 3]}  # the snapshot of a daemon from before restores were kept
    assert Checkpoints.from_json(older_daemon).newest(4) == 9


def test_a_lost_layer_with_a_checkpoint_is_a_restore_plan_on_the_survivors() -> None:
    spec = job(2, 2, 8, 4)  # w0, w2 hold layers 0-3; w1, w3 hold 4-7
    start = initial_plan(spec)
    lost = decide(spec, start, ["w0", "w2"], mtbf_seconds=100.0, generation=2)
    assert lost.plan is None and lost.unrecoverable is not None
    d = decide(spec, start, ["w0", "w2"], mtbf_seconds=100.0, generation=2, checkpoint_step=19)
    plan = d.plan
    assert d.selected == "restore" and d.unrecoverable is None and plan is not None
    assert plan.policy == "restore" and plan.restore_step == 19 and plan.generation == 2
    assert plan.workers == ("w1", "w3") and set(plan.excluded) == {"w0", "w2"}
    assert plan.migration == () and violations(spec, plan) == []
    assert "checkpoint of step 19" in d.note and "layers 0-3 lost" in d.note
    assert not any(c.feasible for c in d.candidates)  # neither backup-free policy is possible
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan
    # A restore plan starts from nothing held: copies count once their workers acknowledge.
    m = PolicyMachine()
    m.initial(1, start.workers, 0.0, of_plan(start))
    for w in ("w0", "w2"):
        m.fault(w, "power", 1.0)
    request, _ = m.next_request(1.0)
    assert request is not None
    m.decided(request, DecisionResult(2, "restore", plan.workers, layers=of_plan(plan)), 1.1)
    assert m.holdings.held == {}
    m.ready("w1", 2, 2.0)
    assert m.holdings.held == {"w1": of_plan(plan)["w1"]}


@pytest.mark.parametrize(
    ("policy", "restore_step", "message"),
    [("restore", None, "exactly when"), ("dynamic", 3, "exactly when"), ("restore", -1, ">= 0")],
)
def test_restore_step_goes_with_the_restore_policy(
    policy: str, restore_step: int | None, message: str
) -> None:
    spec = job(2, 2, 8, 4)
    doc = {**plan_to_dict(initial_plan(spec)), "policy": policy, "restore_step": restore_step}
    with pytest.raises(PlanError, match=message):
        plan_from_dict(doc)
