"""A job described by its hosts (`[[hosts]]`, SLURM hostlists) is the job its workers list would
describe; `host_slots` gives each host its workers and devices (docs/spec.md, "[[hosts]]")."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from chameleond.core.hostlist import expand_hostlist
from chameleond.core.hosts import Slot, host_slots, hosts_of
from chameleond.core.spec import HostSpec, JobSpec, SpecError, WorkerSpec, load_spec, parse_spec
from chameleond.jobstate.jobspec import spec_document

ROOT = Path(__file__).resolve().parent.parent

# Everything of a job but its workers: 8 layers, so pipelines of up to 8 stages.
JOB = """
[links.intra_host]
bandwidth_bytes_per_second = 2.0e11
latency_seconds = 5.0e-6
[links.inter_host]
bandwidth_bytes_per_second = 5.0e10
latency_seconds = 1.0e-5
[[model.layers]]
count = 8
forward_seconds = 0.003
backward_seconds = 0.006
param_bytes = 600_000_000
optimizer_bytes = 3_600_000_000
activation_bytes = 350_000_000
output_bytes = 20_000_000
[training]
global_batch = 2048
micro_batch = 1
[plan]
stages = 8
"""


def spec(workers_toml: str, stages: int = 8) -> JobSpec:
    return parse_spec(tomllib.loads(workers_toml + JOB.replace("stages = 8", f"stages = {stages}")))


def spec_error(workers_toml: str) -> str:
    with pytest.raises(SpecError) as e:
        spec(workers_toml)
    return str(e.value)


@pytest.mark.parametrize(
    "hostlist, names",
    [
        ("node7", ["node7"]),
        ("a[1-3,7],b9", ["a1", "a2", "a3", "a7", "b9"]),
        ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
        ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("rack[1-2]-ib", ["rack1-ib", "rack2-ib"]),
        ("x[1,3],y[00-01],z", ["x1", "x3", "y00", "y01", "z"]),
        ("[5-6]", ["5", "6"]),
    ],
)
def test_hostlists_expand_as_slurm_writes_them(hostlist: str, names: list[str]) -> None:
    assert expand_hostlist(hostlist) == tuple(names)


@pytest.mark.parametrize(
    "hostlist, fragment",
    [
        ("gpu[001-128", "unclosed '['"),
        ("gpu001-128]", "']' without its '['"),
        ("gpu[5-3]", "range '5-3' starts above its end"),
        ("", "an empty host name"),
        ("a,,b", "an empty host name"),
        ("a,", "an empty host name"),
        ("gpu[]", "empty brackets"),
        ("gpu[1-2,]", "'' is not a number"),
        ("gpu[a-b]", "'a-b' is not a number"),
        ("gpu[1-2-3]", "'1-2-3' is not a number"),
        ("r[1-2]n[1-2]", "more than one bracket group"),
        ("r[1-[2]]", "'[' inside a bracket group"),
        ("n[0-999999]", None),  # exactly the limit: allowed
        ("n[0-1000000]", "names 1000001 hosts, more than the limit of 1000000"),
        ("n[0-99999999999999999999]", "more than the limit"),
    ],
)
def test_malformed_hostlists_say_what_is_wrong(hostlist: str, fragment: str | None) -> None:
    if fragment is None:
        assert len(expand_hostlist(hostlist)) == 1_000_000
        return
    with pytest.raises(ValueError) as e:
        expand_hostlist(hostlist)
    assert fragment in str(e.value)


def hand_written(hosts: list[str], devices: int, memory: int, device: str = "cpu") -> list[str]:
    """The `workers` entries `[[hosts]]` stands for, written out one by one."""
    return [
        f'{{ id = "{h}-{i}", host = "{h}", memory_bytes = {memory}, device = "{device}" }},'
        for h in hosts
        for i in range(devices)
    ]


def workers_list(rows: list[str]) -> str:
    return "workers = [\n" + "\n".join(rows) + "\n]\n"


def test_a_1024_device_job_in_a_few_lines_is_the_hand_written_job() -> None:
    by_hosts = spec(
        '[[hosts]]\nname = "gpu[001-128]"\ndevices = 8\ndevice = "cuda"\nmemory_bytes = 75e9\n'
    )
    hosts = [f"gpu{n:03d}" for n in range(1, 129)]
    by_hand_text = workers_list(hand_written(hosts, 8, 75_000_000_000, "cuda"))
    assert by_hand_text.count("{ id =") == 1024
    by_hand = spec(by_hand_text)
    assert by_hosts == by_hand
    assert len(by_hosts.workers) == 1024 and by_hosts.workers[9] == WorkerSpec(
        "gpu002-1", "gpu002", 75_000_000_000, "cuda"
    )
    # `stages = 8` splits the generated workers in order: one pipeline per host.
    assert by_hosts.layout[0] == tuple(f"gpu001-{i}" for i in range(8))
    assert all(len({by_hosts.worker(w).host for w in p}) == 1 for p in by_hosts.layout)
    assert by_hosts.hosts == {}  # no cpu_cores: no host bounds the planner's CPU work
    # The daemon stores the spec as a workers list; it parses back to the same job.
    assert parse_spec(spec_document(by_hosts)) == by_hosts


def test_the_hosts_example_is_cluster_1024_with_host_named_workers() -> None:
    big = load_spec(ROOT / "examples" / "cluster-1024.toml")
    by_hosts = load_spec(ROOT / "examples" / "cluster-1024-hosts.toml")
    renamed = {w.id: f"{w.host}-{i % 8}" for i, w in enumerate(big.workers)}
    assert by_hosts == replace(
        big,
        name=by_hosts.name,
        workers=tuple(replace(w, id=renamed[w.id]) for w in big.workers),
        layout=tuple(tuple(renamed[w] for w in p) for p in big.layout),
    )
    text = (ROOT / "examples" / "cluster-1024-hosts.toml").read_text()
    assert "workers" not in tomllib.loads(text) and len(text.splitlines()) < 100


def test_entries_generate_workers_in_file_then_hostlist_order() -> None:
    job = spec(
        '[[hosts]]\nname = "b[1-2]x"\ndevices = 1\nmemory_bytes = 1\n'
        + '[[hosts]]\nname = "a"\ndevices = 2\nmemory_bytes = 2\ndevice = "npu"\n'
        + '[[hosts]]\nname = "c[1-3]"\ndevices = 1\nmemory_bytes = 3\n',
        stages=7,
    )
    assert [(w.id, w.host, w.memory_bytes, w.device) for w in job.workers] == [
        ("b1x-0", "b1x", 1, "cpu"),
        ("b2x-0", "b2x", 1, "cpu"),
        ("a-0", "a", 2, "npu"),
        ("a-1", "a", 2, "npu"),
        ("c1-0", "c1", 3, "cpu"),
        ("c2-0", "c2", 3, "cpu"),
        ("c3-0", "c3", 3, "cpu"),
    ]
    assert hosts_of(job.workers) == ("b1x", "b2x", "a", "c1", "c2", "c3")


def test_cpu_cores_put_the_hosts_in_the_spec_as_the_table_form_does() -> None:
    entries = (
        '[[hosts]]\nname = "cpu[1-2]"\ndevices = 4\nmemory_bytes = 2e9\ncpu_cores = 3\n'
        "step_cpu_seconds = 0.01\n"
        '[[hosts]]\nname = "spare"\ndevices = 8\nmemory_bytes = 2e9\n'
    )
    by_hand = workers_list(
        hand_written(["cpu1", "cpu2"], 4, 2_000_000_000) + hand_written(["spare"], 8, 2_000_000_000)
    )
    tables = (
        "[hosts.cpu1]\ncpu_cores = 3\nstep_cpu_seconds = 0.01\n"
        "[hosts.cpu2]\ncpu_cores = 3\nstep_cpu_seconds = 0.01\n"
    )
    job = spec(entries)
    assert job.hosts == {"cpu1": HostSpec(3.0, 0.01), "cpu2": HostSpec(3.0, 0.01)}
    assert job == spec(by_hand + tables)


def test_workers_and_hosts_exclude_each_other_and_one_is_required() -> None:
    one = workers_list(hand_written(["h"], 8, 1))
    by_hosts = '[[hosts]]\nname = "h"\ndevices = 8\nmemory_bytes = 1\n'
    assert "workers and [[hosts]]: give one of them, not both" in spec_error(one + by_hosts)
    assert "missing required field 'workers' (or [[hosts]] entries)" in spec_error("")
    # The table form of hosts still goes with a workers list, and still needs one.
    assert "missing required field 'workers'" in spec_error("[hosts.h]\ncpu_cores = 2\n")
    assert spec(one + "[hosts.h]\ncpu_cores = 2\n").hosts == {"h": HostSpec(2.0)}
    with pytest.raises(SpecError, match="hosts: expected a non-empty list"):
        parse_spec({**tomllib.loads(JOB), "hosts": []})


def entry(**fields: Any) -> dict[str, Any]:
    return {"name": "h[1-2]", "devices": 4, "memory_bytes": 1, **fields}


@pytest.mark.parametrize(
    "entries, fragment",
    [
        ([entry(), entry(name="h2,h9")], "hosts[1].name: host 'h2' is also in hosts[0]"),
        ([entry(name="h1,h[0-1]")], "hosts[0].name: host 'h1' is also in hosts[0]"),
        ([entry(), entry(name="x[2-1]")], "hosts[1].name: 'x[2-1]': range '2-1'"),
        ([entry(name="h[1-2")], "hosts[0].name: 'h[1-2': unclosed '['"),
        ([entry(name="")], "hosts[0].name: expected a non-empty string"),
        ([entry(name=7)], "hosts[0].name: expected a non-empty string"),
        ([entry(devices=0)], "hosts[0].devices: must be >= 1"),
        ([entry(devices=2.5)], "hosts[0].devices: expected a whole number"),
        ([entry(devices="8")], "hosts[0].devices: expected a finite number"),
        ([{"name": "h", "memory_bytes": 1}], "hosts[0]: missing required field 'devices'"),
        ([{"name": "h", "devices": 1}], "hosts[0]: missing required field 'memory_bytes'"),
        ([entry(memory_bytes=-1)], "hosts[0].memory_bytes: must be >= 1"),
        ([entry(device="tpu")], "hosts[0].device: expected cpu, cuda or npu, got 'tpu'"),
        ([entry(device="cuda:0")], "hosts[0].device: expected cpu, cuda or npu"),
        ([entry(gpus=8)], "hosts[0]: unknown field(s) gpus"),
        ([entry(step_cpu_seconds=0.1)], "hosts[0].step_cpu_seconds: needs cpu_cores"),
        ([entry(cpu_cores=0)], "hosts[0].cpu_cores: must be > 0"),
        ([entry(name="a b")], "hosts[0].name: worker id 'a b-3' is not printable, has spaces"),
        ([entry(name="h\x07")], "hosts[0].name: worker id 'h\\x07-3' is not printable"),
        ([entry(name="h" * 127, devices=10)], "longer than 128 characters"),
        ([entry(name="n[1-1000]", devices=1001)], "hosts generate more than 1000000 workers"),
        (["h1"], "hosts[0]: expected a table"),
    ],
)
def test_malformed_host_entries_are_spec_errors_naming_the_field(
    entries: list[Any], fragment: str
) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({**tomllib.loads(JOB), "plan": {"stages": 1}, "hosts": entries})
    assert fragment in str(e.value)


def test_the_longest_valid_worker_id_is_accepted() -> None:
    doc = {**tomllib.loads(JOB), "plan": {"stages": 1}}
    job = parse_spec({**doc, "hosts": [entry(name="h" * 126, devices=10)]})
    assert max(len(w.id) for w in job.workers) == 128


def test_host_slots_number_each_hosts_devices_of_a_kind_from_zero() -> None:
    by_hosts = spec(
        '[[hosts]]\nname = "g[1-2]"\ndevices = 3\ndevice = "cuda"\nmemory_bytes = 1\n'
        '[[hosts]]\nname = "c"\ndevices = 2\nmemory_bytes = 1\n'
    )
    assert host_slots(by_hosts.workers, "g2") == (
        Slot("g2-0", "cuda:0"), Slot("g2-1", "cuda:1"), Slot("g2-2", "cuda:2"),
    )  # fmt: skip
    assert host_slots(by_hosts.workers, "c") == (Slot("c-0", "cpu"), Slot("c-1", "cpu"))
    assert host_slots(by_hosts.workers, "elsewhere") == ()
    assert hosts_of(by_hosts.workers) == ("g1", "g2", "c")


def test_host_slots_of_a_hand_written_spec_with_a_mixed_host() -> None:
    rows = [
        ("w0", "mixed", "cuda"), ("w1", "other", "cuda"), ("w2", "mixed", "cpu"),
        ("w3", "mixed", "cuda"), ("w4", "other", "npu"), ("w5", "other", "cuda"),
        ("w6", "pinned", "cuda"), ("w7", "pinned", "cuda:0"),
    ]  # fmt: skip
    text = workers_list(
        [f'{{ id = "{w}", host = "{h}", memory_bytes = 1, device = "{d}" }},' for w, h, d in rows]
    )
    job = spec(text)
    assert host_slots(job.workers, "mixed") == (
        Slot("w0", "cuda:0"), Slot("w2", "cpu"), Slot("w3", "cuda:1"),
    )  # fmt: skip
    assert host_slots(job.workers, "other") == (
        Slot("w1", "cuda:0"), Slot("w4", "npu:0"), Slot("w5", "cuda:1"),
    )  # fmt: skip
    # A worker the spec pins keeps its device; the others number around it.
    assert host_slots(job.workers, "pinned") == (Slot("w6", "cuda:1"), Slot("w7", "cuda:0"))
    assert hosts_of(job.workers) == ("mixed", "other", "pinned")
