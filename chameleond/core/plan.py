"""The plan: versioned, JSON-serialisable data that the workers execute (docs/plan.md).

A plan names, for one generation, the pipelines (stages -> owning worker and layer range), which
global micro-batches each pipeline trains, the routing table (who executes each stage's micro-batch:
the owner, or under rerouting a same-stage peer), the migration manifest and the gradient sync
groups, each in colouring rounds, and the model's estimates. Generations strictly increase per job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from chameleond.core.policy import Policy
from chameleond.core.spec import TrainingSpec

POLICIES = tuple(p.value for p in Policy)


class PlanError(ValueError):
    """A plan document does not decode; the message names the field."""


@dataclass(frozen=True)
class Stage:
    worker: str  # the slot's owner: holds parameters and optimizer state of `layers`
    first_layer: int
    end_layer: int  # exclusive

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    first_micro_batch: int  # global micro-batch index
    micro_batches: int  # N_m for this pipeline

    @property
    def micro_batch_ids(self) -> range:
        return range(self.first_micro_batch, self.first_micro_batch + self.micro_batches)


@dataclass(frozen=True)
class Transfer:
    """Parameters + optimizer state of `layers`, sent once from a surviving replica."""

    src: str
    dst: str
    layers: tuple[int, ...]
    nbytes: int
    round: int


@dataclass(frozen=True)
class SyncGroup:
    """Workers that own the same layers all-reduce those layers' gradients together."""

    workers: tuple[str, ...]
    layers: tuple[int, ...]
    round: int


@dataclass(frozen=True)
class Estimates:
    step_seconds: float
    transition_seconds: float
    score: float  # samples/s averaged over the expected fault-to-fault window
    mtbf_seconds: float  # D used for the score
    peak_memory_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    job: str
    generation: int
    policy: Policy
    global_batch: int
    micro_batch: int
    pipelines: tuple[Pipeline, ...]
    # routing[p][s][i] = worker executing stage s of pipeline p for its i-th micro-batch
    routing: tuple[tuple[tuple[str, ...], ...], ...]
    migration: tuple[Transfer, ...]
    sync_groups: tuple[SyncGroup, ...]
    estimates: Estimates
    excluded: tuple[str, ...] = ()  # failed or fenced workers: must not run this plan
    cause: str = ""
    # policy "restore": some layer lost every copy, so every worker of the plan loads its layers
    # from the job's checkpoint of this step and training resumes after it (docs/plan.md)
    restore_step: int | None = None

    @cached_property
    def workers(self) -> tuple[str, ...]:
        """Every worker that executes something under this plan, sorted (found once: the plan
        is frozen)."""
        ws = {w for pipe in self.routing for stage in pipe for w in stage}
        ws |= {t.dst for t in self.migration}
        return tuple(sorted(ws))

    @cached_property
    def excluded_set(self) -> frozenset[str]:
        return frozenset(self.excluded)

    @cached_property
    def members(self) -> frozenset[str]:
        """The workers that run this plan: its workers less the excluded."""
        return frozenset(self.workers) - self.excluded_set

    def owned_layers(self, worker: str) -> tuple[int, ...]:
        """Layers whose state `worker` holds after this plan's migration."""
        return tuple(
            sorted(
                {
                    layer
                    for pipe in self.pipelines
                    for st in pipe.stages
                    if st.worker == worker
                    for layer in st.layers
                }
            )
        )

    @property
    def samples_per_second(self) -> float:
        step = self.estimates.step_seconds
        return self.global_batch / step if step else 0.0


def executors(routing: Sequence[Sequence[Sequence[str]]]) -> frozenset[str]:
    """Every worker that executes some micro-batch of some stage."""
    last = _EXECUTORS[0]
    if last is not None and last[0] is routing:
        return last[1]
    out: set[str] = set()
    for pipe in routing:
        for stage in pipe:
            if stage and stage.count(stage[0]) == len(stage):  # the owner runs them all
                out.add(stage[0])
            else:
                out.update(stage)
    found = frozenset(out)
    if isinstance(routing, tuple):  # immutable: the step's parts ask for the same routing
        _EXECUTORS[0] = (routing, found)
    return found


