"""The job description as the daemon keeps it: the spec document stored in Redis for the workers,
and measured layer profiles folded into the spec the planner sees."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

from chameleond.core.spec import JobSpec, LayerProfile
from chameleond.protocol import EventError

LAYER_FIELDS = tuple(f.name for f in fields(LayerProfile))
_NUMERIC = tuple(n for n in LAYER_FIELDS if n != "name")


def spec_document(spec: JobSpec) -> dict[str, Any]:
    """The spec in its file format (parse_spec(spec_document(s)) == s), stored as JSON under
    chameleon:{job}:spec so every worker builds the same model."""
    pipelines = [list(p) for p in spec.layout]
    return {
        "job": {
            "name": spec.name,
            "mtbf_prior_seconds": spec.mtbf_prior_seconds,
            "rebuild_seconds": spec.rebuild_seconds,
        },
        "workers": [asdict(w) for w in spec.workers],
        "links": {"intra_host": asdict(spec.intra_host), "inter_host": asdict(spec.inter_host)},
        "model": {"layers": [asdict(layer) for layer in spec.layers], "arch": dict(spec.arch)},
        "training": asdict(spec.training),
        "plan": {"pipelines": pipelines},
        "search": asdict(spec.search),
    }


def parse_profile(data: Mapping[str, Any], n_layers: int) -> dict[int, LayerProfile]:
    """A worker's `profile` event: {"layers": [{LayerProfile fields, optional "index"}, ...]}.

    Without "index" an entry's position is its layer index, so a worker that profiled the whole
    model sends a plain list; one that profiled only its stage names the layers it measured.
    """
    out: dict[int, LayerProfile] = {}
    layers = data.get("layers")
    if not isinstance(layers, list):
        raise EventError("profile: 'layers' must be a list")
    for pos, item in enumerate(layers):
        if not isinstance(item, Mapping):
            raise EventError(f"profile: layers[{pos}] must be an object")
        index = item.get("index", pos)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_layers:
            raise EventError(f"profile: layers[{pos}].index {index!r} is not in 0..{n_layers - 1}")
        values: dict[str, Any] = {"name": str(item.get("name", f"layer{index}"))}
        for name in _NUMERIC:
            v: Any = item.get(name)
            number = isinstance(v, int | float) and not isinstance(v, bool)
            if not number or not math.isfinite(v) or v < 0:
                raise EventError(f"profile: layers[{pos}].{name} must be a number >= 0, got {v!r}")
            values[name] = v if name.endswith("seconds") else int(v)
        out[index] = LayerProfile(**values)
    return out


def measured_layers(
    base: Sequence[LayerProfile], profiles: Sequence[Mapping[int, LayerProfile]]
) -> tuple[LayerProfile, ...]:
    """Per layer, the mean over the workers that measured it; the spec's numbers elsewhere."""
    out = []
    for i, layer in enumerate(base):
        seen = [p[i] for p in profiles if i in p]
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
            )
        )
    return tuple(out)


def profile_to_json(profile: Mapping[int, LayerProfile]) -> list[dict[str, Any]]:
    return [{"index": i, **asdict(p)} for i, p in sorted(profile.items())]


def profile_from_json(items: Sequence[Mapping[str, Any]]) -> dict[int, LayerProfile]:
    return {int(d["index"]): LayerProfile(**{k: d[k] for k in LAYER_FIELDS}) for d in items}
