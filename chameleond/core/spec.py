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

from chameleond.core.fields import (
    SpecError,
    array,
    integer,
    kind,
    naming,
    num,
    required,
    table,
    text,
)
from chameleond.core.hostlist import hosts_form


@dataclass(frozen=True)
class WorkerSpec:
    id: str
    host: str
    memory_bytes: int
    device: str = "cpu"
    # Relative compute speed: 0.5 = its layers take twice as long (a throttled device). The
    # daemon replaces it with the speed it measures (a fail-slow worker).
    speed: float = 1.0


def backend_of(device: str) -> str:
    """The collective backend a worker on `device` builds its groups with (as
    chameleond/worker/_backend.py picks it): nccl on `cuda:N`, hccl on `npu:N`, gloo otherwise."""
    return {"cuda": "nccl", "npu": "hccl"}.get(device.partition(":")[0], "gloo")


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
    global_batch: int  # B samples per step; plans keep it unless a drop plan trains fewer
    micro_batch: int  # samples per micro-batch
    # The gradient all-reduce of a stage starts once that stage's last backward is done, while
    # upstream stages still compute (bucketed all-reduce, as GPU frameworks do). False: the sync
    # starts after the whole pipeline (the CPU workers of this project).
    overlap_sync: bool = False
    # The fewest samples a step may train: a drop plan (core.drop) leaves the pipelines that lost
    # a worker out and trains the others' samples only. 0 means global_batch: the batch is fixed.
    min_global_batch: int = 0

    def __post_init__(self) -> None:
        if self.min_global_batch == 0:
            object.__setattr__(self, "min_global_batch", self.global_batch)

    @property
    def fixed_batch(self) -> bool:
        """Every step trains global_batch samples (no drop plan)."""
        return self.min_global_batch >= self.global_batch

    @property
    def micro_batches(self) -> int:
        """Global micro-batches per step (over all pipelines)."""
        return self.global_batch // self.micro_batch


@dataclass(frozen=True)
class SearchLimits:
    """Bounds on the plan search: allowed pipeline lengths (stages per pipeline)."""

    min_stages: int = 1
    max_stages: int = 64
    # Whether a layout may leave survivors idle as spares when it steps faster (core.search).
    spares: bool = True


@dataclass(frozen=True)
class CostSpec:
    """Prices of what a transition does beyond the step model (`[costs]`, docs/spec.md)."""

    # Modelled search time per plan considered; 0 when the search is precomputed (hidden).
    search_seconds_per_plan: float = 1e-6
    # Bytes per second one host's network interface carries each way; 0: the inter-host link's
    # bandwidth (one link's worth per host). Bounds every migration round by what each host
    # sends and receives across hosts.
    host_nic_bytes_per_second: float = 0.0
    # Bytes per second one worker reads a checkpoint from storage (a restore's load).
    checkpoint_read_bytes_per_second: float = 2.0e9


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
    # Expected seconds to build communicators for a new plan (paid by every policy). The prior:
    # the daemon plans with the rebuild its workers measured once they have (Job.spec).
    rebuild_seconds: float = 0.05
    # Seconds from a fault that loses the last copy of some layer's state to training again:
    # a restart from checkpoint, with the work since it (the selector's risk term).
    restart_seconds: float = 600.0
    # The model's architecture for the workers (d_model, heads, blocks, seq_len, vocab, seed, lr);
    # opaque to the planner, which only sees `layers`.
    arch: Mapping[str, Any] = field(default_factory=dict)
    # Hosts whose CPU cores the workers share (`[hosts.NAME]`, or `cpu_cores` in `[[hosts]]`;
    # measured by CPU workers). Where a host is listed, its workers' summed CPU work per step
    # bounds the step from below.
    hosts: Mapping[str, HostSpec] = field(default_factory=dict)
    costs: CostSpec = field(default_factory=CostSpec)

    def nic_bytes_per_second(self) -> float:
        """What one host's interface carries each way (`costs.host_nic_bytes_per_second`)."""
        nic = self.costs.host_nic_bytes_per_second
        return nic if nic > 0 else self.inter_host.bandwidth_bytes_per_second

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

    def with_speeds(self, speeds: Mapping[str, float]) -> JobSpec:
        """The same job with these workers' compute speeds (the others keep theirs)."""
        workers = [replace(w, speed=speeds.get(w.id, w.speed)) for w in self.workers]
        return self.with_workers(workers)


