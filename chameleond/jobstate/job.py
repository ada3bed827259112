"""One job as the daemon sees it: the spec, the current plan, the workers, the policy state machine.

Handlers change it (chameleond/handlers/); each transition that changes what must be durable returns
a `Change` (chameleond/jobstate/change.py), and the daemon turns the changes into commits. No I/O
here: the daemon persists `snapshot()` and the changes' records, and acknowledges stream entries
only once the effect they caused is in Redis (`owed` holds the entries a pending decision answers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from chameleond.core import selector
from chameleond.core.estimator import Estimator
from chameleond.core.holdings import Checkpoints
from chameleond.core.machine import DecisionRequest, Phase, PolicyMachine
from chameleond.core.machine import Transition as PhaseTransition
from chameleond.core.plan import Plan
from chameleond.core.policy import Policy, Selection
from chameleond.core.spec import JobSpec, LayerProfile, LinkSpec, WorkerSpec, backend_of
from chameleond.events import Step
from chameleond.jobstate.change import MEASURED, SNAPSHOT, UNCHANGED, Change, recorded, snapshot_if
from chameleond.jobstate.links import links_view, measured_links
from chameleond.jobstate.measured import MeasuredLayers, SteadyLayers
from chameleond.jobstate.records import (
    UNCONFIRMED_MAX,
    FollowUp,
    Liveness,
    RebuildMeter,
    Registration,
    StepMeter,
    WorkerRecord,
    WorkerState,
)
from chameleond.jobstate.slowness import Slowness, Transition, measure_of
from chameleond.protocol import HEARTBEAT_SECONDS, heartbeat_seconds

MODEL_VIEW_SECONDS = 10.0  # how long the model's view of a plan may lag its measurements
REPAIRS = 1000  # the workers' repairs kept (and persisted) for the window estimate


class Job:
    def __init__(
        self,
        name: str,
        spec: JobSpec,
        *,
        policy: Selection,
        machine: PolicyMachine,
        registration_ttl_seconds: float = 60.0,
    ) -> None:
        self.name = name
        self.registration_ttl_seconds = registration_ttl_seconds
        # Registrations from outside the spec awaiting a profile (bounded: UNCONFIRMED_MAX, TTL).
        self.unconfirmed: dict[str, Registration] = {}
        self.base_spec = spec
        self.policy = Selection(policy)
        self.machine = machine
        self.workers: dict[str, WorkerRecord] = {w.id: WorkerRecord(w.id) for w in spec.workers}
        self.extra_workers: dict[str, WorkerSpec] = {}  # registered workers the spec does not list
        self.plan: Plan | None = None
        self.started = 0.0  # when the initial plan was made: start of the MTBF exposure window
        self.fault_times: list[float] = []
        # (went out, seconds out) of each worker that came back: the repairs (Job.window).
        self.repairs: list[tuple[float, float]] = []
        # The time of each fault a decision has not yet answered: its entry is still pending, so
        # a restarted daemon reads it again and must not find it already counted.
        self.undecided_faults: dict[str, float] = {}
        # Worker -> seconds its fault waited for the initial plan (received before the workers).
        self.waited: dict[str, float] = {}
        self.last_decision: dict[str, Any] | None = None
        self.follow_up: FollowUp | None = None
        self.checkpoints = (
            Checkpoints()
        )  # what a restore plan can load (chameleond/handlers/checkpoint.py)
        self.owed: dict[str, list[str]] = {}  # worker -> entry ids acked when its decision commits
        self.meter = StepMeter()
        self.rebuilds = RebuildMeter()  # measured communicator rebuilds, per backend
        self.slowness = Slowness()  # fail-slow workers, from the training profiles
        self.slow_due: dict[str, Transition] = {}  # worker -> became slow / recovered, undecided
        self.spec_version = 0  # bumped whenever the planner's spec changes (stored for the workers)
        self._spec_cache: JobSpec | None = None
        self._spec_generation = 0  # the plan `_spec_cache` took its link measurements from
        # ((generation, spec version), step seconds, when computed)
        self._model_cache: tuple[tuple[int, int], float, float] | None = None
        self._measured = MeasuredLayers()  # the layer figures' running sums
        self._steady = SteadyLayers()  # the planner's figures of those, held still
        # The layer figures a restart restored (Job.measured_means, persisted): the planner's
        # until a worker measures that layer again.
        self.restored_layers: dict[int, LayerProfile] = {}
        self._speeds_of: tuple[tuple[WorkerSpec, ...], dict[str, float]] | None = None
        self._members: tuple[Plan, frozenset[str], frozenset[str]] | None = None
        # (generation, the highest attempt a worker acknowledged for it): the workers build a
        # generation again when it failed with nobody gone (docs/worker.md).
        self._attempt = (0, 1)

    # ---- the spec the planner sees -----------------------------------------------------------

    def reset_spec(self, spec: JobSpec) -> None:
        """Plan with `spec` (the job's stored spec wins over the configured one on a restart)."""
        self.base_spec = spec
        self.workers = {w.id: WorkerRecord(w.id) for w in spec.workers}
        self._steady = SteadyLayers()
        self._spec_cache = None

    @property
    def spec(self) -> JobSpec:
        generation = self.plan.generation if self.plan is not None else 0
        if self._spec_cache is None or self._spec_generation != generation:
            spec = self._workers_spec()
            slow = self.slowness.speeds()
            if slow:
                spec = spec.with_speeds(slow)
            profiles = {w.id: w.profile for w in self.workers.values() if w.profile}
            if profiles or self.restored_layers:
                known = self.restored_layers
                base = tuple(known.get(i, layer) for i, layer in enumerate(spec.layers))
                speeds = {**self._spec_speeds(spec), **slow}
                spec = spec.with_layers(
                    self._steady.of(self._measured.layers(base, profiles, speeds))
                )
            spec = measured_links(spec, self._links(), self._link_members())
            rebuild = self.rebuild_seconds(spec)
            if rebuild != spec.rebuild_seconds:
                spec = replace(spec, rebuild_seconds=rebuild)
            self._spec_cache, self._spec_generation = spec, generation
        return self._spec_cache

    def measured_means(self) -> dict[int, LayerProfile]:
        """The layer figures the workers' profiles made (or a restart restored), by layer index:
        what the job's snapshot keeps of its profiles."""
        layers = self.spec.layers
        measured = self._measured.measured() | set(self.restored_layers)
        return {i: layers[i] for i in sorted(measured) if i < len(layers)}

    def _spec_speeds(self, spec: JobSpec) -> dict[str, float]:
        """The speeds the spec gives its workers, where not 1.0 (read once per spec's workers)."""
        if self._speeds_of is None or self._speeds_of[0] is not spec.workers:
            given = {w.id: w.speed for w in spec.workers if w.speed != 1.0}
            self._speeds_of = (spec.workers, given)
        return self._speeds_of[1]

    def _workers_spec(self) -> JobSpec:
        spec = self.base_spec
        if self.extra_workers:
            spec = spec.with_workers(spec.workers + tuple(self.extra_workers.values()))
        return spec

    def _links(self) -> dict[str, dict[str, LinkSpec]]:
        return {w.id: w.links for w in self.workers.values() if w.links}

    def _link_members(self) -> frozenset[str] | None:
        """The workers whose link measurements count: those the plan in force runs."""
        if self.plan is None:
            return None
        return self.plan.members

    def links_view(self) -> dict[str, Any]:
        """The link figures the planner uses and the measured pairs behind them (status)."""
        return links_view(self._workers_spec(), self._links(), self._link_members())

    def rebuild_seconds(self, spec: JobSpec) -> float:
        """What the planner takes a new plan's communicator rebuild to cost: per backend the job's
        workers run, the rebuild measured on it (`RebuildMeter`), else the spec's prior
        (`[job] rebuild_seconds`); the slowest backend's when they are several."""
        registered = {w: rec.device for w, rec in self.workers.items() if rec.device}
        # Each worker's device: the one it registered with, else the spec's.
        devices = {registered.get(w.id) or w.device for w in spec.workers}
        backends = {backend_of(d) for d in devices}
        prior = spec.rebuild_seconds
        measured = (self.rebuilds.seconds(b) for b in backends)
        return max((prior if s is None else s for s in measured), default=prior)

    def observe_rebuild(self, worker: str, generation: int, seconds: float) -> Change:
        """A member's measured rebuild of `generation` (its ready ack): the planner's figure for
        its backend from now on, once it changes it."""
        rec = self.workers.get(worker)
        device = rec.device if rec is not None else ""
        if not device:  # never registered with this daemon: the spec's device
            try:
                device = self.spec.worker(worker).device
            except KeyError:  # not a worker of the job any more: no backend to measure
                return UNCHANGED
        if not self.rebuilds.observe(backend_of(device), generation, seconds):
            return UNCHANGED
        return self.spec_changed()

    def observe_attempt(self, generation: int, attempt: int) -> None:
        if generation == self._attempt[0]:
            attempt = max(attempt, self._attempt[1])
        elif generation < self._attempt[0]:
            return
        self._attempt = (generation, attempt)

    def attempt(self) -> int:
        """How many times the workers have built the current generation (1: once)."""
        gen, attempt = self._attempt
        return attempt if gen == self.machine.generation else 1

    def model_step_seconds(self, now: float | None = None) -> float | None:
        """The current plan's step time under the newest measurements: the model's view now. The
        plan's own estimate is the forecast made at its decision; this one follows the in-training
        profiles (and the host's load in them). Computed once per plan and spec version; given
        `now`, a newer spec version of the same plan is taken up MODEL_VIEW_SECONDS after the
        last (a large job's profiles move the spec with nearly every batch, and a gauge
        refreshed every second would rebuild the spec and estimate 8,192 stages each time)."""
        if self.plan is None:
            return None
        key = (self.plan.generation, self.spec_version)
        cached = self._model_cache
        if cached is not None and cached[0] != key:
            fresh = now is not None and now - cached[2] < MODEL_VIEW_SECONDS
            if not (fresh and cached[0][0] == key[0]):
                cached = None
        if cached is None:
            p = self.plan
            try:
                seconds = Estimator(self.spec).step_seconds(p.pipelines, p.routing, p.sync_groups)
            except KeyError:  # a worker of the plan the spec no longer lists: no model view
                return None
            cached = self._model_cache = (key, seconds, now or 0.0)
        return cached[1]

    def spec_changed(self) -> Change:
        self.invalidate_spec()
        self.spec_version += 1
        return SNAPSHOT

    def measured_changed(self) -> Change:
        """A measurement (a profile) changed the spec: persisted with the next snapshot, or the
        next progress at the latest (Change.measured)."""
        self.invalidate_spec()
        self.spec_version += 1
        return MEASURED

    def invalidate_spec(self) -> None:
        """The spec's parts changed behind `spec`'s back (a restore): derive it again."""
        self._spec_cache = None

    def observe_profile(
        self, worker: str, data: Mapping[str, Any], profile: Mapping[int, LayerProfile], now: float
    ) -> Change:
        """A `profile` event's training measure, to the slowness detector (jobstate/slowness.py).
        A worker of the plan that became slow or recovered waits in `slow_due` for a decision
        (daemon/decisions.py), and the planner's spec takes its speed from now on."""
        measure = measure_of(data, profile)
        if measure is None or self.plan is None:
            return UNCHANGED
        moved = self.slowness.observe(worker, measure, self._training_members(self.plan), now)
        for t in moved:
            self.slow_due[t.worker] = t
        return self.spec_changed() if moved else UNCHANGED

    def _training_members(self, plan: Plan) -> frozenset[str]:
        """The plan's members not declared failed: the same object while neither changes, so
        the slowness detector sees at a glance that its peers are the same."""
        failed = frozenset(self.machine.failed)
        cached = self._members
        if cached is None or cached[0] is not plan or cached[1] != failed:
            cached = self._members = (plan, failed, plan.members - failed)
        return cached[2]

    def knows(self, worker: str) -> bool:
        return worker in self.workers

    # ---- liveness ------------------------------------------------------------------------------

    def heartbeat_timeout(self, configured: float) -> float:
        """The heartbeat timeout for this job: `configured` (at the HEARTBEAT_SECONDS cadence),
        longer by as much as a large job's workers beat less often (protocol.heartbeat_seconds)."""
        return configured * heartbeat_seconds(len(self.workers)) / HEARTBEAT_SECONDS

    def heard(self, worker: str, now: float) -> None:
        """The worker's current process sent something (heartbeat, step, ack)."""
        rec = self.workers.get(worker)
        if rec is None:
            return
        rec.last_heartbeat = now
        if self.declared_failed(worker):
            rec.heard_while_failed = now

    def declared_failed(self, worker: str) -> bool:
        """Out of the plans, or about to be: a committed or a pending fault names it."""
        m = self.machine
        flight = m.in_flight
        return (
            worker in m.failed
            or worker in m.pending_faults
            or (flight is not None and worker in flight.failed)
        )

    def new_process(self, worker: str) -> None:
        """A registration or rejoin: whatever the worker's earlier process did is over, its
        measured slowness too (a new process, perhaps on a repaired device, is measured anew)."""
        rec = self.worker(worker)
        rec.ended, rec.heard_while_failed = None, 0.0
        self.slowness.forget(worker)

    def ended(self, worker: str) -> bool:
        rec = self.workers.get(worker)
        return rec is not None and rec.ended is not None

    def finish_if_done(self, now: float) -> list[PhaseTransition]:
        """The job finished once every worker of the current plan finished its steps: the
        last one's stop, or a plan decided while its workers finished (one left as the others
        took their last step)."""
        m = self.machine
        plan = [self.workers.get(w) for w in m.plan_workers]
        if not plan or any(r is None or r.ended is not WorkerState.FINISHED for r in plan):
            return []
        return m.finish(now)

    # ---- registrations from outside the spec ---------------------------------------------------

    def waiting_registrations(self, now: float) -> list[str]:
        """Registrations from outside the spec still within the TTL for their profile, sorted."""
        ttl = self.registration_ttl_seconds
        return sorted(w for w, r in self.unconfirmed.items() if now - r.at <= ttl)

    def expire_unconfirmed(self, now: float) -> tuple[list[str], Change]:
        """Drop registrations that waited longer than the TTL for their profile. Done where
        registrations are read (a registration, a profile), so nothing else writes the job."""
        ttl = self.registration_ttl_seconds
        gone = [w for w, r in self.unconfirmed.items() if now - r.at > ttl]
        for w in gone:
            del self.unconfirmed[w]
        return gone, snapshot_if(bool(gone))

    def await_profile(self, worker: str, registration: Registration) -> Change | None:
        """Hold a registration from outside the spec until the worker's profile confirms it.
        None when UNCONFIRMED_MAX registrations already wait (the caller refuses it)."""
        self.expire_unconfirmed(registration.at)
        if worker not in self.unconfirmed and len(self.unconfirmed) >= UNCONFIRMED_MAX:
            return None
        self.unconfirmed[worker] = registration
        return SNAPSHOT

    def confirm(self, worker: str) -> Change:
        """The worker behind a held registration sent its profile: it is a worker of the job
        from now on (the planner may place layers on it). Unchanged when nothing was held."""
        reg = self.unconfirmed.pop(worker, None)
        if reg is None:
            return UNCHANGED
        rec = self.worker(worker)
        rec.host, rec.device, rec.memory_bytes, rec.registered = (
            reg.host, reg.device, reg.memory_bytes, True,
        )  # fmt: skip
        rec.last_heartbeat = reg.at
        self.extra_workers[worker] = WorkerSpec(worker, reg.host, reg.memory_bytes, reg.device)
        return self.spec_changed()

    def worker(self, worker: str) -> WorkerRecord:
        rec = self.workers.get(worker)
        if rec is None:
            rec = self.workers[worker] = WorkerRecord(worker)
        return rec

    # ---- what handlers call ------------------------------------------------------------------

    def owe(self, worker: str, entry_id: str) -> None:
        self.owed.setdefault(worker, []).append(entry_id)

    def pending(self, worker: str) -> bool:
        """A decision about this worker is pending or running."""
        m = self.machine
        flight = m.in_flight
        return (
            worker in m.pending_faults
            or worker in m.pending_joins
            or worker in m.pending_unrestorable
            or (
                flight is not None
                and (
                    worker in flight.failed
                    or worker in flight.joined
                    or worker in flight.unrestorable
                )
            )
        )

    def registered_spec_workers(self) -> int:
        return sum(1 for w in self.base_spec.workers if self.workers[w.id].registered)

    def initial_due(self, min_workers: int) -> bool:
        need = min_workers or len(self.base_spec.workers)
        return self.machine.phase is Phase.WAITING and self.registered_spec_workers() >= need

    # ---- decisions -----------------------------------------------------------------------------

    def force(self) -> Policy | None:
        return self.policy.force

    def mtbf(self, now: float) -> float:
        """D: the expected time to the next fault, from this job's faults since its initial plan."""
        started = self.started or now
        return selector.estimate_mtbf(
            self.fault_times, max(now, started), started, self.base_spec.mtbf_prior_seconds
        )

    def window(self, now: float) -> float:
        """The D a decision scores over: the expected time to the next fault or the next return
        of a worker that is out, from this job's own repairs (selector.window_seconds)."""
        out = [r.down_since for r in self.workers.values() if r.down_since]
        return selector.window_at(now, self.mtbf(now), self.repairs, out)

    def drop_stale_follow_up(self) -> Change:
        """A plan of another generation than the follow-up's (a later fault) makes it stale."""
        fu = self.follow_up
        if fu is None or fu.after_generation == self.machine.generation:
            return UNCHANGED
        self.follow_up = None
        return SNAPSHOT

    def switch_due(self) -> FollowUp | None:
        """The prepared follow-up, once the reroute plan it follows demonstrably trains (None
        while it is stale: see drop_stale_follow_up)."""
        fu = self.follow_up
        if fu is None or fu.after_generation != self.machine.generation:
            return None
        return fu if self.machine.running() else None

    def acks_for(self, request: DecisionRequest | None) -> list[str]:
        """Entry ids a committed decision answers (its faults, joins and failed restores, with
        their duplicates)."""
        workers: set[str] = set()
        if request is not None:
            workers = {*request.faults, *request.joined, *request.unrestorable}
        # Faults about workers outside the plan went straight to `failed`: nothing else covers them.
        workers |= {w for w in self.owed if not self.pending(w)}
        return [i for w in sorted(workers) for i in self.owed.pop(w, [])]

    def adopt(self, plan: Plan, failed: set[str]) -> Plan:
        """The plan as published: every failed worker fenced through `excluded`. A worker it
        takes in that the current plan does not run is a member from this generation on."""
        excluded = tuple(sorted(set(plan.excluded) | (failed - set(plan.workers))))
        before = set(self.plan.workers) - set(self.plan.excluded) if self.plan else set()
        for w in set(plan.workers) - set(excluded) - before:
            self.worker(w).since_generation = plan.generation
        return replace(plan, excluded=excluded)

    def stale_fault(self, worker: str, generation: int) -> bool:
        """A fault a peer saw in `generation` is about an earlier process of `worker` when the
        worker came back after it (a report held in the peer's outbox through a Redis outage,
        arriving after the worker rejoined)."""
        return generation < self.worker(worker).since_generation

    def unconfirm(self, worker: str, registration: Registration) -> Change:
        """Undo `confirm` (the profile that came was unusable): the registration waits again."""
        self.workers.pop(worker, None)
        self.extra_workers.pop(worker, None)
        self.unconfirmed[worker] = registration
        return self.spec_changed()

    # ---- faults and their waiting -------------------------------------------------------------

    def count_fault(self, worker: str, now: float) -> Change:
        """One more fault for the failure rate (selector.estimate_mtbf)."""
        self.undecided_faults = {w: t for w, t in self.undecided_faults.items() if self.pending(w)}
        self.fault_times.append(now)
        if self.pending(worker):
            self.undecided_faults[worker] = now
        rec = self.worker(worker)
        rec.down_since = rec.down_since or now
        self.slow_due.pop(worker, None)  # a slow worker that died: an ordinary fault
        if self.slowness.forget(worker):
            self.spec_changed()
        return SNAPSHOT

    def count_return(self, worker: str, now: float) -> Change:
        """A worker that was out is back: how long it was out feeds the window (Job.window)."""
        rec = self.worker(worker)
        if not rec.down_since:
            return UNCHANGED
        repair = (rec.down_since, max(0.0, now - rec.down_since))
        self.repairs = [*self.repairs, repair][-REPAIRS:]
        rec.down_since = 0.0
        return SNAPSHOT

    def waiting_faults(self) -> list[dict[str, Any]]:
        """Faults no decision has answered yet, oldest first (what status shows): one received
        before the workers registered waits here for the initial plan."""
        m = self.machine
        out = [
            {
                "worker": w,
                "cause": cause,
                "received_at": self.undecided_faults.get(w, m.pending_since),
            }
            for w, cause in m.pending_faults.items()
        ]
        return sorted(out, key=lambda f: f["received_at"] or 0.0)

    def act_from(self, now: float) -> dict[str, float]:
        """The initial plan is out: the daemon can act on the faults that waited for it, so their
        decision and recovery latency count from `now`. Returns how long each one waited."""
        m = self.machine
        waits = {w: max(0.0, now - self.undecided_faults.get(w, now)) for w in m.pending_faults}
        if m.pending_since is not None:
            m.pending_since = now
        self.waited.update(waits)
        return waits

    def decided_fault_times(self) -> list[float]:
        """The fault times a restart keeps: those of faults a committed decision answered."""
        undecided = {t for w, t in self.undecided_faults.items() if self.pending(w)}
        return [t for t in self.fault_times if t not in undecided]

    # ---- views ---------------------------------------------------------------------------------

    def worker_state(
        self, rec: WorkerRecord, now: float, heartbeat_timeout: float
    ) -> WorkerState | None:
        m = self.machine
        if rec.ended is not None:
            return rec.ended  # stopped cleanly: finished its steps, or left the job
        if rec.id in m.standby or rec.id in m.pending_joins:
            return WorkerState.WAITING  # back, offered to the next decision (core/machine.py)
        if rec.id in m.failed or (self.plan and rec.id in self.plan.excluded_set):
            if rec.stopped_generation >= m.generation and m.generation:
                return WorkerState.STOPPED
            # Fenced only on evidence: heard from after it was declared failed, recently.
            heard = rec.heard_while_failed
            fenced = heard and now - heard <= heartbeat_timeout
            return WorkerState.FENCED if fenced else WorkerState.FAILED
        if m.member(rec.id):
            return WorkerState.ACTIVE
        return WorkerState.WAITING if rec.registered else None

    def liveness(self, rec: WorkerRecord, now: float, heartbeat_timeout: float) -> Liveness:
        """What the daemon knows of the worker's process, on evidence: `stopped` (it said so:
        finished, left or fenced), `dead` (declared failed, nothing heard since), `heartbeating`
        (heard within the timeout) or `silent`."""
        m = self.machine
        if rec.ended is not None or (rec.stopped_generation >= m.generation and m.generation):
            return Liveness.STOPPED
        if self.declared_failed(rec.id) or (self.plan and rec.id in self.plan.excluded_set):
            heard = rec.heard_while_failed
            alive = heard and now - heard <= heartbeat_timeout
            return Liveness.HEARTBEATING if alive else Liveness.DEAD
        fresh = rec.last_heartbeat and now - rec.last_heartbeat <= heartbeat_timeout
        return Liveness.HEARTBEATING if fresh else Liveness.SILENT

    def worker_states(self, now: float, heartbeat_timeout: float) -> dict[str, WorkerState]:
        out = {}
        for rec in self.workers.values():
            state = self.worker_state(rec, now, heartbeat_timeout)
            if state is not None:
                out[rec.id] = state
        return out

    def observe_step(self, event: Step, now: float) -> tuple[bool, Change]:
        """Whether the report is fresh (False: a stale or repeated step), and what changed."""
        expected = len(self.machine.plan_workers) or 1
        fresh = self.meter.report(event, expected)
        worker, generation = event.worker, event.generation
        # A worker's first step of the generation is durable state (it gates the follow-up switch);
        # later steps are soft state, persisted with the progress.
        first = worker in self.machine.awaiting_step and generation == self.machine.generation
        recovery, moved = self.machine.step(worker, generation, now)
        change = recorded(moved) | snapshot_if(first)
        if recovery is not None:
            change |= Change(recoveries=(recovery,))
        return fresh, change
