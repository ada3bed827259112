"""Prometheus metrics of one daemon, on its own CollectorRegistry (tests build a fresh one each).

Names and labels are part of the interface (docs/daemon.md, dashboards/chameleond.json)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chameleond.core.machine import Phase
from chameleond.core.policy import Policy
from chameleond.handlers.outcome import EventOutcome
from chameleond.jobstate.records import WORKER_STATES, WorkerState
from chameleond.protocol import EVENT_TYPES

OUTCOMES = tuple(EventOutcome)
SLOW_OUTCOMES = ("detected", "recovered")
POLICY_LABELS = (Policy.REROUTE, Policy.DYNAMIC, Policy.INITIAL, Policy.RESTORE, Policy.DROP)
# Decisions take milliseconds to seconds; recoveries seconds to minutes.
DECISION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class TrainingFigures:
    """What the workers report about training, as exported: the newest step's figures (a figure
    no report has named is None) and what the job trained since this daemon started."""

    loss: float | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    loss_scale: float | None = None
    eval_loss: float | None = None  # the newest held-out evaluation's
    tokens_per_second: float | None = None  # of the last finished step
    trained_samples: int = 0
    trained_tokens: int = 0
    skipped_samples: int = 0
    overflow_steps: int = 0


# name, help, the TrainingFigures field. A gauge whose figure is None is left out of the
# exposition (no series, not a zero: a learning rate or a loss of 0 would be a claim).
TRAINING_GAUGES = (
    ("chameleon_training_loss", "The newest step's loss (mean per trained sample).", "loss"),
    ("chameleon_training_grad_norm",
     "The newest step's global gradient norm, before clipping.", "grad_norm"),
    ("chameleon_training_learning_rate", "The newest step's learning rate.", "learning_rate"),
    ("chameleon_training_loss_scale",
     "The fp16 dynamic loss scale the newest step ran with.", "loss_scale"),
    ("chameleon_eval_loss", "The newest held-out evaluation's loss.", "eval_loss"),
    ("chameleon_training_throughput_tokens_per_second",
     "Measured: tokens of the last finished step over its slowest worker's time.",
     "tokens_per_second"),
)  # fmt: skip
TRAINING_COUNTERS = (
    ("chameleon_trained_samples",
     "Samples trained (each step once, however many workers report it).", "trained_samples"),
    ("chameleon_trained_tokens", "Tokens trained.", "trained_tokens"),
    ("chameleon_skipped_samples",
     "Samples of the global batch that a drop plan's steps did not train.", "skipped_samples"),
    ("chameleon_overflow_steps",
     "Steps whose fp16 gradients overflowed (inf/nan), so their update was skipped.",
     "overflow_steps"),
)  # fmt: skip


class TrainingCollector(Collector):
    """Exports the newest `TrainingFigures` (set by `Metrics.set_training`) at each scrape."""

    def __init__(self) -> None:
        self.figures = TrainingFigures()

    def describe(self) -> Iterator[Metric]:
        for name, text, _ in TRAINING_GAUGES:
            yield GaugeMetricFamily(name, text)
        for name, text, _ in TRAINING_COUNTERS:
            yield CounterMetricFamily(name, text)

    def collect(self) -> Iterator[Metric]:
        f = self.figures
        for name, text, field in TRAINING_GAUGES:
            value = getattr(f, field)
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        for name, text, field in TRAINING_COUNTERS:
            yield CounterMetricFamily(name, text, value=getattr(f, field))


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.events = Counter(
            "chameleon_events",
            "Events read from the job's stream, by type and outcome.",
            ["type", "outcome"],
            registry=r,
        )
        self.forged = Counter(
            "chameleon_forged_messages",
            "Events refused because they were unsigned or their signature did not verify "
            "(docs/security.md), by type.",
            ["kind"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "chameleon_decision_seconds",
            "Time from a fault the daemon can act on (received, or the initial plan made) to its "
            "plan published.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "chameleon_recovery_seconds",
            "From a fault the daemon can act on (received, or the initial plan made) to the first "
            "step committed by every worker of the new plan.",
            ["policy"],
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self.heap_settle_seconds = Histogram(
            "chameleon_heap_settle_seconds",
            "A full collection of the daemon's heap, frozen afterwards (daemon/heap.py): at "
            "start, after each plan every worker acknowledged, and every 10 minutes, while "
            "nothing is being decided.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.fault_waiting_seconds = Histogram(
            "chameleon_fault_waiting_seconds",
            "Time a fault received before the initial plan waited for it (the workers to "
            "register); its decision and recovery latency count from the plan, not from receipt.",
            buckets=RECOVERY_BUCKETS,
            registry=r,
        )
        self.prepare_seconds = Histogram(
            "chameleon_prepare_seconds",
            "CPU time of each preparation between faults: the searches of the running plan's "
            "likeliest next faults, their tables and results kept (once per plan, again when "
            "what they searched with moves), on the planner's thread.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        # The newest value of each, so a dashboard shows something between rare faults (a
        # quantile over a window with no fault is NaN): absent until the first one.
        self.last_decision_seconds = Gauge(
            "chameleon_last_decision_seconds",
            "chameleon_decision_seconds of the newest decision that published a plan.",
            registry=r,
        )
        self.last_recovery_seconds = Gauge(
            "chameleon_last_recovery_seconds",
            "chameleon_recovery_seconds of the newest recovery, by policy.",
            ["policy"],
            registry=r,
        )
        self.policy_decisions = Counter(
            "chameleon_policy_decisions",
            "Plans published, by the policy they follow.",
            ["policy"],
            registry=r,
        )
        self.training_throughput = Gauge(
            "chameleon_training_throughput_samples_per_second",
            "Measured: samples of the last finished step over its slowest worker's time.",
            registry=r,
        )
        self.estimated_throughput = Gauge(
            "chameleon_estimated_throughput_samples_per_second",
            "The performance model's throughput of the current plan (global batch / step time), "
            "as estimated at its decision.",
            registry=r,
        )
        self.model_throughput = Gauge(
            "chameleon_model_throughput_samples_per_second",
            "The current plan's throughput under the newest measured profiles (the model now).",
            registry=r,
        )
        self.expected_fault_seconds = Gauge(
            "chameleon_expected_fault_seconds",
            "D: the expected time to the next fault, from the job's fault history and its prior.",
            registry=r,
        )
        self.decision_window_seconds = Gauge(
            "chameleon_decision_window_seconds",
            "The window a fault's decision scores over: the expected time to the next fault or "
            "to the next return of a worker that is out, from the job's repairs.",
            registry=r,
        )
        self.workers = Gauge(
            "chameleon_workers", "Workers of the job by state.", ["state"], registry=r
        )
        self.redis_up = Gauge(
            "chameleon_redis_up",
            "1 while the daemon's Redis reads and commits succeed; 0 from a failed one until one "
            "succeeds.",
            registry=r,
        )
        self.leader = Gauge(
            "chameleon_leader",
            "1 while this daemon holds the job's leader lease; 0 while it stands by.",
            registry=r,
        )
        self.generation = Gauge(
            "chameleon_plan_generation", "Generation of the current plan.", registry=r
        )
        self.attempt = Gauge(
            "chameleon_generation_attempt",
            "How many times the workers have built the current generation: 1, or more when it "
            "failed with nobody gone and was built again.",
            registry=r,
        )
        self.checkpoint_step = Gauge(
            "chameleon_checkpoint_step",
            "Newest step whose checkpoint files cover every layer: what a restore would load "
            "(-1: none).",
            registry=r,
        )
        self.job_state = Gauge(
            "chameleon_job_state",
            "1 for the job's current phase, 0 for the others.",
            ["state"],
            registry=r,
        )
        self.worker_speed = Gauge(
            "chameleon_worker_speed",
            "A worker's compute speed as the planner sees it: its peers' (the same layers in the "
            "other pipelines) compute over its own while it is slow, 1.0 otherwise.",
            ["worker"],
            registry=r,
        )
        self.slow_episodes = Counter(
            "chameleon_slow_episodes",
            "Workers that became slow (detected) or recovered, since this daemon started.",
            ["outcome"],
            registry=r,
        )
        self.slow_decisions = Counter(
            "chameleon_slow_decisions",
            "Decisions on a worker that became slow or recovered, by the policy selected "
            "(keep: the current plan stays).",
            ["policy"],
            registry=r,
        )
        self.slow_expected_gain = Gauge(
            "chameleon_slow_expected_gain_samples_per_second",
            "The newest slow-worker decision's expected gain of its selected candidate over "
            "keeping the current plan, over the episode's expected duration.",
            registry=r,
        )
        self.peer_notices = Counter(
            "chameleon_peer_notices",
            "Worker processes announced gone (their Redis connections closed) or live again, "
            "since this daemon started.",
            ["kind"],
            registry=r,
        )
        for kind in ("gone", "live"):
            self.peer_notices.labels(kind)
        self._slow_counted = (0, 0)
        self._speeds_shown: dict[str, float] = {}  # worker -> the speed its series holds
        self.training = TrainingCollector()
        r.register(self.training)
        # Every label value exists from the start, so dashboards and alerts see zeros, not gaps;
        # the children are kept, so counting an event is one dict lookup (the hot path).
        self.event_counters = {
            (kind, outcome): self.events.labels(kind, outcome)
            for kind in (*EVENT_TYPES, "unknown")
            for outcome in OUTCOMES
        }
        self.forged_counters = {k: self.forged.labels(k) for k in (*EVENT_TYPES, "unknown")}
        for policy in POLICY_LABELS:
            self.policy_decisions.labels(policy)
            self.recovery_seconds.labels(policy)
        for outcome in SLOW_OUTCOMES:
            self.slow_episodes.labels(outcome)
        for state in WORKER_STATES:
            self.workers.labels(state)
        for phase in Phase:
            self.job_state.labels(phase.value)

    def decided(self, seconds: float) -> None:
        self.decision_seconds.observe(seconds)
        self.last_decision_seconds.set(seconds)

    def recovered(self, policy: str, seconds: float) -> None:
        self.recovery_seconds.labels(policy).observe(seconds)
        self.last_recovery_seconds.labels(policy).set(seconds)

    def set_training(self, figures: TrainingFigures) -> None:
        self.training.figures = figures

    def count_event(self, kind: str, outcome: EventOutcome) -> None:
        self.event_counters[kind, outcome].inc()

    def set_phase(self, phase: Phase) -> None:
        for p in Phase:
            self.job_state.labels(p.value).set(1.0 if p is phase else 0.0)

    def set_workers(self, states: dict[str, WorkerState]) -> None:
        counts = dict.fromkeys(WORKER_STATES, 0)
        for s in states.values():
            counts[s] += 1
        for state, n in counts.items():
            self.workers.labels(state).set(n)

    def set_speeds(self, workers: Iterable[str], speeds: Mapping[str, float]) -> None:
        """Each worker's speed (1.0 unless named in `speeds`); a worker's series is written only
        when its value moves (a job of thousands of workers refreshes this every second)."""
        shown = self._speeds_shown
        for w in workers:
            speed = speeds.get(w, 1.0)
            if shown.get(w) != speed:
                self.worker_speed.labels(w).set(speed)
                shown[w] = speed

    def set_slow_episodes(self, detected: int, recovered: int) -> None:
        """The detector's totals (jobstate/slowness.py), counted as they grow."""
        seen = self._slow_counted
        self.slow_episodes.labels("detected").inc(max(0, detected - seen[0]))
        self.slow_episodes.labels("recovered").inc(max(0, recovered - seen[1]))
        self._slow_counted = (max(detected, seen[0]), max(recovered, seen[1]))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
