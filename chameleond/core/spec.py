"""The job description: workers, links, the model's per-layer profile, training, current layout.

Plain data in, plain data out. `load_spec` reads TOML or JSON; `parse_spec` takes the decoded
mapping, so the daemon can build a spec from Redis state without touching the filesystem. Every
validation problem raises `SpecError` with a message a person can act on (format: docs/spec.md).
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class SpecError(ValueError):
    """The job description is malformed; the message names the field."""


@dataclass(frozen=True)
class WorkerSpec:
    id: str
    host: str
    memory_bytes: int
    device: str = "cpu"


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_bytes_per_second: float
    latency_seconds: float

    def transfer_seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_seconds + nbytes / self.bandwidth_bytes_per_second


@dataclass(frozen=True)
class LayerProfile:
    """Measured cost of one layer for one micro-batch (embedding and head are layers too)."""

    name: str
    forward_seconds: float
    backward_seconds: float
    param_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # stashed per in-flight micro-batch
    output_bytes: int  # the activation sent to the next stage per micro-batch
    update_seconds: float = 0.0  # the optimizer step of the layer, once per training step


@dataclass(frozen=True)
class HostSpec:
    """A host whose CPU cores the job's workers share (a CPU job: workers are processes)."""

    cpu_cores: float  # cores the job gets there (measured by its workers where they compete)
    step_cpu_seconds: float = 0.0  # CPU per worker per step beyond its layers: messages, votes


@dataclass(frozen=True)
class TrainingSpec:
    global_batch: int  # B samples per step, never changes
    micro_batch: int  # samples per micro-batch

    @property
    def micro_batches(self) -> int:
        """Global micro-batches per step (over all pipelines)."""
        return self.global_batch // self.micro_batch


@dataclass(frozen=True)
class SearchLimits:
    """Bounds on the plan search: allowed pipeline lengths (stages per pipeline)."""

    min_stages: int = 1
    max_stages: int = 64


@dataclass(frozen=True)
class JobSpec:
    name: str
    workers: tuple[WorkerSpec, ...]
    intra_host: LinkSpec
    inter_host: LinkSpec
    layers: tuple[LayerProfile, ...]
    training: TrainingSpec
    # The current layout: one tuple of worker ids per pipeline, stage order.
    layout: tuple[tuple[str, ...], ...]
    mtbf_prior_seconds: float = 3.1 * 3600.0
    search: SearchLimits = field(default_factory=SearchLimits)
    # Expected seconds to build communicators for a new plan (paid by every policy).
    rebuild_seconds: float = 0.05
    # Seconds from a fault that loses the last copy of some layer's state to training again:
    # a restart from checkpoint, with the work since it (the selector's risk term).
    restart_seconds: float = 600.0
    # The model's architecture for the workers (d_model, heads, blocks, seq_len, vocab, seed, lr);
    # opaque to the planner, which only sees `layers`.
    arch: Mapping[str, Any] = field(default_factory=dict)
    # Hosts whose CPU cores the workers share (`[hosts.NAME]`; measured by CPU workers). Where a
    # host is listed, its workers' summed CPU work per step bounds the step from below.
    hosts: Mapping[str, HostSpec] = field(default_factory=dict)

    def worker(self, worker_id: str) -> WorkerSpec:
        for w in self.workers:
            if w.id == worker_id:
                return w
        raise KeyError(worker_id)

    def link(self, a: str, b: str) -> LinkSpec:
        return self.intra_host if self.worker(a).host == self.worker(b).host else self.inter_host

    def with_layers(self, layers: Sequence[LayerProfile]) -> JobSpec:
        """The same job with measured layer profiles in place of the spec's numbers."""
        if len(layers) != len(self.layers):
            raise SpecError(f"profile has {len(layers)} layers, the model has {len(self.layers)}")
        return replace(self, layers=tuple(layers))

    def with_workers(self, workers: Sequence[WorkerSpec]) -> JobSpec:
        return replace(self, workers=tuple(workers))