def _link(d: Any, where: str) -> LinkSpec:
    d = table(d, where)
    return LinkSpec(
        bandwidth_bytes_per_second=num(d, "bandwidth_bytes_per_second", where),
        latency_seconds=num(d, "latency_seconds", where, positive=False),
    )


def _layer(d: Mapping[str, Any], i: int, where: str) -> LayerProfile:
    name = d.get("name", f"layer{i}")
    if not isinstance(name, str):
        raise SpecError(f"{where}.name: expected a string, got {kind(name)}")
    return LayerProfile(
        name=name,
        forward_seconds=num(d, "forward_seconds", where, positive=False),
        backward_seconds=num(d, "backward_seconds", where, positive=False),
        param_bytes=integer(d, "param_bytes", where, minimum=0),
        optimizer_bytes=integer(d, "optimizer_bytes", where, minimum=0),
        activation_bytes=integer(d, "activation_bytes", where, minimum=0),
        output_bytes=integer(d, "output_bytes", where, minimum=0),
        update_seconds=num(d, "update_seconds", where, positive=False, default=0.0),
    )


def _layers(model: Mapping[str, Any]) -> tuple[LayerProfile, ...]:
    """Either an explicit `layers` list, or `repeat` blocks: [{count=N, ...layer fields}]."""
    out: list[LayerProfile] = []
    for j, d in enumerate(array(model.get("layers", []), "model.layers")):
        where = f"model.layers[{j}]"
        d = table(d, where)
        count = integer(d, "count", where, default=1)
        for _ in range(count):
            out.append(_layer(d, len(out), where))
    if not out:
        raise SpecError("model.layers: at least one layer is required")
    return tuple(out)


MAX_SPEED = 1e3


def _worker(w: Any, where: str) -> WorkerSpec:
    w = table(w, where)
    speed = num(w, "speed", where, default=1.0)
    if speed > MAX_SPEED:
        raise SpecError(f"{where}.speed: must be <= {MAX_SPEED:g}, got {w['speed']!r}")
    return WorkerSpec(
        id=text(w, "id", where),
        host=text(w, "host", where, "localhost"),
        memory_bytes=integer(w, "memory_bytes", where),
        device=text(w, "device", where, "cpu"),
        speed=speed,
    )


def _workers(d: Mapping[str, Any]) -> tuple[list[WorkerSpec], dict[str, HostSpec] | None]:
    """The `workers` list, or the workers of an array of `[[hosts]]` with their hosts' specs
    (chameleond/core/hostlist.py): one form or the other, never both."""
    if isinstance(d.get("hosts"), list | tuple):
        if "workers" in d:
            raise SpecError("workers and [[hosts]]: give one of them, not both")
        workers, hosts = hosts_form(d["hosts"])
        return [WorkerSpec(*w) for w in workers], {h: HostSpec(*c) for h, c in hosts.items()}
    if "workers" not in d:
        raise SpecError("spec: missing required field 'workers' (or [[hosts]] entries)")
    workers_raw = array(d["workers"], "workers")
    if not workers_raw:
        raise SpecError("workers: expected a non-empty list")
    return [_worker(w, f"workers[{i}]") for i, w in enumerate(workers_raw)], None


def _hosts(hosts: Any) -> dict[str, HostSpec]:
    out: dict[str, HostSpec] = {}
    for h, v in table(hosts, "hosts").items():
        where = f"hosts.{h}"
        v = table(v, where)
        out[str(h)] = HostSpec(
            cpu_cores=num(v, "cpu_cores", where),
            step_cpu_seconds=num(v, "step_cpu_seconds", where, positive=False, default=0.0),
        )
    return out


def _costs(d: Any) -> CostSpec:
    d = table(d, "costs")
    known = {f for f in CostSpec.__dataclass_fields__}
    unknown = sorted(set(d) - known)
    if unknown:
        raise SpecError(f"costs: unknown field(s) {', '.join(unknown)}")
    base = CostSpec()
    return CostSpec(
        search_seconds_per_plan=num(
            d, "search_seconds_per_plan", "costs", positive=False,
            default=base.search_seconds_per_plan,
        ),
        host_nic_bytes_per_second=num(
            d, "host_nic_bytes_per_second", "costs", positive=False,
            default=base.host_nic_bytes_per_second,
        ),
        checkpoint_read_bytes_per_second=num(
            d, "checkpoint_read_bytes_per_second", "costs",
            default=base.checkpoint_read_bytes_per_second,
        ),
    )  # fmt: skip


