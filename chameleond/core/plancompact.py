"""The plan's document in the form every worker reads (Keys.plan_packed): the same document, less
what the rest of it already says. Plain data in, plain data out.

A re-partition's plan at 8,192 devices is 1.5 MB of JSON, 190 KB zlib-packed, and every worker
reads it: 1.5 GB out of the job's one Redis. Most of it says the same things again:
- the routing names a slot's owner once per micro-batch when the owner runs them all (every slot
  of a plan but a rerouting one's);
- a sync group's workers are the owners of its layers, less the excluded
  (core.restorer.sync_groups);
- the peak memory of every worker is one figure per stage;
- the workers' names (thousands of them, in the stages and again in the migration) follow their
  hosts' numbering, which zlib cannot see.

`compact(doc)` says each once:
- `owners`: every stage's worker, pipeline by pipeline, in stage order, as runs: a name, or
  [prefix, first, count] for the names prefix + first, prefix + (first + 1), ...
  (w0, w1, w2 is ["w", 0, 3]; a number is written without leading zeros);
- `pipelines`: [first_micro_batch, micro_batches, [first_layer, end_layer, ...]], its stages'
  workers the next names of `owners`;
- `migration`: [src, dst, layers, nbytes, round]; a worker of `owners` is a number, from its
  place in `owners` (its first stage): dst the distance from the place of the last dst given as
  a number (from 0), src the distance from dst's place; a dst not in `owners` is a name, and so is
  its src, as is a src not in `owners`;
- `routing_except`: [[pipeline, stage, executors], ...], only the slots whose executors are not
  their owner alone;
- a sync group that lists exactly its layers' owners keeps only its layers and round;
- `estimates.stage_peak_memory_bytes`: the peak of each name in `owners`, in order (a worker that
  owns no stage keeps its entry in `peak_memory_bytes`).
`"form": "compact"` marks it. `expand` makes the document again, equal to the one compacted, so its
signature and digest (made over the whole document's canonical JSON) verify as they were made. A
document without the mark is returned as it is (a plan packed whole still reads), and one whose
parts have fields the form does not know is not compacted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from chameleond.core.plan import PlanError

FORM = "compact"
# The most names and routing slots a compact plan may expand to: a few bytes of runs or
# micro-batch counts must not make a reader build more than a whole plan could hold (the
# re-partition at 8,192 devices expands to 8,175 names and about 80,000 routing slots).
MAX_EXPANDED = 4_000_000

_STAGE = {"worker", "first_layer", "end_layer"}
_PIPELINE = {"stages", "first_micro_batch", "micro_batches"}
_TRANSFER = {"src", "dst", "layers", "nbytes", "round"}
_DIGITS = "0123456789"
_ADDED = ("form", "owners", "routing_except")  # the compact form's own top-level fields


def compact(doc: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` less what its pipelines say; a copy of `doc` when its parts are not the plan's
    (a malformed plan is refused by its readers, not here)."""
    if not _regular(doc):
        return dict(doc)
    pipes = doc["pipelines"]
    seq = [st["worker"] for p in pipes for st in p["stages"]]
    place: dict[str, int] = {}
    for i, w in enumerate(seq):
        place.setdefault(w, i)
    out = {k: v for k, v in doc.items() if k != "routing"}
    out["form"] = FORM
    out["owners"] = runs(seq)
    out["pipelines"] = [
        [p["first_micro_batch"], p["micro_batches"],
         [x for st in p["stages"] for x in (st["first_layer"], st["end_layer"])]]
        for p in pipes
    ]  # fmt: skip
    out["routing_except"] = [
        [i, s, list(row)]
        for i, (p, rows) in enumerate(zip(pipes, doc["routing"], strict=True))
        for s, (st, row) in enumerate(zip(p["stages"], rows, strict=True))
        if len(row) != p["micro_batches"] or list(row).count(st["worker"]) != len(row)
    ]
    migration, base = [], 0
    for t in doc["migration"]:
        dst = place.get(t["dst"])
        src = place.get(t["src"])
        moved = [
            t["src"] if src is None or dst is None else src - dst,
            t["dst"] if dst is None else dst - base,
            list(t["layers"]), t["nbytes"], t["round"],
        ]  # fmt: skip
        base = base if dst is None else dst
        migration.append(moved)
    out["migration"] = migration
    implied = _Implied(pipes, doc.get("excluded", ()))
    out["sync_groups"] = [
        {k: v for k, v in g.items() if k != "workers"}
        if implied(g.get("layers")) == list(g["workers"])
        else dict(g)
        for g in doc["sync_groups"]
    ]
    est = doc["estimates"]
    peaks = est["peak_memory_bytes"]
    out["estimates"] = {
        **est,
        "peak_memory_bytes": {w: v for w, v in peaks.items() if w not in place},
        "stage_peak_memory_bytes": [peaks.get(w) for w in seq],
    }
    return out


