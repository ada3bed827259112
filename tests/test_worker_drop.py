"""A drop plan on real workers: 4 chameleon-worker processes (CPU, gloo) train 2 pipelines on a real
Redis, one is killed with SIGKILL, and the plan that answers it drops its pipeline (policy drop,
half the global batch). The kept pipeline trains on alone; a later full-B plan takes the idle
worker of the dropped pipeline back. The oracle (oracles.reference) trains the same model in one
process, each step on the micro-batches that step's plan trains.

The step gate of `chameleonctl bench worker` (chameleond.worker._gate) holds the workers at chosen
steps, so the kill and each plan land where the test says, whatever the machine's load.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from oracles.reference import reference_losses
from worker_harness import (
    TINY_ARCH,
    Controller,
    Workers,
    builtin_model,
    drop_pipelines,
    tiny_spec,
)

from chameleond.core.plan import Pipeline, Plan, Stage
from chameleond.core.policy import Policy
from chameleond.core.restorer import sync_groups
from chameleond.redis_server import RedisServer
from chameleond.worker._gate import GATE_ENV, open_gate
from chameleond.worker._samples import sample_ids, trained_micro_batches

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LOSS_RTOL = 1e-4  # as tests/test_worker_training.py: only the order of gradient sums differs
GLOBAL_BATCH, MICRO_BATCH = 8, 2
IDS = ["w0", "w1", "w2", "w3"]  # pipeline 0: w0 -> w1, pipeline 1: w2 -> w3
VICTIM, IDLE = "w1", "w0"
KILL_BEFORE, DROP_UNTIL, STEPS = 3, 6, 10


def scale_up(drop: Plan) -> Plan:
    """The full batch again: the idle worker runs micro-batches 0-1 on the whole model (one
    stage), receiving every layer from the kept pipeline's owners."""
    (kept,) = drop.pipelines
    alone = Pipeline((Stage(IDLE, 0, kept.stages[-1].end_layer),), 0, 2)
    pipelines = (alone, kept)
    return Plan(
        job=drop.job,
        generation=drop.generation + 1,
        policy=Policy.DYNAMIC,
        global_batch=GLOBAL_BATCH,
        micro_batch=MICRO_BATCH,
        pipelines=pipelines,
        routing=(((IDLE, IDLE),), *drop.routing),
        migration=(),  # the reconciliation's repair round moves the layers from their holders
        sync_groups=sync_groups(pipelines, drop.excluded),
        estimates=drop.estimates,
        excluded=drop.excluded,
        cause="scale-up",
    )


def test_a_dropped_pipeline_leaves_the_other_training_on_its_own_samples(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    open_gate(gate, 0, KILL_BEFORE)
    spec = tiny_spec(
        "drop", workers=4, stages=2, global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH
    )
    spec["training"]["min_global_batch"] = GLOBAL_BATCH // 2  # the job lets its batch shrink
    controller = Controller(
        redis_server.url, spec, policy="reroute", measured=False,
        plan_for=lambda current, failed: drop_pipelines(current, [0], failed),
    ).start()  # fmt: skip
    workers = Workers(redis_server.url, "drop", tmp_path)
    record = controller.record
    try:
        workers.start(IDS, {w: {GATE_ENV: str(gate)} for w in IDS}, max_steps=STEPS)
        controller.wait_steps(KILL_BEFORE)
        first = controller.current
        assert first is not None and first.routing == ((("w0",) * 2, ("w1",) * 2),
                                                      (("w2",) * 2, ("w3",) * 2))  # fmt: skip
        workers.kill(VICTIM)  # every worker waits at the gate before step KILL_BEFORE
        open_gate(gate, 0, DROP_UNTIL)
        controller.wait_steps(DROP_UNTIL)
        drop = controller.current
        assert drop is not None and drop.policy is Policy.DROP
        controller.wait_for(
            "the dropped pipeline's worker to wait",
            lambda: "waiting on standby" in workers.log(IDLE),
            timeout=30,
        )
        assert workers.procs[IDLE].poll() is None, workers.log(IDLE)[-3000:]
        controller.publish(scale_up(drop))
        open_gate(gate, 0, STEPS)
        controller.wait_steps(STEPS)
        controller.wait_for(
            "the last plan's workers to finish",
            lambda: all(workers.procs[w].poll() is not None for w in ("w0", "w2", "w3")),
            timeout=60,
        )
        for w in ("w0", "w2", "w3"):
            assert workers.procs[w].returncode == 0, workers.log(w)[-3000:]
        controller.wait_for(
            "the taken-back worker's last step event",
            lambda: any(
                e["worker"] == IDLE and int(e["step"]) == STEPS - 1 for e in record.of("step")
            ),
            timeout=10,
        )
    finally:
        workers.stop()
        controller.stop()

    plans = {p.generation: p for p in record.plans}
    events = record.of("step")
    step_plan = {int(e["step"]): plans[int(e["generation"])] for e in events}
    assert sorted(step_plan) == list(range(STEPS))
    policies = [step_plan[s].policy for s in range(STEPS)]
    dropped = [s for s in range(STEPS) if policies[s] is Policy.DROP]
    # Steps KILL_BEFORE .. DROP_UNTIL - 1 ran under the drop plan (the gate held the workers at
    # DROP_UNTIL until the scale-up was published; they switch after the step they are in).
    assert dropped[0] == KILL_BEFORE and dropped[-1] >= DROP_UNTIL - 1
    assert policies[-1] is Policy.DYNAMIC, policies
    # Each step event carries the samples that step trained; the kept pipeline's workers alone
    # report the dropped steps.
    for e in events:
        step = int(e["step"])
        want = GLOBAL_BATCH // 2 if step in dropped else GLOBAL_BATCH
        assert int(e["samples"]) == want, e
        if step in dropped:
            assert e["worker"] in ("w2", "w3"), e
    # No sample trained twice: the dropped steps trained micro-batches 2-3 at their job ids.
    trained = [
        i
        for s in range(STEPS)
        for g in trained_micro_batches(step_plan[s])
        for i in sample_ids(s, g, GLOBAL_BATCH, MICRO_BATCH)
    ]
    assert len(trained) == len(set(trained))
    assert all(trained_micro_batches(step_plan[s]) == [2, 3] for s in dropped)
    # The losses are the oracle's, each step trained on that step's micro-batches and divided by
    # its samples: the updates of the dropped steps are those of micro-batches 2-3 alone.
    model = builtin_model(TINY_ARCH, GLOBAL_BATCH, MICRO_BATCH)
    ref = reference_losses(model, STEPS, trained=lambda s: trained_micro_batches(step_plan[s]))
    committed = record.committed()
    worst = 0.0
    for s in range(STEPS):
        assert math.isfinite(committed[s])
        rel = abs(committed[s] - ref[s]) / abs(ref[s])
        assert rel <= LOSS_RTOL, f"step {s} ({policies[s]}): {committed[s]!r} vs {ref[s]!r}"
        worst = max(worst, rel)
    print(f"\ndrop: steps {dropped} of {STEPS} on micro-batches 2-3, worst loss error {worst:.2g}")
    # Had the dropped steps trained all four micro-batches, the losses after them would differ.
    full = reference_losses(model, STEPS)
    assert abs(full[DROP_UNTIL] - ref[DROP_UNTIL]) / abs(ref[DROP_UNTIL]) > 100 * LOSS_RTOL
