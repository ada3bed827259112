"""The shipped job descriptions load and are what they claim; docs/spec.md covers the format."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from chameleond.core.decide import initial_plan
from chameleond.core.spec import SpecError, load_spec, parse_spec
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


DEFAULT_TEXT = (ROOT / "chameleond" / "jobs" / "cpu-small.toml").read_text()


def edited(old: str, new: str) -> str:
    assert old in DEFAULT_TEXT, old
    return DEFAULT_TEXT.replace(old, new, 1)


LAYERS_AS_TABLE = (
    DEFAULT_TEXT.split("[[model.layers]]")[0]
    + "[model.layers]\nforward_seconds = 0.1\n[training]\nglobal_batch = 12\nmicro_batch = 2\n"
)


@pytest.mark.parametrize(
    "text, fragment",
    [
        # Values that used to pass and then crash the daemon at its first decision.
        (edited("rebuild_seconds = 0.5", "rebuild_seconds = -1"), "job.rebuild_seconds"),
        (edited("mtbf_prior_seconds = 600.0", "mtbf_prior_seconds = 0"), "mtbf_prior_seconds"),
        (edited("mtbf_prior_seconds = 600.0", "mtbf_prior_seconds = nan"), "mtbf_prior_seconds"),
        (edited("rebuild_seconds = 0.5", "rebuild_seconds = inf"), "job.rebuild_seconds"),
        (edited("rebuild_seconds = 0.5", "restart_seconds = -5.0"), "job.restart_seconds"),
        (
            edited("bandwidth_bytes_per_second = 1.0e9", "bandwidth_bytes_per_second = nan"),
            "links.intra_host.bandwidth_bytes_per_second",
        ),
        (edited("latency_seconds = 6.0e-4", "latency_seconds = inf"), "latency_seconds"),
        (edited("forward_seconds = 0.0015", "forward_seconds = nan"), "forward_seconds"),
        (edited("param_bytes = 199_680", "param_bytes = inf"), "param_bytes"),
        (edited("memory_bytes = 2_147_483_648", "memory_bytes = nan"), "workers[0].memory_bytes"),
        (edited("cpu_cores = 2 ", "cpu_cores = nan "), "hosts.localhost.cpu_cores"),
        # Values of the wrong kind that used to end in a traceback.
        (edited("micro_batch = 2", "micro_batch = 0.5"), "training.micro_batch"),
        (edited("global_batch = 12", "global_batch = 7.9"), "training.global_batch"),
        (edited("count = 4", "count = 2.5"), "model.layers[1].count"),
        (edited('[job]\nname = "cpu-small"', 'job = "x"\n[other]\nname = "a"'), "job"),
        (LAYERS_AS_TABLE, "model.layers"),
        (edited("stages = 2 ", 'stages = "two" '), "plan.stages"),
        (edited("mtbf_prior_seconds = 600.0", 'mtbf_prior_seconds = "x"'), "mtbf_prior_seconds"),
        (edited("rebuild_seconds = 0.5", 'rebuild_seconds = "slow"'), "rebuild_seconds"),
        ("workers = [1, 2]\n" + DEFAULT_TEXT.split("[[workers]]")[0], "workers[0]"),
        (edited('id = "w0"', "id = 0"), "workers[0].id"),
        (edited('name = "embedding"', "name = 3"), "model.layers[0].name"),
        # Search bounds that leave nothing to search.
        (edited("min_stages = 1", "min_stages = 7"), "min_stages 7 is above max_stages 6"),
        (edited("max_stages = 6", "max_stages = 0"), "search.max_stages"),
    ],
)
def test_malformed_values_are_spec_errors_naming_the_field(
    text: str, fragment: str, tmp_path: Path
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert fragment in str(e.value)


def test_an_integer_beyond_any_float_is_a_spec_error_naming_the_field() -> None:
    """A JSON spec (as `up` and the agents send it) may hold integers TOML cannot."""
    doc = tomllib.loads(DEFAULT_TEXT)
    doc["job"]["rebuild_seconds"] = 10**400
    with pytest.raises(SpecError, match=r"job\.rebuild_seconds: .*integer too large"):
        parse_spec(doc)


def test_whole_numbers_written_as_floats_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(edited("global_batch = 12", "global_batch = 12.0"))
    spec = load_spec(path)
    assert spec.training.global_batch == 12 and isinstance(spec.training.global_batch, int)
    assert spec == load_default_spec()


def test_a_json_spec_of_the_wrong_shape_is_a_spec_error() -> None:
    for doc in ({"workers": "w0"}, {"workers": [{"id": "w0", "memory_bytes": [1]}]}, []):
        with pytest.raises(SpecError):
            parse_spec(doc)  # type: ignore[arg-type]
