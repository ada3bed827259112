"""The job description as the daemon keeps it: the spec document stored in Redis for the workers,
and measured layer profiles and host capacities folded into the spec the planner sees.

Workers send `profile` events at start-up (each layer alone) and then periodically from training
(docs/worker.md, "Profile"); each worker's newest profile replaces its previous one, so the planner
always sees the mean of the newest measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from chameleond.core.estimator import Estimator
from chameleond.core.plan import Plan
from chameleond.core.spec import HostSpec, JobSpec, LayerProfile, WorkerSpec
from chameleond.protocol import MAX_BYTES, MAX_ID_LEN, MAX_SECONDS, EventError, shorten

LAYER_FIELDS = tuple(f.name for f in fields(LayerProfile))
_NUMERIC = tuple(n for n in LAYER_FIELDS if n != "name")
# Fields a profile may leave out (older workers): the LayerProfile default applies.
_OPTIONAL = frozenset({"update_seconds"})
# Each numeric field of a profile's layer: its name, its bound, whether it is seconds (a float;
# the others are whole bytes), its default when it may be left out (None: it may not).
_CHECKS = tuple(
    (n, MAX_SECONDS if n.endswith("seconds") else MAX_BYTES, n.endswith("seconds"),
     getattr(LayerProfile, n) if n in _OPTIONAL else None)
    for n in _NUMERIC
)  # fmt: skip
_NUMBERS = (int, float)
MAX_CORES = 1e6  # a host report's cores


def spec_document(spec: JobSpec) -> dict[str, Any]:
    """The spec in its file format (parse_spec(spec_document(s)) == s), stored as JSON under
    chameleon:{job}:spec so every worker builds the same model."""
    pipelines = [list(p) for p in spec.layout]
    return {
        "job": {
            "name": spec.name,
            "mtbf_prior_seconds": spec.mtbf_prior_seconds,
            "rebuild_seconds": spec.rebuild_seconds,
            "restart_seconds": spec.restart_seconds,
        },
        "workers": [_worker_document(w) for w in spec.workers],
        "links": {"intra_host": asdict(spec.intra_host), "inter_host": asdict(spec.inter_host)},
        "model": {"layers": [asdict(layer) for layer in spec.layers], "arch": dict(spec.arch)},
        "training": asdict(spec.training),
        "plan": {"pipelines": pipelines},
        "search": asdict(spec.search),
        "hosts": {h: asdict(v) for h, v in sorted(spec.hosts.items())},
        "costs": asdict(spec.costs),
    }


def _worker_document(worker: WorkerSpec) -> dict[str, Any]:
    """A `[[workers]]` entry; `speed` only where it is not the default 1.0 (built field by field:
    asdict took 240 ms for 8,192 workers, on the daemon's event loop)."""
    d: dict[str, Any] = {"id": worker.id, "host": worker.host,
                         "memory_bytes": worker.memory_bytes, "device": worker.device}  # fmt: skip
    if worker.speed != 1.0:
        d["speed"] = worker.speed
    return d


def parse_profile(data: Mapping[str, Any], n_layers: int) -> dict[int, LayerProfile]:
    """A worker's `profile` event: {"layers": [{LayerProfile fields, optional "index"}, ...]}.

    Without "index" an entry's position is its layer index, so a worker that profiled the whole
    model sends a plain list; one that profiled only its stage names the layers it measured.
    """
    out: dict[int, LayerProfile] = {}
    layers = data.get("layers")
    if not isinstance(layers, list):
        raise EventError("profile: 'layers' must be a list")
    if len(layers) > max(n_layers, 1):
        raise EventError(f"profile: {len(layers)} layers listed, the job has {n_layers}")
    for pos, item in enumerate(layers):
        if not isinstance(item, Mapping):
            raise EventError(f"profile: layers[{pos}] must be an object")
        index = item.get("index", pos)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_layers:
            raise EventError(f"profile: layers[{pos}].index {index!r} is not in 0..{n_layers - 1}")
        values: list[Any] = [shorten(str(item.get("name", f"layer{index}")), 128)]
        for name, bound, seconds, default in _CHECKS:
            v = item.get(name, default)
            # JSON's numbers: a bool is none. A NaN or an infinity fails the range (a comparison
            # with a NaN is false), and so does an integer of hundreds of digits, unconverted.
            if type(v) not in _NUMBERS or not 0 <= v <= bound:
                raise EventError(
                    f"profile: layers[{pos}].{name} must be a number in 0..{bound:g}, "
                    f"got {shorten(repr(v), 64)}"
                )
            values.append(v if seconds else int(v))
        out[index] = LayerProfile(*values)
    return out


def measured_layers(
    base: Sequence[LayerProfile],
    profiles: Sequence[Mapping[int, LayerProfile]],
    speeds: Sequence[float] | None = None,
) -> tuple[LayerProfile, ...]:
    """Per layer, the mean over the workers that measured it; the spec's numbers elsewhere.

    `speeds` (one per profile, 1.0 for a healthy worker) normalises each worker's seconds to a
    healthy worker's: a worker at speed 0.5 measured twice the time, so its seconds count half.
    A slow worker's speed goes to the planner separately (WorkerSpec.speed); its layer figures
    must not inflate everybody's."""
    factors = list(speeds) if speeds is not None else [1.0] * len(profiles)
    out = []
    for i, layer in enumerate(base):
        seen = [_scaled(p[i], f) for p, f in zip(profiles, factors, strict=True) if i in p]
        if not seen:
            out.append(layer)
            continue
        n = len(seen)
        out.append(
            LayerProfile(
                name=layer.name,
                forward_seconds=sum(s.forward_seconds for s in seen) / n,
                backward_seconds=sum(s.backward_seconds for s in seen) / n,
                param_bytes=round(sum(s.param_bytes for s in seen) / n),
                optimizer_bytes=round(sum(s.optimizer_bytes for s in seen) / n),
                activation_bytes=round(sum(s.activation_bytes for s in seen) / n),
                output_bytes=round(sum(s.output_bytes for s in seen) / n),
                update_seconds=sum(s.update_seconds for s in seen) / n,
            )
        )
    return tuple(out)


def _scaled(p: LayerProfile, speed: float) -> LayerProfile:
    if speed == 1.0:
        return p
    return replace(p, forward_seconds=p.forward_seconds * speed,
                   backward_seconds=p.backward_seconds * speed,
                   update_seconds=p.update_seconds * speed)  # fmt: skip


def profile_to_json(profile: Mapping[int, LayerProfile]) -> list[dict[str, Any]]:
    return [
        {"index": i, **{k: getattr(p, k) for k in LAYER_FIELDS}} for i, p in sorted(profile.items())
    ]


def profile_from_json(items: Sequence[Mapping[str, Any]]) -> dict[int, LayerProfile]:
    return {
        int(d["index"]): LayerProfile(**{k: d[k] for k in LAYER_FIELDS if k in d}) for d in items
    }


@dataclass(frozen=True)
class HostReport:
    """A CPU worker's view of its host: the cores it may use, the cores the job's workers on it
    keep busy (its own CPU share times the number of them, measured while they compete), and,
    from training, its CPU per step beyond its layers."""

    host: str
    cores: float
    busy_cores: float
    step_cpu_seconds: float | None = None


def _positive(raw: Mapping[str, Any], key: str, *, zero: bool = False) -> float:
    v: Any = raw.get(key)
    # The bounds first: NaN and inf fail them, and an integer too large for a float never
    # reaches a conversion.
    number = isinstance(v, int | float) and not isinstance(v, bool)
    if not number or not 0 <= v <= MAX_CORES or (v == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise EventError(f"profile: host.{key} must be a number {bound}, got {v!r}")
    return float(v)


def parse_host_report(data: Mapping[str, Any]) -> HostReport | None:
    """The optional `host` object of a `profile` event: {"name", "cores", "busy_cores",
    optional "step_cpu_seconds"}."""
    raw = data.get("host")
    if raw is None:
        return None
    name = raw.get("name") if isinstance(raw, Mapping) else None
    if not isinstance(name, str) or not 0 < len(name) <= MAX_ID_LEN:
        raise EventError(f"profile: 'host' must be an object with a 'name' (<= {MAX_ID_LEN})")
    step = _positive(raw, "step_cpu_seconds", zero=True) if "step_cpu_seconds" in raw else None
    return HostReport(raw["name"], _positive(raw, "cores"), _positive(raw, "busy_cores"), step)


def fold_host_report(
    spec: JobSpec, report: HostReport, reporters: int, busy_fraction: float = 1.0
) -> JobSpec:
    """The spec with the host's figures moved toward this report.

    A report says how many cores the job's workers on the host got, at most the host's cores:
    while more workers than cores compete, that is the capacity left to the job by everything
    else running there. A plan that keeps only `busy_fraction` of those cores busy (the model's,
    `Estimator.busy_fraction`) got that fraction of them, so the capacity is the report over it.
    Each of the host's `reporters` workers reports in turn, so a weight of 1/reporters keeps a
    running mean over the newest round. `step_cpu_seconds` is folded the same way when the report
    has it (from training); until then the spec's value stands.
    """
    weight = 1.0 / max(1, reporters)
    cores = min(report.cores, report.busy_cores / max(busy_fraction, 1e-3))
    old = spec.hosts.get(report.host)
    if old is None:
        new = HostSpec(cores, report.step_cpu_seconds or 0.0)
    else:
        step = old.step_cpu_seconds
        if report.step_cpu_seconds is not None:
            step += (report.step_cpu_seconds - step) * weight
        new = HostSpec(old.cpu_cores + (cores - old.cpu_cores) * weight, step)
    return replace(spec, hosts={**spec.hosts, report.host: new})


def fold_profile(
    spec: JobSpec, data: Mapping[str, Any], plan: Plan | None, model: JobSpec
) -> tuple[JobSpec, dict[int, LayerProfile], bool]:
    """One `profile` event's data applied to the job's base spec: (the spec with its host report
    folded in, the worker's layer profile, whether it carried a host report). A host report is a
    running mean over the workers on that host that take part in `plan`, the plan in force (all
    of the spec's workers there before the first plan); one measured on that plan (its
    `generation`) is divided by the plan's busy fraction of the host under `model` (the job's
    spec with the measured layers)."""
    profile = parse_profile(data, len(spec.layers))
    host = parse_host_report(data)
    if host is None:
        return spec, profile, False
    on_host = [w.id for w in spec.workers if w.host == host.host]
    fraction = 1.0
    if plan is not None:
        on_host = [w for w in on_host if w in plan.workers]
        if data.get("generation") == plan.generation:
            fraction = _busy_fraction(model, plan).get(host.host, 1.0)
    return fold_host_report(spec, host, len(on_host), fraction), profile, True


def _busy_fraction(model: JobSpec, plan: Plan) -> dict[str, float]:
    try:
        return Estimator(model).busy_fraction(plan.pipelines, plan.routing)
    except KeyError:  # a worker of the plan the spec no longer lists
        return {}
