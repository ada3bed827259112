"""What really goes on the wire: 6 chameleon-worker processes (CPU, gloo), a real Redis, real
plans, real SIGKILL, with every point-to-point call of the real gloo process groups recorded by
tests/p2p_record/sitecustomize.py (the calls still go to gloo). Three generations: 3 x 2 stages
(1F1B), w3 killed -> rerouted (its micro-batches run on peers of other pipelines), w1 killed ->
re-partitioned with three layers migrated between one pair in one round.

Every op carries tag 0; in every generation, between any two workers, what one side sent is what
the other received, in order, call for call (shape and dtype); and the losses are those of the
failure-free single-process reference, so each message reached the op it was meant for."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from oracles.reference import reference_losses
from worker_harness import TINY_ARCH, Controller, Workers, tiny_spec, wait_until

from chameleond.redis_server import RedisServer
from chameleond.worker import _builtin as builtin
from chameleond.worker._model import Arch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RECORDER = Path(__file__).resolve().parent / "p2p_record"
IDS = [f"w{i}" for i in range(6)]
STEPS = 10
GLOBAL_BATCH, MICRO_BATCH = 12, 2
LOSS_RTOL = 1e-4  # as tests/test_worker_training.py

Call = tuple[str, int, int, tuple[int, ...], str]  # (op, own rank, peer rank, shape, dtype)


def read_calls(directory: Path) -> tuple[list[dict], dict[int, dict[str, list[Call]]]]:
    """Every recorded call, and per generation (the world group's size: 6, 5, then 4 workers)
    each worker's calls in its last group of that size (a generation built again replaces the
    earlier attempt's group)."""
    lines = [
        json.loads(x) for f in sorted(directory.glob("*.jsonl")) for x in f.read_text().splitlines()
    ]
    last: dict[tuple[int, str], int] = {}
    for c in lines:
        key = (c["size"], c["worker"])
        last[key] = max(last.get(key, -1), c["group"])
    calls: dict[int, dict[str, list[Call]]] = defaultdict(lambda: defaultdict(list))
    for c in lines:
        if c["group"] == last[(c["size"], c["worker"])]:
            call = (c["op"], c["rank"], c["peer"], tuple(c["shape"]), c["dtype"])
            calls[c["size"]][c["worker"]].append(call)
    return lines, calls


def pairs(calls: dict[str, list[Call]]) -> dict[tuple[int, int], tuple[list, list]]:
    """(sender rank, receiver rank) -> (what the sender sent, what the receiver received)."""
    out: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for seq in calls.values():
        for op, rank, peer, shape, dtype in seq:
            pair = (rank, peer) if op == "send" else (peer, rank)
            out[pair][op == "recv"].append((shape, dtype))
    return out


def test_every_p2p_call_has_tag_0_and_every_pair_matches_by_order(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    record = tmp_path / "p2p"
    record.mkdir()
    spec = tiny_spec("wire", global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH)
    controller = Controller(
        redis_server.url, spec, policy=["reroute", "dynamic"], measured=False
    ).start()
    workers = Workers(redis_server.url, "wire", tmp_path)
    path = os.pathsep.join([str(RECORDER), os.environ.get("PYTHONPATH", "")])
    env = {w: {"PYTHONPATH": path, "CHAMELEON_P2P_RECORD": str(record)} for w in IDS}
    try:
        workers.start(IDS, env, max_steps=STEPS)
        controller.wait_steps(3)
        workers.kill("w3")
        wait_until(lambda: committed_in(controller, 2) >= 2, 90, "rerouted steps")
        workers.kill("w1")
        controller.wait_steps(STEPS, timeout=150)
        last = controller.current
        assert last is not None
        wait_until(
            lambda: all(workers.procs[w].poll() is not None for w in last.workers), 30, "exit"
        )
        for w in last.workers:
            assert workers.procs[w].returncode == 0, workers.log(w)[-3000:]
    finally:
        workers.stop()
        controller.stop()
    assert not controller.errors, controller.errors
    plans = controller.record.plans
    assert [p.policy for p in plans] == ["initial", "reroute", "dynamic"]
    assert [len(p.workers) for p in plans] == [6, 5, 4]
    assert any(len(t.layers) > 1 for t in plans[2].migration), plans[2].migration

    lines, calls = read_calls(record)
    assert sorted(calls) == [4, 5, 6], sorted(calls)
    assert {c["tag"] for c in lines} == {0}, "a point-to-point op carries a tag"
    # The generation that ran to the end: every pair's sends are its peer's receives, in order.
    final = pairs(calls[4])
    assert final and all(sent == received for sent, received in final.values()), final
    migrated = {shape for sent, _ in final.values() for shape, _ in sent if len(shape) == 1}
    assert len(migrated) >= 2  # layer buffers of different sizes went between one pair
    # A killed generation's calls stop anywhere, but in one order on both sides of each pair.
    for size in (6, 5):
        for (a, b), (sent, received) in pairs(calls[size]).items():
            n = min(len(sent), len(received))
            assert sent[:n] == received[:n], (size, a, b)

    committed = controller.record.committed()
    assert sorted(committed) == list(range(STEPS))
    ref = reference_losses(
        builtin.training(Arch.from_mapping(TINY_ARCH), GLOBAL_BATCH, MICRO_BATCH), STEPS
    )
    for s in range(STEPS):
        assert abs(committed[s] - ref[s]) <= LOSS_RTOL * abs(ref[s]), (s, committed[s], ref[s])


def committed_in(controller: Controller, generation: int) -> int:
    return sum(
        1
        for e in controller.record.of("step")
        if int(e["generation"]) == generation and e["worker"] == "w0"
    )
