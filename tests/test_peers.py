"""chameleond and TorchFT side by side, short (`chameleonctl bench peers`): both systems really
train examples/recipe.py's GPT-2 on two devices, the same replica is kill -9'd at the same step
and started again, and every sample is accounted for from each system's own logs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torchft") is None,
        reason="torchft is not installed: pip install 'chameleond[compare]'",
    ),
]


def test_the_same_kill_under_both_systems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chameleond.bench.peers import _spec_doc, run_chameleond, torchft_commits
    from chameleond.bench.peers_figures import figures, history
    from chameleond.bench.peers_torchft import Schedule, recipe_module, run_torchft, sample_id

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    doc = _spec_doc(2, 1, False)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(doc))
    arch = recipe_module().arch_of(doc["model"]["arch"])
    B = doc["training"]["global_batch"]

    def want(step: int) -> list[int]:
        return [sample_id(arch, step * B + k) for k in range(B)]

    when = Schedule(victim=1, kill_step=4, away_seconds=1.0, after_seconds=5.0,
                    timeout_seconds=180.0)  # fmt: skip
    peer = torchft_commits(
        run_torchft(spec, tmp_path / "torchft", 2, when, patched=True, heartbeat_timeout_ms=3000),
        when.victim,
    )
    ours = run_chameleond(doc, tmp_path / "chameleond", when, "adaptive", 0)
    for run in (peer, ours):
        assert run.kill_at is not None and run.return_at is not None
        assert any(c.at > run.kill_at and run.victim not in c.members for c in run.commits)

    # chameleond: every step of the history trained its whole global batch, exactly once.
    f = figures(ours, None, want)
    chain = history(ours.commits)
    assert [c.step for c in chain] == list(range(len(chain)))
    assert all(c.count == B for c in chain)
    assert (f["samples_lost"], f["samples_repeated"], f["samples_discarded"]) == (0, 0, 0)

    # TorchFT: a committed step trains the shares of the replica groups in it, read from their
    # lines; the victim's share of the steps the survivor trained alone is never trained.
    f = figures(peer, None, want)
    chain = history(peer.commits)
    assert [c.step for c in chain] == list(range(len(chain)))
    for c in chain:
        assert len(c.ids) == c.count == B // 2 * len(c.members)
        assert set(c.ids) <= set(want(c.step))
    alone = [c for c in chain if peer.victim not in c.members]
    assert alone, "the survivor trained no step alone"
    assert f["samples_lost"] == sum(B - c.count for c in chain) == B // 2 * len(alone)
    assert f["samples_repeated"] == 0
