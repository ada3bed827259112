"""The plan in the form the workers read (chameleond/core/plancompact.py, protocol.packed_plan):
the same document, its signature still good, and a fraction of the bytes every worker reads."""

from __future__ import annotations

import json
import secrets
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.auth import Keyring, signed_document
from chameleond.core.decide import decide, initial_plan
from chameleond.core.plan import PlanError, plan_from_dict, plan_to_dict
from chameleond.core.plancompact import FORM, compact, expand, names, runs
from chameleond.core.policy import Policy
from chameleond.core.spec import load_spec
from chameleond.protocol import packed_plan, unpacked_plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _json(doc: Any) -> Any:
    return json.loads(json.dumps(doc))  # as a reader parses it


def _plans() -> dict[str, dict[str, Any]]:
    spec = load_spec(EXAMPLES / "cluster-1024.toml")
    before = initial_plan(spec)
    out = {"initial": _json(plan_to_dict(before))}
    for policy in (Policy.REROUTE, Policy.DYNAMIC, Policy.DROP):
        d = decide(spec, before, list(before.workers[8:10]), mtbf_seconds=3600.0, generation=2,
                   force=policy)  # fmt: skip
        assert d.plan is not None
        out[policy.value] = _json(plan_to_dict(d.plan))
    return out


PLANS = _plans()


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_compact_plan_expands_to_the_plan_and_its_signature_verifies(name: str) -> None:
    keyring = Keyring((secrets.token_bytes(32),))
    _, doc = signed_document(keyring, "plan", "job", PLANS[name])
    doc = _json(doc)
    raw = packed_plan(doc)
    read = unpacked_plan(raw)
    assert read == doc
    keyring.verify_doc("plan", "job", read)  # made over the whole document: it still holds
    assert plan_from_dict(read) == plan_from_dict(doc)
    whole = len(zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 6))
    assert len(raw) * 2 < whole  # the repeats are what most of the plan is


def test_what_the_pipelines_say_is_left_out() -> None:
    dyn = compact(PLANS["dynamic"])
    assert dyn["form"] == FORM and "routing" not in dyn and dyn["routing_except"] == []
    assert all("workers" not in g for g in dyn["sync_groups"])
    stages = sum(len(p["stages"]) for p in PLANS["dynamic"]["pipelines"])
    peaks = dyn["estimates"]
    assert peaks["peak_memory_bytes"] == {} and len(peaks["stage_peak_memory_bytes"]) == stages
    # The workers' names: a few runs, and the migration's workers are places among them.
    assert len(dyn["owners"]) < stages and names(dyn["owners"]) == [
        st["worker"] for p in PLANS["dynamic"]["pipelines"] for st in p["stages"]
    ]
    assert PLANS["dynamic"]["migration"] and all(
        isinstance(t[0], int) and isinstance(t[1], int) for t in dyn["migration"]
    )
    # A rerouting plan's slots that survivors run are kept, and only those; its sync groups
    # leave out its excluded workers, and still need no list.
    doc = PLANS["reroute"]
    rerouted = compact(doc)["routing_except"]
    assert rerouted
    for p, s, row in rerouted:
        assert doc["routing"][p][s] == row
        assert set(row) != {doc["pipelines"][p]["stages"][s]["worker"]}
    assert all("workers" not in g for g in compact(doc)["sync_groups"])


def test_what_the_pipelines_do_not_say_is_kept() -> None:
    doc = _json(PLANS["dynamic"])
    group = doc["sync_groups"][0]
    group["workers"] = group["workers"][1:]  # not its layers' owners: kept as it is
    doc["estimates"]["peak_memory_bytes"]["standby-1"] = 7  # a worker with no stage
    made = compact(doc)
    assert made["sync_groups"][0]["workers"] == group["workers"]
    assert made["estimates"]["peak_memory_bytes"] == {"standby-1": 7}
    assert expand(_json(made)) == doc
    # A plan without the pipelines' shape is not compacted: its readers refuse it whole.
    broken = {**doc, "routing": doc["routing"][1:]}
    assert compact(broken) == broken