def _get(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise SpecError(f"{where}: missing required field {key!r}")
    return d[key]


def _num(d: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float:
    v = _get(d, key, where)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SpecError(f"{where}.{key}: expected a number, got {v!r}")
    if positive and v <= 0:
        raise SpecError(f"{where}.{key}: must be > 0, got {v!r}")
    if not positive and v < 0:
        raise SpecError(f"{where}.{key}: must be >= 0, got {v!r}")
    return float(v)


def _link(d: Mapping[str, Any], where: str) -> LinkSpec:
    return LinkSpec(
        bandwidth_bytes_per_second=_num(d, "bandwidth_bytes_per_second", where),
        latency_seconds=_num(d, "latency_seconds", where, positive=False),
    )


def _layer(d: Mapping[str, Any], i: int) -> LayerProfile:
    where = f"model.layers[{i}]"
    return LayerProfile(
        name=str(d.get("name", f"layer{i}")),
        forward_seconds=_num(d, "forward_seconds", where, positive=False),
        backward_seconds=_num(d, "backward_seconds", where, positive=False),
        param_bytes=int(_num(d, "param_bytes", where, positive=False)),
        optimizer_bytes=int(_num(d, "optimizer_bytes", where, positive=False)),
        activation_bytes=int(_num(d, "activation_bytes", where, positive=False)),
        output_bytes=int(_num(d, "output_bytes", where, positive=False)),
        update_seconds=_num(d, "update_seconds", where, positive=False)
        if "update_seconds" in d
        else 0.0,
    )


def _layers(model: Mapping[str, Any]) -> tuple[LayerProfile, ...]:
    """Either an explicit `layers` list, or `repeat` blocks: [{count=N, ...layer fields}]."""
    out: list[LayerProfile] = []
    if "layers" in model:
        for d in model["layers"]:
            count = int(d.get("count", 1))
            for _ in range(count):
                out.append(_layer(d, len(out)))
    if not out:
        raise SpecError("model.layers: at least one layer is required")
    return tuple(out)


def parse_spec(d: Mapping[str, Any]) -> JobSpec:
    """Build a JobSpec from a decoded TOML/JSON mapping, validating every field."""
    if not isinstance(d, Mapping):
        raise SpecError("spec: expected a table/object at the top level")
    job = d.get("job", {})
    workers_raw = _get(d, "workers", "spec")
    if not isinstance(workers_raw, list) or not workers_raw:
        raise SpecError("workers: expected a non-empty list")
    workers = []
    for i, w in enumerate(workers_raw):
        where = f"workers[{i}]"
        workers.append(
            WorkerSpec(
                id=str(_get(w, "id", where)),
                host=str(w.get("host", "localhost")),
                memory_bytes=int(_num(w, "memory_bytes", where)),
                device=str(w.get("device", "cpu")),
            )
        )
    ids = [w.id for w in workers]
    if len(set(ids)) != len(ids):
        raise SpecError("workers: duplicate worker id")
    links = _get(d, "links", "spec")
    model = _get(d, "model", "spec")
    layers = _layers(model)
    tr = _get(d, "training", "spec")
    training = TrainingSpec(
        global_batch=int(_num(tr, "global_batch", "training")),
        micro_batch=int(_num(tr, "micro_batch", "training")),
    )
    if training.global_batch % training.micro_batch:
        raise SpecError("training: global_batch must be a multiple of micro_batch")
    layout = _layout(d.get("plan", {}), ids, len(layers))
    if training.micro_batches < len(layout):
        raise SpecError(
            f"training: {training.micro_batches} micro-batches cannot feed {len(layout)} pipelines"
        )
    lim = d.get("search", {})
    hosts = d.get("hosts", {})
    if not isinstance(hosts, Mapping):
        raise SpecError("hosts: expected a table of host names")
    host_specs: dict[str, HostSpec] = {}
    for h, v in hosts.items():
        if not isinstance(v, Mapping):
            raise SpecError(f"hosts.{h}: expected a table")
        host_specs[str(h)] = HostSpec(
            cpu_cores=_num(v, "cpu_cores", f"hosts.{h}"),
            step_cpu_seconds=_num(v, "step_cpu_seconds", f"hosts.{h}", positive=False)
            if "step_cpu_seconds" in v
            else 0.0,
        )
    return JobSpec(
        name=str(job.get("name", "default")),
        workers=tuple(workers),
        intra_host=_link(_get(links, "intra_host", "links"), "links.intra_host"),
        inter_host=_link(_get(links, "inter_host", "links"), "links.inter_host"),
        layers=layers,
        training=training,
        layout=layout,
        mtbf_prior_seconds=float(job.get("mtbf_prior_seconds", 3.1 * 3600.0)),
        search=SearchLimits(
            min_stages=int(lim.get("min_stages", 1)), max_stages=int(lim.get("max_stages", 64))
        ),
        rebuild_seconds=float(job.get("rebuild_seconds", 0.05)),
        restart_seconds=_num(job, "restart_seconds", "job", positive=False)
        if "restart_seconds" in job
        else 600.0,
        arch=dict(model.get("arch", {})),
        hosts=host_specs,
    )


def _layout(plan: Mapping[str, Any], ids: list[str], n_layers: int) -> tuple[tuple[str, ...], ...]:
    """`plan.pipelines` lists worker ids per pipeline; else `plan.stages` = N_pp splits in order."""
    if "pipelines" in plan:
        pipes = tuple(tuple(str(w) for w in p) for p in plan["pipelines"])
    else:
        pp = int(plan.get("stages", 1))
        if pp <= 0 or len(ids) % pp:
            raise SpecError(f"plan.stages: {pp} does not divide {len(ids)} workers")
        pipes = tuple(tuple(ids[i : i + pp]) for i in range(0, len(ids), pp))
    used = [w for p in pipes for w in p]
    if sorted(used) != sorted(ids) or len(set(used)) != len(used):
        raise SpecError("plan.pipelines: every worker must appear in exactly one pipeline")
    if any(len(p) == 0 or len(p) > n_layers for p in pipes):
        raise SpecError("plan.pipelines: a pipeline needs between 1 and n_layers stages")
    return pipes


def load_spec(path: str | Path) -> JobSpec:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"{p}: {e.strerror}") from e
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise SpecError(f"{p}: {e}") from e
    return parse_spec(data)