def _search(lim: Any) -> SearchLimits:
    lim = table(lim, "search")
    limits = SearchLimits(
        min_stages=integer(lim, "min_stages", "search", default=SearchLimits.min_stages),
        max_stages=integer(lim, "max_stages", "search", default=SearchLimits.max_stages),
        spares=lim.get("spares", SearchLimits.spares),
    )
    if not isinstance(limits.spares, bool):
        raise SpecError(f"search.spares: expected true or false, got {limits.spares!r}")
    if limits.min_stages > limits.max_stages:
        raise SpecError(
            f"search: min_stages {limits.min_stages} is above max_stages {limits.max_stages}"
        )
    return limits


def parse_spec(d: Mapping[str, Any]) -> JobSpec:
    """Build a JobSpec from a decoded TOML/JSON mapping, validating every field."""
    if not isinstance(d, Mapping):
        raise SpecError("spec: expected a table/object at the top level")
    with naming("job"):
        job = table(d.get("job", {}), "job")
        name = text(job, "name", "job", "default")
        mtbf = num(job, "mtbf_prior_seconds", "job", default=JobSpec.mtbf_prior_seconds)
        rebuild = num(
            job, "rebuild_seconds", "job", positive=False, default=JobSpec.rebuild_seconds
        )
        restart = num(
            job, "restart_seconds", "job", positive=False, default=JobSpec.restart_seconds
        )
    with naming("workers"):
        workers, generated_hosts = _workers(d)
    ids = [w.id for w in workers]
    if len(set(ids)) != len(ids):
        raise SpecError("workers: duplicate worker id")
    with naming("links"):
        links = table(required(d, "links", "spec"), "links")
        intra = _link(required(links, "intra_host", "links"), "links.intra_host")
        inter = _link(required(links, "inter_host", "links"), "links.inter_host")
    with naming("model"):
        model = table(required(d, "model", "spec"), "model")
        layers = _layers(model)
        arch = dict(table(model.get("arch", {}), "model.arch"))
    with naming("training"):
        tr = table(required(d, "training", "spec"), "training")
        overlap = tr.get("overlap_sync", False)
        if not isinstance(overlap, bool):
            raise SpecError(f"training.overlap_sync: expected true or false, got {kind(overlap)}")
        training = TrainingSpec(
            global_batch=integer(tr, "global_batch", "training"),
            micro_batch=integer(tr, "micro_batch", "training"),
            overlap_sync=overlap,
            min_global_batch=integer(tr, "min_global_batch", "training", default=0),
        )
    if training.global_batch % training.micro_batch:
        raise SpecError("training: global_batch must be a multiple of micro_batch")
    _check_min_batch(training)
    with naming("plan"):
        layout = _layout(table(d.get("plan", {}), "plan"), ids, len(layers))
    if training.micro_batches < len(layout):
        raise SpecError(
            f"training: {training.micro_batches} micro-batches cannot feed {len(layout)} pipelines"
        )
    with naming("search"):
        search = _search(d.get("search", {}))
    with naming("hosts"):
        hosts = _hosts(d.get("hosts", {})) if generated_hosts is None else generated_hosts
    with naming("costs"):
        costs = _costs(d.get("costs", {}))
    return JobSpec(
        name=name,
        workers=tuple(workers),
        intra_host=intra,
        inter_host=inter,
        layers=layers,
        training=training,
        layout=layout,
        mtbf_prior_seconds=mtbf,
        search=search,
        rebuild_seconds=rebuild,
        restart_seconds=restart,
        arch=arch,
        hosts=hosts,
        costs=costs,
    )


def _check_min_batch(training: TrainingSpec) -> None:
    least, most, mb = training.min_global_batch, training.global_batch, training.micro_batch
    if least % mb:
        raise SpecError(
            f"training.min_global_batch: {least} is not a multiple of micro_batch ({mb})"
        )
    if least > most:
        raise SpecError(f"training.min_global_batch: {least} exceeds global_batch ({most})")


def _layout(plan: Mapping[str, Any], ids: list[str], n_layers: int) -> tuple[tuple[str, ...], ...]:
    """`plan.pipelines` lists worker ids per pipeline; else `plan.stages` = N_pp splits in order."""
    if "pipelines" in plan:
        pipes_raw = array(plan["pipelines"], "plan.pipelines")
        pipes = tuple(tuple(array(p, f"plan.pipelines[{i}]")) for i, p in enumerate(pipes_raw))
        if any(not isinstance(w, str) for p in pipes for w in p):
            raise SpecError("plan.pipelines: expected lists of worker ids (strings)")
    else:
        pp = integer(plan, "stages", "plan", default=1)
        if len(ids) % pp:
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
