"""The restorer: optimal assignment, a manifest that sends each missing layer once from a holder,
conflict-free rounds, and sync groups that cover every layer's surviving owners."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.core.colouring import (
    conflict_graph,
    dsatur,
    first_fit_decreasing,
    rounds,
    schedule_seconds,
    weighted_rounds,
)
from chameleond.core.holdings import of_plan
from chameleond.core.plan import Estimates, Pipeline, Plan, Stage
from chameleond.core.restorer import (
    LostLayers,
    RestoreError,
    _cost_matrix,
    assign,
    layer_ranges,
    match_slots,
    min_cost_assignment,
    sync_groups,
)
from chameleond.core.spec import JobSpec, parse_spec

Shape = list[list[tuple[int, int]]]


def make_spec(hosts: Sequence[str], layer_bytes: Sequence[int], micro_batches: int = 64) -> JobSpec:
    return parse_spec(
        {
            "workers": [
                {"id": f"w{i}", "host": h, "memory_bytes": 1 << 40} for i, h in enumerate(hosts)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_second": 100.0, "latency_seconds": 0.01},
                "inter_host": {"bandwidth_bytes_per_second": 10.0, "latency_seconds": 0.1},
            },
            "model": {
                "layers": [
                    {
                        "forward_seconds": 0.01,
                        "backward_seconds": 0.02,
                        "param_bytes": b,
                        "optimizer_bytes": 2 * b,
                        "activation_bytes": 1,
                        "output_bytes": 1,
                    }
                    for b in layer_bytes
                ]
            },
            "training": {"global_batch": micro_batches, "micro_batch": 1},
            # The spec's own layout is not used here: each test passes its current plan.
            "plan": {"pipelines": [[f"w{i}"] for i in range(len(hosts))]},
        }
    )


def make_plan(
    spec: JobSpec, owners: Sequence[Sequence[tuple[str, int, int]]], excluded: Sequence[str] = ()
) -> Plan:
    """A current plan whose pipelines are `owners[p] = [(worker, first, end), ...]`."""
    per = spec.training.micro_batches // len(owners)
    pipes = tuple(
        Pipeline(tuple(Stage(w, a, b) for w, a, b in stages), p * per, per)
        for p, stages in enumerate(owners)
    )
    return Plan(
        spec.name, 1, "initial", spec.training.global_batch, 1, pipes, (), (), (),
        Estimates(1.0, 0.0, 0.0, 1.0), excluded=tuple(excluded),
    )  # fmt: skip


def split(n_layers: int, cuts: Sequence[int]) -> list[tuple[int, int]]:
    edges = [0, *sorted(cuts), n_layers]
    return list(itertools.pairwise(edges))


# --- the published example ------------------------------------------------------------------------

PUBLISHED = [[0, 1, 2, 3], [2, 1, 0, 3], [2, 2, 2, 0], [2, 2, 2, 3]]


def test_published_matrix_has_optimum_two() -> None:
    pairs, total = min_cost_assignment(PUBLISHED)
    assert total == 2
    assert sorted(c for _, c in pairs) == [0, 1, 2, 3]
    assert sum(PUBLISHED[r][c] for r, c in pairs) == 2


def test_published_example_through_assign() -> None:
    # Nodes hold layers (1,2,3), (4,5,6), (7,8,9) (0-based here) and one node comes in empty; the
    # new pipeline has four stages {1,2} {3,4} {5,6} {7,8,9}: exactly the published matrix.
    spec = make_spec(["h0"] * 4, [1] * 9, micro_batches=4)
    current = make_plan(spec, [[("w0", 0, 3), ("w1", 3, 6), ("w2", 6, 9)]], excluded=["w3"])
    shape = [[(0, 2), (2, 4), (4, 6), (6, 9)]]
    survivors = ["w0", "w1", "w2", "w3"]
    slots = [(0, s, a, b) for s, (a, b) in enumerate(shape[0])]
    held = of_plan(current, set(survivors))
    costs = _cost_matrix(survivors, held, slots, np.array([3] * 9, np.int64)) // 3
    assert costs.tolist() == PUBLISHED
    r = assign(spec, current, shape, [4], survivors)
    assert r.moved_bytes == 2 * 3  # two layers, each 1 byte of parameters + 2 of optimizer state
    assert [st.worker for st in r.pipelines[0].stages] == ["w0", "w3", "w1", "w2"]
    assert {(t.src, t.dst, t.layers) for t in r.migration} == {
        ("w0", "w3", (2,)),
        ("w1", "w3", (3,)),
    }
    # Both transfers go to w3, so they are in different rounds.
    assert sorted(t.round for t in r.migration) == [0, 1]
    assert r.migration_seconds == pytest.approx(2 * (0.01 + 3 / 100.0))
    # Plain Python values only: the plan is published as JSON.
    assert json.loads(json.dumps(dataclasses.asdict(r)))["moved_bytes"] == 6


# --- property tests on random small instances -----------------------------------------------------


@dataclass
class Instance:
    spec: JobSpec
    current: Plan
    survivors: list[str]
    shape: Shape
    micro_batches: list[int]


@st.composite
def instances(draw: st.DrawFn) -> Instance:
    n_layers = draw(st.integers(2, 7))
    layer_bytes = draw(st.lists(st.integers(0, 50), min_size=n_layers, max_size=n_layers))
    n_current = draw(st.integers(1, 6))
    n_spare = draw(st.integers(0, 2))
    hosts = draw(st.lists(st.sampled_from(["h0", "h1"]), min_size=n_current + n_spare,
                          max_size=n_current + n_spare))  # fmt: skip
    spec = make_spec(hosts, layer_bytes, micro_batches=64)
    ids = [w.id for w in spec.workers]
    # The current plan: the first n_current workers in pipelines of random length and split.
    lengths = draw(st.lists(st.integers(1, n_layers), min_size=1, max_size=n_current))
    owners, i = [], 0
    for n in lengths:
        n = min(n, n_current - i)
        if n == 0:
            break
        cuts = draw(st.lists(st.integers(1, n_layers - 1), min_size=n - 1, max_size=n - 1,
                             unique=True)) if n > 1 else []  # fmt: skip
        owners.append([(ids[i + s], a, b) for s, (a, b) in enumerate(split(n_layers, cuts))])
        i += n
    in_plan = [w for stages in owners for w, _, _ in stages]
    spares = [w for w in ids if w not in in_plan]
    failed = draw(st.lists(st.sampled_from(in_plan), unique=True, max_size=len(in_plan) - 1))
    current = make_plan(spec, owners, excluded=spares)
    survivors = [w for w in ids if w not in failed]
    # The new shape: the survivors in pipelines of random length and split.
    shape: Shape = []
    left = len(survivors)
    while left:
        n = draw(st.integers(1, min(left, n_layers)))
        cuts = draw(st.lists(st.integers(1, n_layers - 1), min_size=n - 1, max_size=n - 1,
                             unique=True)) if n > 1 else []  # fmt: skip
        shape.append(split(n_layers, cuts))
        left -= n
    mbs = [64 // len(shape)] * len(shape)
    mbs[0] += 64 - sum(mbs)
    order = draw(st.permutations(survivors))
    return Instance(spec, current, list(order), shape, mbs)


def held_layers(inst: Instance) -> dict[str, set[int]]:
    alive = set(inst.survivors)
    out: dict[str, set[int]] = {w: set() for w in inst.survivors}
    for pipe in inst.current.pipelines:
        for s in pipe.stages:
            if s.worker in alive and s.worker not in inst.current.excluded:
                out[s.worker].update(s.layers)
    return out


def layer_cost(spec: JobSpec, layer: int) -> int:
    return spec.layers[layer].param_bytes + spec.layers[layer].optimizer_bytes


@settings(max_examples=150, deadline=None)
@given(instances())
def test_assignment_is_optimal_and_manifest_is_exact(inst: Instance) -> None:
    held = held_layers(inst)
    n_layers = len(inst.spec.layers)
    lost = [
        layer
        for layer in range(n_layers)
        if layer_cost(inst.spec, layer) > 0 and not any(layer in h for h in held.values())
    ]
    if lost:
        with pytest.raises(LostLayers) as e:
            assign(inst.spec, inst.current, inst.shape, inst.micro_batches, inst.survivors)
        assert e.value.layers == tuple(lost)
        return
    r = assign(inst.spec, inst.current, inst.shape, inst.micro_batches, inst.survivors)

    # Every survivor in exactly one slot, the shape and micro-batch ranges as asked.
    slots = [(p, s) for p, pipe in enumerate(r.pipelines) for s, _ in enumerate(pipe.stages)]
    workers = [st.worker for pipe in r.pipelines for st in pipe.stages]
    assert sorted(workers) == sorted(inst.survivors)
    assert [[(s.first_layer, s.end_layer) for s in p.stages] for p in r.pipelines] == inst.shape
    assert [p.micro_batches for p in r.pipelines] == inst.micro_batches
    assert [p.first_micro_batch for p in r.pipelines] == [
        sum(inst.micro_batches[:i]) for i in range(len(inst.micro_batches))
    ]

    # Optimal: no permutation of survivors over slots moves fewer bytes.
    def missing(w: str, a: int, b: int) -> int:
        return sum(layer_cost(inst.spec, x) for x in range(a, b) if x not in held[w])

    ranges = [(st.first_layer, st.end_layer) for pipe in r.pipelines for st in pipe.stages]
    best = min(
        sum(missing(w, a, b) for w, (a, b) in zip(perm, ranges, strict=True))
        for perm in itertools.permutations(inst.survivors)
    )
    assert len(slots) == len(inst.survivors)
    assert r.moved_bytes == best

    # Every missing layer with state is sent exactly once to its new owner, from a holder.
    sent: dict[tuple[str, int], int] = {}
    for t in r.migration:
        assert t.nbytes == sum(layer_cost(inst.spec, x) for x in t.layers)
        for x in t.layers:
            assert x in held[t.src], f"{t.src} does not hold layer {x}"
            sent[(t.dst, x)] = sent.get((t.dst, x), 0) + 1
    needed = {
        (st.worker, x)
        for pipe in r.pipelines
        for st in pipe.stages
        for x in st.layers
        if x not in held[st.worker] and layer_cost(inst.spec, x) > 0
    }
    assert set(sent) >= needed
    assert all(n == 1 for n in sent.values())
    assert all(inst.spec.layers[x].param_bytes == 0 for (_, x) in set(sent) - needed)

    # Rounds: no worker in two transfers of one round; time = sum of each round's slowest, or
    # of what its busiest host interface carries across hosts, whichever is longer.
    by_round: dict[int, list[str]] = {}
    for t in r.migration:
        by_round.setdefault(t.round, []).extend((t.src, t.dst))
    for ws in by_round.values():
        assert len(ws) == len(set(ws))
    host = {w.id: w.host for w in inst.spec.workers}
    nic = inst.spec.inter_host.bandwidth_bytes_per_second

    def interface(k: int) -> float:
        through: dict[tuple[str, str], int] = {}
        for t in r.migration:
            if t.round == k and host[t.src] != host[t.dst]:
                through[(host[t.src], "out")] = through.get((host[t.src], "out"), 0) + t.nbytes
                through[(host[t.dst], "in")] = through.get((host[t.dst], "in"), 0) + t.nbytes
        return max(through.values(), default=0) / nic

    slowest = {
        k: max(
            interface(k),
            *(inst.spec.link(t.src, t.dst).transfer_seconds(t.nbytes)
              for t in r.migration if t.round == k),
        )
        for k in by_round
    }  # fmt: skip
    assert r.migration_seconds == pytest.approx(sum(slowest.values()))

    # Deterministic: the caller's survivor order does not change the plan.
    again = assign(inst.spec, inst.current, inst.shape, inst.micro_batches, sorted(inst.survivors))
    assert again == r


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_matching_over_classes_equals_the_full_matching(data: st.DataObject) -> None:
    # Survivors drawn from a few holdings and slots from a few ranges, with repeats: the flow over
    # classes and linear_sum_assignment on the full matrix must reach the same optimum.
    n_layers = data.draw(st.integers(2, 8))
    layer_bytes = np.array(
        data.draw(st.lists(st.integers(0, 40), min_size=n_layers, max_size=n_layers)), np.int64
    )
    interval = st.tuples(st.integers(0, n_layers - 1), st.integers(1, n_layers)).filter(
        lambda ab: ab[0] < ab[1]
    )
    holdings_pool = data.draw(st.lists(st.lists(interval, max_size=1), min_size=1, max_size=4))
    ranges_pool = data.draw(st.lists(interval, min_size=1, max_size=4))
    n = data.draw(st.integers(1, 12))
    rows = [f"w{i}" for i in range(n)]
    held = {w: data.draw(st.sampled_from(holdings_pool)) for w in rows}
    slots = [(0, j, *data.draw(st.sampled_from(ranges_pool))) for j in range(n)]
    full = match_slots(rows, held, slots, layer_bytes, by_class=False)
    classes = match_slots(rows, held, slots, layer_bytes, by_class=True)
    assert sorted(full) == sorted(classes) == list(range(n))
    cost = _cost_matrix(rows, held, slots, layer_bytes)
    assert sum(cost[r, j] for j, r in enumerate(classes)) == sum(
        cost[r, j] for j, r in enumerate(full)
    )


def test_sources_prefer_the_same_host_and_spread_load() -> None:
    # Two pipelines x 2 stages on hosts h0 (w0, w1, w4) and h1 (w2, w3, w5). w0 and w2 hold
    # layers 0-1, w1 and w3 hold 2-3. The new plan has three pipelines of two stages: the two
    # newcomers w4 (h0) and w5 (h1) must each fetch one half from a holder on their own host.
    hosts = ["h0", "h0", "h1", "h1", "h0", "h1"]
    spec = make_spec(hosts, [10] * 4, micro_batches=6)
    current = make_plan(
        spec,
        [[("w0", 0, 2), ("w1", 2, 4)], [("w2", 0, 2), ("w3", 2, 4)]],
        excluded=["w4", "w5"],
    )
    r = assign(spec, current, [[(0, 2), (2, 4)]] * 3, [2, 2, 2], [f"w{i}" for i in range(6)])
    assert r.moved_bytes == 2 * 2 * 30
    for t in r.migration:
        assert spec.worker(t.src).host == spec.worker(t.dst).host
    assert len({t.src for t in r.migration}) == 2  # one transfer each, not both from one source


def test_lost_layers_name_the_layers() -> None:
    spec = make_spec(["h0"] * 4, [1] * 8, micro_batches=4)
    current = make_plan(spec, [[("w0", 0, 4), ("w1", 4, 8)], [("w2", 0, 4), ("w3", 4, 8)]])
    with pytest.raises(LostLayers, match="layers 4-7 lost every replica") as e:
        assign(spec, current, [[(0, 4), (4, 8)]], [4], ["w0", "w2"])
    assert e.value.layers == (4, 5, 6, 7)
    assert layer_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3, 7, 9-10"


def test_a_stateless_layer_without_holders_is_not_lost() -> None:
    # Layer 3 has no parameters or optimizer state: losing its only owner loses nothing.
    spec = make_spec(["h0"] * 3, [1, 1, 1, 0], micro_batches=4)
    current = make_plan(spec, [[("w0", 0, 3), ("w1", 3, 4)]], excluded=["w2"])
    r = assign(spec, current, [[(0, 2), (2, 4)]], [4], ["w0", "w2"])
    assert r.moved_bytes == 3 and [(t.src, t.dst, t.layers) for t in r.migration] == [
        ("w0", "w2", (2,))
    ]


@pytest.mark.parametrize(
    ("shape", "mbs", "survivors", "message"),
    [
        ([[(0, 2), (3, 4)]], [4], ["w0", "w1"], "contiguous"),
        ([[(0, 2), (2, 3)]], [4], ["w0", "w1"], "cover"),
        ([[(0, 2), (2, 4)]], [3], ["w0", "w1"], "sum 3"),
        ([[(0, 2), (2, 4)]], [4, 0], ["w0", "w1"], "2 entries for 1 pipelines"),
        ([[(0, 2), (2, 4)]], [4], ["w0"], "1 survivors for 2 slots"),
        ([[(0, 2), (2, 4)]], [4], ["w0", "w0"], "listed twice"),
        ([[(0, 2), (2, 4)]], [4], ["w0", "x9"], "x9 not workers"),
        ([], [], [], "at least one pipeline"),
    ],
)
def test_bad_input_is_a_clear_error(
    shape: Shape, mbs: list[int], survivors: list[str], message: str
) -> None:
    spec = make_spec(["h0"] * 4, [1] * 4, micro_batches=4)
    current = make_plan(spec, [[("w0", 0, 2), ("w1", 2, 4)], [("w2", 0, 2), ("w3", 2, 4)]])
    with pytest.raises(RestoreError, match=message):
        assign(spec, current, shape, mbs, survivors)
    with pytest.raises(RestoreError, match="square"):
        min_cost_assignment([[1, 2, 3]])


def test_unchanged_layout_moves_nothing() -> None:
    spec = make_spec(["h0", "h0", "h1", "h1"], [5] * 6, micro_batches=8)
    owners = [[("w0", 0, 3), ("w1", 3, 6)], [("w2", 0, 3), ("w3", 3, 6)]]
    current = make_plan(spec, owners)
    r = assign(spec, current, [[(0, 3), (3, 6)]] * 2, [4, 4], ["w3", "w2", "w1", "w0"])
    assert r.migration == () and r.moved_bytes == 0 and r.migration_seconds == 0.0
    assert r.pipelines == current.pipelines


# --- sync groups ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_sync_groups_cover_surviving_owners_in_disjoint_rounds(data: st.DataObject) -> None:
    n_layers = data.draw(st.integers(1, 10))
    n_pipes = data.draw(st.integers(1, 5))
    pipes, w = [], 0
    for p in range(n_pipes):
        n = data.draw(st.integers(1, n_layers))
        cuts = data.draw(st.lists(st.integers(1, n_layers - 1), min_size=n - 1, max_size=n - 1,
                                  unique=True)) if n > 1 else []  # fmt: skip
        # Some workers own two stages (a rejoin or a squeeze can do that), of one pipeline or of
        # two: exercise merging and their groups' conflicts.
        stages: list[Stage] = []
        for a, b in split(n_layers, cuts):
            share = data.draw(st.sampled_from(["own", "previous", "other"]))
            others = sorted({s.worker for q in pipes for s in q.stages})
            if stages and share == "previous":
                stages.append(Stage(stages[-1].worker, a, b))
            elif others and share == "other":
                stages.append(Stage(data.draw(st.sampled_from(others)), a, b))
            else:
                stages.append(Stage(f"w{w}", a, b))
                w += 1
        pipes.append(Pipeline(tuple(stages), p, 1))
    everyone = sorted({s.worker for p in pipes for s in p.stages})
    excluded = set(data.draw(st.lists(st.sampled_from(everyone), unique=True)))
    groups = sync_groups(pipes, excluded)

    for layer in range(n_layers):
        owners = {s.worker for p in pipes for s in p.stages if layer in s.layers} - excluded
        holding = [g for g in groups if layer in g.layers]
        if owners:
            assert len(holding) == 1 and set(holding[0].workers) == owners
        else:
            assert holding == []
    for g in groups:
        assert list(g.workers) == sorted(set(g.workers)) and list(g.layers) == sorted(g.layers)
    keys = [g.workers for g in groups]
    assert len(keys) == len(set(keys))  # identical owner sets are merged
    for k in {g.round for g in groups}:
        members = [x for g in groups if g.round == k for x in g.workers]
        assert len(members) == len(set(members))
    # The rounds are DSATUR's over the groups' conflicts (groups sharing a worker).
    assert [g.round for g in groups] == rounds([g.workers for g in groups])
    assert sync_groups(list(reversed(pipes)), excluded) == groups


def test_symmetric_layout_syncs_in_one_round() -> None:
    pipes = [Pipeline((Stage(f"a{p}", 0, 2), Stage(f"b{p}", 2, 5)), p, 1) for p in range(3)]
    groups = sync_groups(pipes, excluded={"b1"})
    assert [(g.workers, g.layers, g.round) for g in groups] == [
        (("a0", "a1", "a2"), (0, 1), 0),
        (("b0", "b2"), (2, 3, 4), 0),
    ]


def test_asymmetric_layout_needs_rounds() -> None:
    # Pipeline 0 splits at layer 2, pipeline 1 at layer 1: x0 holds 0-1 and meets y0 at layer 0 and
    # y1 at layer 1, so its two groups go to two rounds.
    pipes = [
        Pipeline((Stage("x0", 0, 2), Stage("x1", 2, 4)), 0, 1),
        Pipeline((Stage("y0", 0, 1), Stage("y1", 1, 4)), 1, 1),
    ]
    groups = sync_groups(pipes, excluded=())
    assert [(g.workers, g.layers) for g in groups] == [
        (("x0", "y0"), (0,)),
        (("x0", "y1"), (1,)),
        (("x1", "y1"), (2, 3)),
    ]
    assert groups[0].round != groups[1].round != groups[2].round


# --- colouring ------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 40), st.floats(0.0, 0.6), st.integers(0, 2**32 - 1))
def test_dsatur_matches_networkx(n: int, density: float, seed: int) -> None:
    rng = random.Random(seed)
    edges = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < density]
    g = nx.Graph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    ours = dsatur([set(g[v]) for v in range(n)])
    theirs = nx.greedy_color(g, strategy="DSATUR") if n else {}
    assert ours == [theirs[v] for v in range(n)]
    for u, v in edges:
        assert ours[u] != ours[v]


def test_conflict_graph_links_items_sharing_a_member() -> None:
    adj = conflict_graph([("a", "b"), ("b", "c"), ("d", "e"), ("a",)])
    assert adj == [{1, 3}, {0}, set(), {0}]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, 12), st.sampled_from([0.5, 1.0, 4.0, 9.0])),
        max_size=40,
    )
)
def test_weighted_rounds_are_valid_and_no_longer_than_either(
    items: list[tuple[int, int, float]],
) -> None:
    members = [(a, b) for a, b, _ in items]
    seconds = [s for _, _, s in items]
    ffd = first_fit_decreasing(members, seconds)
    colour, total = weighted_rounds(members, seconds)
    for col in (ffd, colour):
        for i, j in itertools.combinations(range(len(items)), 2):
            if set(members[i]) & set(members[j]):
                assert col[i] != col[j]
    assert total == schedule_seconds(colour, seconds)
    assert total <= min(schedule_seconds(ffd, seconds), schedule_seconds(rounds(members), seconds))