def expand(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The whole document `compact` made `doc` from; `doc` when it is not compact. PlanError
    when a compact document does not expand (a field missing, or of the wrong kind or size)."""
    if doc.get("form") != FORM:
        return doc
    try:
        seq = names(doc["owners"])
        place: dict[str, int] = {}
        for i, w in enumerate(seq):
            place.setdefault(w, i)
        pipes, at = [], 0
        for first, micro, bounds in doc["pipelines"]:
            n = len(bounds) // 2
            if len(bounds) != 2 * n or at + n > len(seq):
                raise ValueError("a pipeline's stages are not its owners' or its layer bounds")
            stages = [
                {"worker": w, "first_layer": first_layer, "end_layer": end_layer}
                for w, first_layer, end_layer in zip(
                    seq[at : at + n], bounds[0::2], bounds[1::2], strict=True
                )
            ]
            pipes.append({"stages": stages, "first_micro_batch": first, "micro_batches": micro})
            at += n
        if at != len(seq):
            raise ValueError(f"owners name {len(seq)} stages, the pipelines {at}")
        cells = sum(len(p["stages"]) * p["micro_batches"] for p in pipes)
        if not 0 <= cells <= MAX_EXPANDED:
            raise ValueError(f"its routing would hold {cells} slots, more than {MAX_EXPANDED}")
        routing = [[[st["worker"]] * p["micro_batches"] for st in p["stages"]] for p in pipes]
        for p, s, row in doc["routing_except"]:
            _at(_at(routing, p), s)[:] = row
        migration, base = [], 0
        for src, dst, layers, nbytes, rnd in doc["migration"]:
            if isinstance(dst, int):
                base = base + dst
                dst_name = _at(seq, base)
                src_name = _at(seq, base + src) if isinstance(src, int) else src
            else:
                dst_name, src_name = dst, src
            if not isinstance(src_name, str) or not isinstance(dst_name, str):
                raise ValueError("a transfer's workers are neither places nor names")
            migration.append({"src": src_name, "dst": dst_name, "layers": layers,
                              "nbytes": nbytes, "round": rnd})  # fmt: skip
        implied = _Implied(pipes, doc.get("excluded", ()))
        groups = [
            g if "workers" in g else {**g, "workers": implied(g["layers"])}
            for g in doc["sync_groups"]
        ]
        est = doc["estimates"]
        staged = est["stage_peak_memory_bytes"]
        if len(staged) != len(seq):
            raise ValueError(f"{len(staged)} stage peaks for {len(seq)} stages")
        peaks = {w: v for w, v in zip(seq, staged, strict=True) if v is not None}
        peaks.update(est["peak_memory_bytes"])
        rest = {k: v for k, v in est.items() if k != "stage_peak_memory_bytes"}
        out = {k: v for k, v in doc.items() if k not in _ADDED}
        out.update(pipelines=pipes, routing=routing, migration=migration, sync_groups=groups,
                   estimates={**rest, "peak_memory_bytes": peaks})  # fmt: skip
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise PlanError(f"compact plan does not expand: {type(e).__name__}: {e}") from e
    return out


def _at(seq: Sequence[Any], i: int) -> Any:
    """seq[i], for 0 <= i < len(seq) only (a negative place is an error, not one from the end)."""
    if not isinstance(i, int) or not 0 <= i < len(seq):
        raise IndexError(f"place {i!r} is outside 0-{len(seq) - 1}")
    return seq[i]


def runs(seq: Sequence[str]) -> list[Any]:
    """`seq` as runs: a name, or [prefix, first, count] for prefix + str(first + i), i < count."""
    out: list[Any] = []
    last: list[Any] = [None, -1, 0]
    for name in seq:
        prefix = name.rstrip(_DIGITS)
        digits = name[len(prefix) :]
        if not digits or (digits[0] == "0" and len(digits) > 1):
            out.append(name)
            last = [None, -1, 0]
            continue
        k = int(digits)
        if last[0] == prefix and last[1] + last[2] == k:
            last[2] += 1
        else:
            last = [prefix, k, 1]
            out.append(last)
    return out


def names(runs_: Sequence[Any]) -> list[str]:
    """The names `runs` made `runs_` of."""
    out: list[str] = []
    for r in runs_:
        if isinstance(r, str):
            out.append(r)
        else:
            prefix, first, count = r
            if not isinstance(prefix, str) or not isinstance(first, int) or first < 0:
                raise ValueError(f"a run of names is not [prefix, first, count]: {r!r}")
            if not isinstance(count, int) or not 0 <= count <= MAX_EXPANDED - len(out):
                raise ValueError(f"the runs name more than {MAX_EXPANDED} stages")
            out.extend(f"{prefix}{first + i}" for i in range(count))
    return out


def _regular(doc: Mapping[str, Any]) -> bool:
    """Whether `doc`'s parts have the fields of a plan's and no others, and its routing the
    shape of its pipelines: what `expand` makes again exactly."""
    try:
        pipes, routing = doc["pipelines"], doc["routing"]
        est = doc["estimates"]
        peaks = est["peak_memory_bytes"]
        if len(routing) != len(pipes) or not isinstance(peaks, Mapping):
            return False
        if any(k in doc for k in _ADDED) or "stage_peak_memory_bytes" in est:
            return False  # names the compact form gives a meaning
        if not all(isinstance(v, int) for v in peaks.values()):
            return False
        for p, rows in zip(pipes, routing, strict=True):
            if p.keys() != _PIPELINE or len(rows) != len(p["stages"]):
                return False
            if not isinstance(p["micro_batches"], int):
                return False
            for st in p["stages"]:
                if st.keys() != _STAGE or not isinstance(st["worker"], str):
                    return False
                if not isinstance(st["first_layer"], int) or not isinstance(st["end_layer"], int):
                    return False
        for t in doc["migration"]:
            if t.keys() != _TRANSFER or not isinstance(t["layers"], list | tuple):
                return False
            if not isinstance(t["src"], str) or not isinstance(t["dst"], str):
                return False
        return all(isinstance(g, Mapping) and "workers" in g for g in doc["sync_groups"])
    except (KeyError, TypeError, ValueError):
        return False


class _Implied:
    """A sync group's workers as core.restorer.sync_groups makes them: the sorted owners of its
    first layer, less the excluded (None: no layers, or no stage holds the first)."""

    def __init__(self, pipes: Sequence[Mapping[str, Any]], excluded: Sequence[str]) -> None:
        self._pipes = pipes
        self._excluded = set(excluded)
        self._spans: dict[tuple[Any, Any], set[str]] | None = None  # made on the first group

    def __call__(self, layers: object) -> list[str] | None:
        if not isinstance(layers, Sequence) or not layers or not isinstance(layers[0], int):
            return None
        if self._spans is None:
            spans: dict[tuple[Any, Any], set[str]] = {}  # a stage's layers -> their owners
            for p in self._pipes:
                for st in p["stages"]:
                    span = (st["first_layer"], st["end_layer"])
                    found = spans.get(span)
                    if found is None:
                        found = spans[span] = set()
                    found.add(st["worker"])
            self._spans = spans
        layer = layers[0]
        owners = [ws for (first, end), ws in self._spans.items() if first <= layer < end]
        return sorted(set().union(*owners) - self._excluded) if owners else None
