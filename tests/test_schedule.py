"""The 1F1B schedule: closed form on uniform pipelines; deadlock freedom of the per-worker order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.core.plan import Pipeline, Stage
from chameleond.core.schedule import (
    BACKWARD,
    FORWARD,
    Op,
    build_schedule,
    idle_before,
    slot_queue,
)

Routing = list[list[list[str]]]


def _grid(n_pipes: int, n_stages: int, n_micro: int) -> tuple[list[Pipeline], Routing]:
    pipes = [
        Pipeline(tuple(Stage(f"w{p}.{s}", s, s + 1) for s in range(n_stages)), p * n_micro, n_micro)
        for p in range(n_pipes)
    ]
    routing = [[[f"w{p}.{s}"] * n_micro for s in range(n_stages)] for p in range(n_pipes)]
    return pipes, routing


def test_slot_queue_is_1f1b() -> None:
    assert slot_queue(4, 0, 6) == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5),
        ("B", 2), ("B", 3), ("B", 4), ("B", 5),
    ]  # fmt: skip
    assert slot_queue(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert slot_queue(8, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@given(
    n_stages=st.integers(1, 6),
    n_micro=st.integers(1, 10),
    tf=st.floats(0.01, 5.0),
    tb=st.floats(0.01, 5.0),
)
def test_uniform_pipeline_matches_closed_form(
    n_stages: int, n_micro: int, tf: float, tb: float
) -> None:
    pipes, routing = _grid(2, n_stages, n_micro)
    sch = build_schedule(pipes, routing, lambda p, s, k, w: tf if k == FORWARD else tb, _no_comm)
    expected = (n_stages + n_micro - 1) * (tf + tb)
    assert abs(sch.makespan - expected) <= 1e-9 * max(1.0, expected)


def _no_comm(p: int, s: int, k: str, a: str, b: str) -> float:
    return 0.0


def _runs_to_completion(ops: dict[str, list[Op]]) -> bool:
    """Execute every worker's list in order: a receive blocks until the matching send happened."""
    done: set[tuple[str, int, int, int]] = set()
    pos = dict.fromkeys(ops, 0)
    progressed = True
    while progressed:
        progressed = False
        for w, lst in ops.items():
            while pos[w] < len(lst):
                op = lst[pos[w]]
                if op.kind == FORWARD and op.upstream is not None:
                    needed = (FORWARD, op.pipeline, op.stage - 1, op.micro_batch)
                else:
                    needed = (BACKWARD, op.pipeline, op.stage + 1, op.micro_batch)
                if (op.upstream if op.kind == FORWARD else op.downstream) and needed not in done:
                    break
                done.add((op.kind, op.pipeline, op.stage, op.micro_batch))
                pos[w] += 1
                progressed = True
    return all(pos[w] == len(lst) for w, lst in ops.items())


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_rerouted_order_never_deadlocks(data: st.DataObject) -> None:
    n_pipes = data.draw(st.integers(2, 4))
    n_stages = data.draw(st.integers(1, 4))
    n_micro = data.draw(st.integers(1, 6))
    pipes, routing = _grid(n_pipes, n_stages, n_micro)
    # Fail a random set of slots, leaving at least one replica per stage; route each failed
    # slot's micro-batches round-robin over the surviving peers of that stage.
    for s in range(n_stages):
        failed = data.draw(st.sets(st.integers(0, n_pipes - 1), max_size=n_pipes - 1))
        peers = [p for p in range(n_pipes) if p not in failed]
        for p in failed:
            routing[p][s] = [f"w{peers[m % len(peers)]}.{s}" for m in range(n_micro)]
    durations = data.draw(
        st.lists(st.floats(0.1, 3.0), min_size=2 * n_stages, max_size=2 * n_stages)
    )
    sch = build_schedule(
        pipes,
        routing,
        lambda p, s, k, w: durations[2 * s + (k == BACKWARD)],
        lambda p, s, k, a, b: 0.0 if a == b else 0.05,
    )
    assert _runs_to_completion(sch.ops)
    # Every (kind, pipeline, stage, micro-batch) runs exactly once, on the routed worker.
    seen = [(o.kind, o.pipeline, o.stage, o.micro_batch) for lst in sch.ops.values() for o in lst]
    assert len(seen) == len(set(seen)) == 2 * n_pipes * n_stages * n_micro
    for lst in sch.ops.values():
        for o in lst:
            local = o.micro_batch - pipes[o.pipeline].first_micro_batch
            assert o.worker == routing[o.pipeline][o.stage][local]


def test_rerouting_fills_bubbles_below_the_conservative_bound() -> None:
    n_stages, n_micro = 4, 8
    pipes, routing = _grid(2, n_stages, n_micro)
    routing[0][1] = ["w1.1"] * n_micro  # w0.1 failed: its only peer runs everything
    sch = build_schedule(pipes, routing, lambda p, s, k, w: 1.0 if k == FORWARD else 2.0, _no_comm)
    conservative = (n_stages + n_micro - 1 + n_micro * 1 / (2 - 1)) * 3.0
    failure_free = (n_stages + n_micro - 1) * 3.0
    assert failure_free < sch.makespan <= conservative


@given(n_stages=st.integers(1, 6), n_micro=st.integers(1, 10))
def test_the_bubbles_of_1f1b_are_where_each_stage_waits(n_stages: int, n_micro: int) -> None:
    """Every stage is idle (p - 1)(F + B) of a step; the last waits only at the start, for its
    first input; the first never waits at the start and finishes last."""
    tf, tb = 1.0, 2.0
    pipes, routing = _grid(1, n_stages, n_micro)
    sch = build_schedule(pipes, routing, lambda p, s, k, w: tf if k == FORWARD else tb, _no_comm)
    for s in range(n_stages):
        idle = idle_before(sch.ops[f"w0.{s}"], sch.makespan)
        assert len(idle) == len(sch.ops[f"w0.{s}"]) + 1
        assert abs(sum(idle) - (n_stages - 1) * (tf + tb)) < 1e-9
        assert abs(idle[0] - s * tf) < 1e-9  # the warm-up: waiting for the first activation
    first = idle_before(sch.ops["w0.0"], sch.makespan)
    last = idle_before(sch.ops[f"w0.{n_stages - 1}"], sch.makespan)
    assert first[-1] == 0.0  # stage 0 runs the step's last backward
    assert sum(last[1:-1]) == 0.0  # the last stage, once started, never waits mid-step
