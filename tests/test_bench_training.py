"""chameleonctl bench training: how a run is compared with the plain loop, and one short run of it
on the real stack (a daemon, Redis, seven worker processes of examples/recipe.py): a streamed
dataset through a restore, where every worker that holds layer 0 is killed at once and the job
trains on from the newest checkpoint, the stream read again from the restored position."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from chameleond.bench.training import compare

REF = {"loss": [5.0, 4.0, 3.0], "grad_norm": [1.0, 2.0, 4.0], "ids": [[1, 2], [3, 4], [5, 6]]}


def line(
    step: int, generation: int, loss: float, ids: list[int], norm: float = 1.0, whole: Any = None
) -> dict[str, Any]:
    """A worker's on_step line; `whole`: the step's (count, id sum) from its vote (default: the
    plain loop's, as in a run that trained the right samples)."""
    count, total = whole or (len(REF["ids"][step]), sum(REF["ids"][step]))
    return {
        "step": step,
        "generation": generation,
        "loss": loss,
        "grad_norm": norm,
        "overflow": False,
        "sample_ids": ids,
        "step_samples": count,
        "step_sample_id_sum": total,
    }


def test_a_run_like_the_plain_loop_matches_exactly() -> None:
    lines = {
        "w0": [line(0, 1, 5.0, [1]), line(1, 1, 4.0, [3], 2.0), line(2, 2, 3.0, [5, 6], 4.0)],
        "w1": [line(0, 1, 5.0, [2]), line(1, 1, 4.0, [4], 2.0)],
    }
    out = compare(lines, REF, 3)
    assert out["samples_lost"] == 0 and out["samples_repeated"] == 0
    assert out["loss_abs"] == 0.0 and out["grad_norm_rel"] == 0.0
    assert out["steps_committed"] == 3 and out["steps_ids_checked"] == 3
    # A worker killed right after committing step 2 left no line: its vote's totals still count.
    lines["w0"].pop()
    lines["w1"].append(line(2, 2, 3.0, [], 4.0))
    out = compare(lines, REF, 3)
    assert out["samples_lost"] == 0 and out["samples_repeated"] == 0
    assert out["steps_ids_checked"] == 2


def test_lost_and_repeated_samples_are_counted_in_the_models_history() -> None:
    lines = {
        # Step 1 was committed, then trained again after a restore (generation 3): the last
        # generation is the model's history. Step 2 trained sample 5 twice and never sample 6.
        "w0": [
            line(0, 1, 5.0, [1, 2]),
            line(1, 1, 4.0, [3, 3], 2.0, whole=(2, 6)),
            line(1, 3, 4.0, [3, 4], 2.0),
            line(2, 3, 3.3, [5, 5], 4.0, whole=(2, 10)),
        ],
    }
    out = compare(lines, REF, 3)
    # Step 2: as many samples but another id sum (1 + 1), and the logged ids say the same (1 + 1).
    assert out["samples_lost"] == 2 and out["samples_repeated"] == 2
    assert out["loss_abs"] == pytest.approx(0.3)
    # A step no generation committed lost all its samples.
    assert compare({"w0": [line(0, 1, 5.0, [1, 2])]}, REF, 2)["samples_lost"] == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_streamed_dataset_resumes_at_the_right_sample_after_a_restore(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    import json

    from chameleond.bench.training import _library, _plain, _trained
    from chameleond.cli.up import build_spec_document
    from chameleond.core.spec import load_spec
    from chameleond.local.examples import find_example
    from chameleond.local.faults import Fault

    example = find_example("recipe")
    doc = build_spec_document(load_spec(example.spec), job="bench-training", workers=None,
                              pp=None, bind_addresses=[], mtbf_prior_seconds=None)  # fmt: skip
    doc["model"]["arch"].update(stream=True)
    args = argparse.Namespace(steps=12, timeout=400.0, checkpoint_every=4)
    kills = tuple(Fault("kill", w, at_step=8) for w in ("w0", "w2", "w4"))
    mon, lines = _library(example, json.loads(json.dumps(doc)), tmp_path / "run", args, kills)
    assert [p["policy"] for g, p in sorted(mon.plans.items()) if g > 1] == ["restore"]
    ref = _plain(example, doc, tmp_path / "plain", args.steps, _trained(mon, lines))
    out = compare(lines, ref, args.steps)
    assert out["steps_committed"] == args.steps
    assert out["samples_lost"] == 0 and out["samples_repeated"] == 0, out
    assert out["loss_abs"] <= 1e-5, out
    # The restore trained steps again: some step was committed in two generations.
    generations: dict[int, set[int]] = {}
    for entries in lines.values():
        for e in entries:
            generations.setdefault(e["step"], set()).add(e["generation"])
    assert any(len(g) > 1 for g in generations.values()), generations
