"""Restart from checkpoint (the recovery baseline): kill every worker, restart, reload, resume."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from oracles.reference import reference_losses
from worker_harness import (
    TINY_ARCH,
    EventReader,
    Record,
    Workers,
    builtin_model,
    signed_doc,
    tiny_spec,
    wait_until,
)

from chameleond.core.decide import initial_plan
from chameleond.core.plan import Plan, plan_to_dict
from chameleond.core.spec import parse_spec
from chameleond.protocol import Keys
from chameleond.redis_server import RedisServer
from chameleond.worker._model import Arch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_restart_from_checkpoint_resumes_after_the_checkpointed_step(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    spec_dict = tiny_spec("ckpt", workers=2, stages=2, global_batch=8, micro_batch=2)
    spec = parse_spec(spec_dict)
    keys = Keys("ckpt")
    redis_client.set(keys.spec, signed_doc("spec", keys.job, spec_dict))
    record = Record()
    reader = EventReader(redis_server.url, "ckpt", record)
    reader.start()
    ids = ["w0", "w1"]
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4"]
    first = Workers(redis_server.url, "ckpt", tmp_path, extra_args=args)
    second = Workers(redis_server.url, "ckpt", tmp_path, extra_args=args)

    def publish(plan: Plan) -> None:
        redis_client.set(keys.plan, signed_doc("plan", keys.job, plan_to_dict(plan)))
        redis_client.publish(keys.plans_channel, str(plan.generation))

    def profiled() -> int:
        return len(record.of("profile"))

    try:
        first.start(ids)
        wait_until(lambda: profiled() == 2, 120, "both workers profiled")
        plan = initial_plan(spec, generation=1, mtbf_seconds=3600.0)
        publish(plan)
        wait_until(lambda: len(record.committed()) >= 10, 60, "10 steps")
        for w in ids:
            first.kill(w)
        killed = time.time()
        before = dict(record.committed())
        first_run_steps = len(before)
        second.start(ids)
        wait_until(lambda: profiled() == 4, 120, "the restarted workers profiled")
        # A restarted process may resume on the plan it finds, or on the newer one published here.
        publish(replace(plan, generation=2))
        wait_until(
            lambda: max(int(e["step"]) for e in record.of("step")) >= first_run_steps + 2,
            60,
            "steps beyond the first run",
        )
    finally:
        first.stop()
        second.stop()
        reader.stop()
    after = [e for e in record.of("step") if float(e["_received"]) > killed]
    resumed = min(int(e["step"]) for e in after)
    # The checkpoint after step 7 (every 4th) or later: the job resumes right after it.
    assert resumed % 4 == 0 and 8 <= resumed <= first_run_steps
    ref = reference_losses(builtin_model(TINY_ARCH, 8, 2), max(int(e["step"]) for e in after) + 1)
    for e in after:
        s = int(e["step"])
        assert abs(float(e["loss"]) - ref[s]) <= 1e-4 * ref[s], (s, e["loss"], ref[s])
    # Steps after the checkpoint are trained again, with the same samples and the same result.
    for e in after:
        s = int(e["step"])
        if s in before:
            assert abs(float(e["loss"]) - before[s]) <= 1e-4 * before[s]


def test_a_restore_reads_each_layer_from_whichever_file_of_the_step_has_it(tmp_path: Path) -> None:
    import torch

    from chameleond.worker import _checkpoint as checkpoint
    from chameleond.worker._state import WorkerState

    arch = Arch(d_model=16, heads=2, blocks=2, seq_len=8, vocab=256, seed=3, lr=1e-2)
    cpu = torch.device("cpu")
    n = arch.n_layers
    for worker, owned in (("w0", range(n // 2)), ("w1", range(n // 2, n))):
        state = WorkerState(builtin_model(arch), cpu)
        for i in owned:
            state.build_from_seed(i)
        state.committed_step = 7
        checkpoint.save(tmp_path, worker, state, tuple(owned))
    later = WorkerState(builtin_model(arch), cpu)
    later.build_from_seed(0)
    later.committed_step = 12
    checkpoint.save(tmp_path, "w1", later, (0,))  # a step the restore makes a discarded past
    # w2 held something else at a later step: a restore replaces all of it.
    restored = WorkerState(builtin_model(arch), cpu)
    restored.build_from_seed(0)
    restored.committed_step = 12
    checkpoint.restore(tmp_path, restored, 7, tuple(range(n)))
    assert restored.committed_step == 7 and sorted(restored.layers) == list(range(n))
    assert all(layer.version == 7 for layer in restored.layers.values())
    seed = WorkerState(builtin_model(arch), cpu).build_from_seed(n - 1).state_buffer()
    assert torch.equal(restored.layer(n - 1).state_buffer(), seed)  # w1's file had it
    assert checkpoint.written(tmp_path) == {"w0": {7}, "w1": {7}}  # step 12 is gone
    # Some layers in no file of the step: nothing changes, and the error names the step and them.
    with pytest.raises(checkpoint.Unrestorable, match="no readable file of step 3") as lost:
        checkpoint.restore(tmp_path, restored, 3, (0, n - 2, n - 1))
    assert lost.value.step == 3 and str(lost.value).endswith(f"has layers 0,{n - 2}-{n - 1}")
    assert restored.committed_step == 7 and sorted(restored.layers) == list(range(n))


def test_a_restart_loads_the_newest_step_whose_files_cover_every_layer(tmp_path: Path) -> None:
    """w2 died long ago: it kept its two files of steps 3 and 7, while w0 and w1, which took its
    layers over, went on to steps 11 and 15. Their files of step 15 hold every layer."""
    import torch

    from chameleond.worker import _checkpoint as checkpoint
    from chameleond.worker._state import WorkerState

    arch = Arch(d_model=16, heads=2, blocks=2, seq_len=8, vocab=256, seed=3, lr=1e-2)
    cpu = torch.device("cpu")
    n = arch.n_layers
    first, second = tuple(range(n // 2)), tuple(range(n // 2, n))

    def save(worker: str, step: int, layers: tuple[int, ...]) -> Path:
        state = WorkerState(builtin_model(arch), cpu)
        for i in layers:
            state.build_from_seed(i)
        state.committed_step = step
        return checkpoint.save(tmp_path, worker, state, layers)

    for old in (3, 7):
        save("w2", old, second)
        save("w0", old, first)
    for new in (11, 15):
        save("w0", new, first)
        save("w1", new, second)
    assert checkpoint.written(tmp_path) == {"w0": {11, 15}, "w1": {11, 15}, "w2": {3, 7}}

    def load(worker: str) -> tuple[int | None, WorkerState]:
        state = WorkerState(builtin_model(arch), cpu)
        return checkpoint.load(tmp_path, worker, state), state

    step, state = load("w0")
    assert step == 15 and state.committed_step == 15 and tuple(state.layers) == first
    assert all(layer.version == 15 for layer in state.layers.values())
    assert load("w1")[0] == 15
    step, state = load("w2")  # no file of step 15: its layers come by migration
    assert step is None and state.layers == {} and state.committed_step == -1
    # A round cut short: w1's file of step 15 is unreadable, so step 15 lacks its layers.
    path = checkpoint.checkpoint_path(tmp_path, "w1", 15)
    path.write_bytes(path.read_bytes()[:100])
    assert load("w0")[0] == 11
    checkpoint.checkpoint_path(tmp_path, "w1", 11).unlink()
    none, state = load("w0")  # no step covers the model
    assert none is None and state.layers == {}
