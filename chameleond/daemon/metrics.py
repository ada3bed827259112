"""Prometheus metrics of one daemon, on its own CollectorRegistry (tests build a fresh one each).

Names and labels are part of the interface (docs/daemon.md, dashboards/chameleond.json)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from chameleond.core.machine import Phase
from chameleond.core.policy import Policy
from chameleond.jobstate.records import WORKER_STATES
from chameleond.protocol import EVENT_TYPES

OUTCOMES = ("handled", "invalid", "duplicate")
POLICY_LABELS = (Policy.REROUTE, Policy.DYNAMIC, Policy.INITIAL, Policy.RESTORE, Policy.DROP)
# Decisions take milliseconds to seconds; recoveries seconds to minutes.
DECISION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600)


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
        self.fault_waiting_seconds = Histogram(
            "chameleon_fault_waiting_seconds",
            "Time a fault received before the initial plan waited for it (the workers to "
            "register); its decision and recovery latency count from the plan, not from receipt.",
            buckets=RECOVERY_BUCKETS,
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

    def count_event(self, kind: str, outcome: str) -> None:
        self.event_counters[kind, outcome].inc()

    def set_phase(self, phase: Phase) -> None:
        for p in Phase:
            self.job_state.labels(p.value).set(1.0 if p is phase else 0.0)

    def set_workers(self, states: dict[str, str]) -> None:
        counts = dict.fromkeys(WORKER_STATES, 0)
        for s in states.values():
            counts[s] += 1
        for state, n in counts.items():
            self.workers.labels(state).set(n)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
