"""The Hugging Face example under faults: real worker processes running examples/hf_gpt2.py (a
transformers GPT2LMHeadModel cut into layers, its tied embedding a Tie), real gloo, real Redis,
real plans from the decision core, a worker killed with SIGKILL in the middle of a step. The
losses must equal those of the failure-free run of the same job, step for step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from worker_harness import Controller, Record, Workers, tiny_spec

from chameleond.redis_server import RedisServer

pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ARCH = {"n_embd": 32, "n_layer": 2, "n_head": 2, "seq_len": 16, "vocab": 512, "seed": 3}
IDS = ["w0", "w1", "w2", "w3"]  # two pipelines of two stages
STEPS = 8
KILLED_IN_STEP = 3
LOSS_ATOL = 1e-5


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer and token ids, made once here so that the workers only read them."""
    sys.path.insert(0, str(EXAMPLES))
    import hf_text

    path = tmp_path_factory.mktemp("hf-cache")
    hf_text.stdlib_blocks(int(ARCH["seq_len"]), int(ARCH["vocab"]), path)
    return path


def train(
    url: str, logs: Path, cache: Path, job: str, policy: str, kill: str | None = None
) -> Record:
    spec = tiny_spec(job, workers=len(IDS), stages=2, global_batch=8, micro_batch=2)
    spec["model"]["arch"] = ARCH
    spec["model"]["layers"][0]["count"] = int(ARCH["n_layer"]) + 2
    controller = Controller(url, spec, policy=policy).start()
    command = [sys.executable, str(EXAMPLES / "hf_gpt2.py"), "--cache-dir", str(cache)]
    (logs / job).mkdir()
    workers = Workers(url, job, logs / job, command=command)
    env = {kill: {"CHAMELEON_WORKER_KILL_AT": f"step:{KILLED_IN_STEP}"}} if kill else None
    try:
        workers.start(IDS, env, max_steps=STEPS)
        controller.wait_steps(STEPS, timeout=240)
        last = controller.current
        assert last is not None
        controller.wait_for(
            "every worker of the last plan to finish",
            lambda: all(workers.procs[w].poll() is not None for w in last.workers),
            60,
        )
        for w in last.workers:
            assert workers.procs[w].returncode == 0, workers.log(w)[-3000:]
        if kill:
            assert workers.procs[kill].wait(timeout=30) == -9, workers.log(kill)[-3000:]
        assert "GPT2LMHeadModel" in workers.log("w0")  # the model the worker profiled and trained
        return controller.record
    finally:
        workers.stop()
        controller.stop()


_failure_free: dict[int, float] = {}


def failure_free(url: str, logs: Path, cache: Path) -> dict[int, float]:
    if not _failure_free:
        record = train(url, logs, cache, "hf-clean", "reroute")
        assert [p.policy for p in record.plans] == ["initial"]
        _failure_free.update(record.committed())
    return _failure_free


def assert_same_losses(record: Record, reference: dict[int, float]) -> float:
    committed = record.committed()
    assert sorted(committed) == list(range(STEPS)), sorted(committed)
    assert sorted(reference) == list(range(STEPS))
    worst = max(abs(committed[s] - reference[s]) for s in range(STEPS))
    assert worst <= LOSS_ATOL, {s: (committed[s], reference[s]) for s in range(STEPS)}
    for e in record.of("step"):  # every worker of a step reports the same all-reduced loss
        assert float(e["loss"]) == committed[int(e["step"])]
    # A step committed in two generations would be a repeated update.
    gens: dict[int, set[str]] = {}
    for e in record.of("step"):
        gens.setdefault(int(e["step"]), set()).add(e["generation"])
    assert all(len(g) == 1 for g in gens.values()), gens
    return worst


@pytest.mark.parametrize("policy", ["reroute", "dynamic"])
def test_hf_gpt2_killed_mid_step_trains_as_without_the_fault(
    policy: str, redis_server: RedisServer, tmp_path: Path, cache_dir: Path
) -> None:
    reference = failure_free(redis_server.url, tmp_path, cache_dir)
    record = train(redis_server.url, tmp_path, cache_dir, f"hf-{policy}", policy, kill="w3")
    assert [p.policy for p in record.plans] == ["initial", policy]
    assert "w3" not in record.plans[1].workers
    if policy == "dynamic":
        assert record.plans[1].migration, "the re-partition moved no layer"
    worst = assert_same_losses(record, reference)
    assert reference[STEPS - 1] < reference[0]  # and it trains
    print(f"\n{policy}: max |loss - failure-free loss| {worst:.2e}")
