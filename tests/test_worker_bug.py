"""A bug surfaces instead of looping: a user's loss that raises ends the worker, non-zero, with the
error in its log; it is not taken for a peer's fault and the generation is not built again and
again."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from worker_harness import Controller, Workers, tiny_spec

from chameleond.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]

# sgd_tied, whose loss raises once the flag file exists (after the first committed step).
BROKEN = """
import dataclasses, os, sys
sys.path.insert(0, {examples!r})
import sgd_tied
from chameleond.worker import run

def loss(logits, batch):
    if os.path.exists({flag!r}):
        raise ValueError("broken loss: the user's code is wrong")
    return sgd_tied.loss(logits, batch)

def training(job):
    return dataclasses.replace(sgd_tied.build(), loss=loss)

if __name__ == "__main__":
    sys.exit(run(training))
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_broken_user_loss_ends_the_worker_with_its_error(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    flag = tmp_path / "break"
    script = tmp_path / "broken.py"
    script.write_text(BROKEN.format(examples=str(ROOT / "examples"), flag=str(flag)))
    spec = tiny_spec("b", workers=2, stages=2, global_batch=12, micro_batch=2)
    controller = Controller(redis_server.url, spec, policy="reroute", measured=False).start()
    workers = Workers(redis_server.url, "b", tmp_path, command=[sys.executable, str(script)])
    try:
        workers.start(["w0", "w1"])
        controller.wait_steps(1, timeout=150)
        flag.touch()
        # Only the last stage computes the loss: its worker exits with the error.
        deadline = time.monotonic() + 90
        exited: list[str] = []
        while not exited and time.monotonic() < deadline:
            exited = [w for w, p in workers.procs.items() if p.poll() is not None]
            time.sleep(0.2)
        assert exited, workers.log("w1")[-3000:]
        (w,) = exited
        assert workers.procs[w].returncode != 0
        log = workers.log(w)
        assert "ValueError: broken loss: the user's code is wrong" in log
        assert "building generation" not in log  # not retried as a fault
    finally:
        workers.stop()
        controller.stop()
