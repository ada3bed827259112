"""Models nobody here wrote, as teams train them, under faults: examples/recipe.py with a Hugging
Face Mixtral (a Mixture-of-Experts whose router's balancing loss is part of the objective) on padded
variable-length batches (each micro-batch padded to its longest sample, an attention mask), through
real worker processes, real gloo and a real kill -9, under each policy (reroute, re-partition,
drop): every step's loss and gradient norm equal the same recipe's in a plain one-process loop
(`model(input_ids, attention_mask)`, the router loss from the model's own `aux_loss`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_worker_recipe import MB, STEPS, B, check_against_plain, plain, train

from chameleond.redis_server import RedisServer

pytest.importorskip("transformers")
pytest.importorskip("datasets")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("policy", ["reroute", "dynamic", "drop"])
def test_a_moe_models_router_loss_reaches_the_objective_on_padded_batches(
    redis_server: RedisServer, tmp_path: Path, policy: str
) -> None:
    arch = {"family": "mixtral", "padded": True}
    env = {"w3": {"CHAMELEON_WORKER_KILL_AT": "step:3"}}
    record, lines = train(redis_server.url, tmp_path, f"moe-{policy}", arch, policy, env)
    assert [p.policy for p in record.plans] == ["initial", policy]
    trained = None
    if policy == "drop":  # the job trains on without the lost pipeline's micro-batches
        kept = sorted(g for pipe in record.plans[1].pipelines for g in pipe.micro_batch_ids)
        trained = {s: (kept if s >= 3 else list(range(B // MB))) for s in range(STEPS)}
    ref = plain(tmp_path, arch, trained)
    worst = check_against_plain(lines, ref)
    # Without the router loss the objective differs: the comparison above would catch a library
    # that left it out.
    no_aux = plain(tmp_path, {**arch, "router_aux_loss_coef": 0.0}, trained)
    assert max(abs(a - b) for a, b in zip(ref["loss"], no_aux["loss"], strict=True)) > 1e-3
    print(f"\nMixtral, padded, {policy}: max abs loss error {worst:.2e}")