def test_a_plan_packed_whole_reads_as_it_is_and_a_broken_compact_one_is_refused() -> None:
    doc = PLANS["reroute"]
    assert unpacked_plan(zlib.compress(json.dumps(doc).encode())) == doc
    made = _json(compact(doc))
    for broken in (
        {**made, "routing_except": [[10**6, 0, ["w0"]]]},
        {**made, "routing_except": [[-1, 0, ["w0"]]]},  # not a place from the end
        {**made, "owners": made["owners"][1:]},
        {**made, "migration": [[0, -1, [0], 1, 0]]},
        {k: v for k, v in made.items() if k != "routing_except"},
        {**made, "estimates": {**made["estimates"], "stage_peak_memory_bytes": [[1]]}},
        {**made, "sync_groups": [{"round": 0}]},
        # A few bytes that would expand past any plan: refused before anything is built.
        {**made, "owners": [["w", 0, 10**12]]},
        {**made, "pipelines": [[0, 10**12, made["pipelines"][0][2]], *made["pipelines"][1:]]},
    ):
        with pytest.raises(PlanError, match="does not expand"):
            unpacked_plan(zlib.compress(json.dumps(broken).encode()))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["w0", "w1", "w2", "w10", "w007", "w", "", "7", "08", "h1-0",
                                 "h1-1", "x\u0661", "w3"]), max_size=12))  # fmt: skip
def test_any_names_are_their_runs(seq: list[str]) -> None:
    made = runs(seq)
    assert names(json.loads(json.dumps(made))) == seq
    assert len(made) <= len(seq)


def _small() -> dict[str, Any]:
    spec = load_spec(EXAMPLES / "cluster-1024.toml")
    before = initial_plan(spec)
    d = decide(spec, before, list(before.workers[8:10]), mtbf_seconds=3600.0, generation=2,
               force=Policy.REROUTE)  # fmt: skip
    assert d.plan is not None
    doc = _json(plan_to_dict(d.plan))
    # Four pipelines, their routing and sync groups; the migration made up from their workers.
    doc["pipelines"], doc["routing"] = doc["pipelines"][:4], doc["routing"][:4]
    doc["migration"] = [{"src": "w1", "dst": "w9", "layers": [0], "nbytes": 5, "round": 0}]
    return doc


SMALL = _small()


def _mutate(doc: dict[str, Any], k: int) -> None:
    """One of the changes a document the daemon did not make might carry."""
    stage = doc["pipelines"][k % 4]["stages"][0]
    group = doc["sync_groups"][k % len(doc["sync_groups"])]
    moves = [
        lambda: group.pop("workers", None),
        lambda: group.update(workers=[]),
        lambda: group.update(layers=[10**6]),
        lambda: doc["migration"][0].update(src=7),
        lambda: doc["migration"][0].update(dst="nobody", src="w0"),
        lambda: doc["migration"][0].update(layers=3),
        lambda: doc.update(form="other"),
        lambda: doc.update(owners=[]),
        lambda: doc["estimates"]["peak_memory_bytes"].update({stage["worker"]: None}),
        lambda: doc["estimates"]["peak_memory_bytes"].pop(stage["worker"], None),
        lambda: doc["estimates"].update(stage_peak_memory_bytes=[1]),
        lambda: stage.update(worker="w007"),
        lambda: stage.update(note="x"),
        lambda: doc["routing"][k % 4][0].append("w3"),
        lambda: doc["routing"][k % 4].pop(),
        lambda: doc["excluded"].append(stage["worker"]),
    ]
    moves[k % len(moves)]()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**4), max_size=4))
def test_whatever_the_document_holds_it_is_made_again(changes: list[int]) -> None:
    """compact leaves out only what it can make again: any document comes back as it was (or
    is left whole), so no change to it is lost or made up."""
    doc = _json(SMALL)
    for k in changes:
        _mutate(doc, k)
    assert expand(_json(compact(doc))) == doc
