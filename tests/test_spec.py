"""The shipped job descriptions load and are what they claim; docs/spec.md covers the format."""

from __future__ import annotations

import os
from pathlib import Path

from chameleond.core.decide import initial_plan
from chameleond.core.spec import load_spec
from chameleond.jobs import default_spec_path, load_default_spec

ROOT = Path(__file__).resolve().parent.parent


def test_default_job_is_the_small_cpu_transformer() -> None:
    spec = load_default_spec()
    assert default_spec_path().is_file()
    assert [w.id for w in spec.workers] == [f"w{i}" for i in range(6)]
    assert {w.host for w in spec.workers} == {"localhost"}
    assert spec.layout == (("w0", "w1"), ("w2", "w3"), ("w4", "w5"))
    assert dict(spec.arch) == {
        "d_model": 64, "heads": 4, "blocks": 4, "seq_len": 64, "vocab": 256, "seed": 0, "lr": 0.003,
    }  # fmt: skip
    assert [layer.name for layer in spec.layers] == ["embedding"] + ["block"] * 4 + ["head"]
    assert (spec.training.global_batch, spec.training.micro_batch) == (12, 2)
    plan = initial_plan(spec)
    assert max(plan.estimates.peak_memory_bytes.values()) < min(
        w.memory_bytes for w in spec.workers
    )


def test_example_link_points_at_the_packaged_job() -> None:
    link = ROOT / "examples" / "cpu-small.toml"
    assert link.is_symlink() and os.readlink(link) == "../chameleond/jobs/cpu-small.toml"
    assert load_spec(link) == load_default_spec()


def test_examples_are_the_jobs_they_claim() -> None:
    gpt = load_spec(ROOT / "examples" / "gpt-32.toml")
    assert len(gpt.workers) == 32 and len(gpt.layout) == 8
    assert all(len(p) == 4 for p in gpt.layout) and len({w.host for w in gpt.workers}) >= 2
    assert len(gpt.layers) == 26  # embedding + 24 blocks + head
    big = load_spec(ROOT / "examples" / "cluster-1024.toml")
    assert len(big.workers) == 1024
    for spec in (gpt, big):
        plan = initial_plan(spec)
        memory = {w.id: w.memory_bytes for w in spec.workers}
        assert all(need <= memory[w] for w, need in plan.estimates.peak_memory_bytes.items())


def test_docs_name_every_spec_field() -> None:
    doc = (ROOT / "docs" / "spec.md").read_text()
    fields = [
        "name", "mtbf_prior_seconds", "rebuild_seconds", "workers", "id", "host", "memory_bytes",
        "device", "intra_host", "inter_host", "bandwidth_bytes_per_second", "latency_seconds",
        "layers", "count", "forward_seconds", "backward_seconds", "param_bytes",
        "optimizer_bytes", "activation_bytes", "output_bytes", "arch", "global_batch",
        "micro_batch", "pipelines", "stages", "min_stages", "max_stages",
    ]  # fmt: skip
    missing = [f for f in fields if f"`{f}`" not in doc]
    assert missing == []
