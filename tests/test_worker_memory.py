"""A model whose parameters do not fit in one worker's memory trains when split: examples/recipe.py
starting from a Hugging Face `save_pretrained` directory (a Llama of about 350 MB of fp32
parameters) on one pipeline of four real worker processes, each limited (RLIMIT_DATA, set by the
script once its imports and its dataset are made) to 90% of the model's parameter bytes more
than it holds then: the parameters alone would not fit.
Each worker builds its layers from the meta device, reading only their tensors, and the job
commits its steps. The same limit stops a worker that builds the whole model, as every worker did
before it could start from the meta device."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from worker_harness import Controller, Workers, tiny_spec

from chameleond.redis_server import RedisServer

pytest.importorskip("transformers")
pytest.importorskip("datasets")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
IDS = ["w0", "w1", "w2", "w3"]
ARCH = {
    "family": "llama",
    "n_embd": 768,
    "n_layer": 8,
    "n_head": 12,
    "vocab": 8192,
    "seq_len": 16,
    "samples": 64,
    "optimizer": "sgd",  # no optimizer state: a quarter's parameters and gradients, half the model
}
STEPS = 3


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The seeded model saved once: its directory and its parameter bytes."""
    out = tmp_path_factory.mktemp("llama")
    code = f"""
        import json, sys
        sys.path.insert(0, {str(EXAMPLES)!r})
        import recipe
        model = recipe.model_of(recipe.arch_of(json.loads({json.dumps(ARCH)!r})))
        model.save_pretrained({str(out)!r})
        print(sum(p.numel() * p.element_size() for p in model.parameters()))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out, int(done.stdout.split()[-1])


def start(url: str, job: str, arch: dict[str, object]) -> Controller:
    spec = tiny_spec(job, workers=len(IDS), stages=len(IDS), global_batch=4, micro_batch=1)
    spec["model"]["arch"] = arch
    spec["model"]["layers"][0]["count"] = int(ARCH["n_layer"]) + 2
    return Controller(url, spec, policy="reroute").start()


def test_a_model_too_large_for_one_worker_trains_split_from_its_pretrained_directory(
    redis_server: RedisServer, tmp_path: Path, pretrained: tuple[Path, int]
) -> None:
    directory, param_bytes = pretrained
    # glibc's malloc serves blocks of a MiB and more from mmap, returned to the system when
    # freed: without it, freed layers of the start-up checks would stay in the heap.
    limit = {"RECIPE_DATA_LIMIT": str(int(0.9 * param_bytes)), "MALLOC_MMAP_THRESHOLD_": "1048576"}
    # Threads' stacks count as data: gloo's and torch's get 1 MiB (glibc sizes them by the stack
    # limit at start), the script's and the library's too (threading.stack_size).
    command = ["prlimit", f"--stack={1 << 20}", sys.executable, str(EXAMPLES / "recipe.py")]

    arch = {**ARCH, "pretrained": str(directory)}
    controller = start(redis_server.url, "split", arch)
    (tmp_path / "split").mkdir()
    workers = Workers(redis_server.url, "split", tmp_path / "split", command=command)
    try:
        workers.start(IDS, {w: limit for w in IDS}, max_steps=STEPS)
        controller.wait_steps(STEPS, timeout=300)
    finally:
        workers.stop()
        controller.stop()
    assert sorted(controller.record.committed()) == list(range(STEPS))

    # The whole model under the same limit: the worker cannot even build it.
    controller = start(redis_server.url, "whole", ARCH)
    (tmp_path / "whole").mkdir()
    workers = Workers(redis_server.url, "whole", tmp_path / "whole", command=command)
    try:
        workers.start(IDS[:1], {IDS[0]: limit}, max_steps=STEPS)
        assert workers.procs[IDS[0]].wait(timeout=120) != 0
    finally:
        workers.stop()
        controller.stop()
    assert "MemoryError" in workers.log(IDS[0]) or "allocate" in workers.log(IDS[0])