# The last routing asked about and its executors (one reference, replaced whole).
_EXECUTORS: list[tuple[Sequence[Sequence[Sequence[str]]], frozenset[str]] | None] = [None]


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan's document: what `dataclasses.asdict` makes of it, built field by field (asdict
    deep-copies every leaf: 160 ms for the 8,192-device plan, where this takes a tenth)."""
    est = plan.estimates
    return {
        "job": plan.job,
        "generation": plan.generation,
        "policy": plan.policy,
        "global_batch": plan.global_batch,
        "micro_batch": plan.micro_batch,
        "pipelines": tuple(
            {
                "stages": tuple(
                    {"worker": s.worker, "first_layer": s.first_layer, "end_layer": s.end_layer}
                    for s in p.stages
                ),
                "first_micro_batch": p.first_micro_batch,
                "micro_batches": p.micro_batches,
            }
            for p in plan.pipelines
        ),
        "routing": tuple(tuple(tuple(stage) for stage in pipe) for pipe in plan.routing),
        "migration": tuple(
            {
                "src": t.src,
                "dst": t.dst,
                "layers": tuple(t.layers),
                "nbytes": t.nbytes,
                "round": t.round,
            }
            for t in plan.migration
        ),
        "sync_groups": tuple(
            {"workers": tuple(g.workers), "layers": tuple(g.layers), "round": g.round}
            for g in plan.sync_groups
        ),
        "estimates": {
            "step_seconds": est.step_seconds,
            "transition_seconds": est.transition_seconds,
            "score": est.score,
            "mtbf_seconds": est.mtbf_seconds,
            "peak_memory_bytes": dict(est.peak_memory_bytes),
        },
        "excluded": tuple(plan.excluded),
        "cause": plan.cause,
        "restore_step": plan.restore_step,
    }


def plan_from_dict(d: Mapping[str, Any]) -> Plan:
    try:
        name = str(d["policy"])
        if name not in POLICIES:
            raise PlanError(f"policy: {name!r} is not one of {POLICIES}")
        policy = Policy(name)
        est = d["estimates"]
        return Plan(
            job=str(d["job"]),
            generation=int(d["generation"]),
            policy=policy,
            global_batch=int(d["global_batch"]),
            micro_batch=int(d["micro_batch"]),
            pipelines=tuple(
                Pipeline(
                    stages=tuple(
                        Stage(str(s["worker"]), int(s["first_layer"]), int(s["end_layer"]))
                        for s in p["stages"]
                    ),
                    first_micro_batch=_at_least(0, "first_micro_batch", p["first_micro_batch"]),
                    micro_batches=_at_least(1, "micro_batches", p["micro_batches"]),
                )
                for p in d["pipelines"]
            ),
            routing=tuple(
                tuple(tuple(str(w) for w in stage) for stage in pipe) for pipe in d["routing"]
            ),
            migration=tuple(
                Transfer(
                    str(t["src"]),
                    str(t["dst"]),
                    tuple(int(x) for x in t["layers"]),
                    int(t["nbytes"]),
                    int(t["round"]),
                )
                for t in d["migration"]
            ),
            sync_groups=tuple(
                SyncGroup(
                    tuple(str(w) for w in g["workers"]),
                    tuple(int(x) for x in g["layers"]),
                    int(g["round"]),
                )
                for g in d["sync_groups"]
            ),
            estimates=Estimates(
                step_seconds=float(est["step_seconds"]),
                transition_seconds=float(est["transition_seconds"]),
                score=float(est["score"]),
                mtbf_seconds=float(est["mtbf_seconds"]),
                peak_memory_bytes={str(k): int(v) for k, v in est["peak_memory_bytes"].items()},
            ),
            excluded=tuple(str(w) for w in d.get("excluded", ())),
            cause=str(d.get("cause", "")),
            restore_step=_restore_step(policy, d.get("restore_step")),
        )
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PlanError(f"plan does not decode: {type(e).__name__}: {e}") from e


def _restore_step(policy: Policy, value: Any) -> int | None:
    if (policy is Policy.RESTORE) != (value is not None):
        raise PlanError("restore_step: given exactly when the policy is 'restore'")
    if value is None:
        return None
    step = int(value)
    if step < 0:
        raise PlanError(f"restore_step: must be >= 0, got {step}")
    return step


def _at_least(least: int, name: str, value: Any) -> int:
    n = int(value)
    if n < least:
        raise PlanError(f"{name}: must be >= {least}, got {n}")
    return n


def check_batch(plan: Plan, training: TrainingSpec) -> list[str]:
    """What is wrong with the plan's micro-batches and batch for this job; empty when nothing.

    A plan trains each of its pipelines' global micro-batch ids once per step: ids in
    [0, B / micro_batch), none twice. Every id is trained but by a drop plan (core.drop), whose
    dropped pipelines' ids are skipped. `global_batch` is always the samples the plan trains per
    step, at least `training.min_global_batch` (= B when the batch is fixed).
    """
    out: list[str] = []
    if plan.micro_batch != training.micro_batch:
        out.append(f"micro_batch {plan.micro_batch} is not the job's {training.micro_batch}")
    total = training.micro_batches
    trained_by: dict[int, int] = {}
    for p, pipe in enumerate(plan.pipelines):
        for m in pipe.micro_batch_ids:
            if not 0 <= m < total:
                out.append(f"micro-batch {m} is outside 0-{total - 1}")
            elif m in trained_by:
                out.append(f"micro-batch {m} is trained by pipelines {trained_by[m]} and {p}")
            else:
                trained_by[m] = p
    n = sum(pipe.micro_batches for pipe in plan.pipelines)
    if plan.global_batch != n * plan.micro_batch:
        out.append(
            f"global_batch {plan.global_batch} is not the {n} micro-batches of "
            f"{plan.micro_batch} samples its pipelines train ({n * plan.micro_batch})"
        )
    if plan.global_batch < training.min_global_batch:
        out.append(
            f"global_batch {plan.global_batch} is below min_global_batch "
            f"{training.min_global_batch}"
        )
    if len(plan.routing) != len(plan.pipelines):
        out.append(f"routing has {len(plan.routing)} pipelines, the plan {len(plan.pipelines)}")
    for p, (pipe, rows) in enumerate(zip(plan.pipelines, plan.routing, strict=False)):
        for s, row in enumerate(rows):
            if len(row) != pipe.micro_batches:
                out.append(
                    f"routing[{p}][{s}] names {len(row)} executors for "
                    f"{pipe.micro_batches} micro-batches"
                )
    return out
