"""The policy state machine of one job: which phase the job is in and when a decision is due.

Pure: plain data in, plain data out, time passed in as `now` (wall-clock seconds, so a persisted
deadline still means something after a restart). The daemon feeds it events; it answers with
`Transition`s to record and `DecisionRequest`s to hand to the planner. Phases:

    waiting -> transitioning -> training -> fault_detected -> planning -> transitioning -> training
       |                            |                                  -> unrecoverable
       |                            +-> finished (every worker of the plan finished its steps)
       +-> unrecoverable (the initial layout does not fit)

A finished job is training again if a worker of its plan commits a step of it after all.

Faults that arrive while a decision is under way are folded: they wait in `pending_faults` and
the running decision, if its plan still uses one of those workers, is superseded instead of
published, so a burst of faults yields a handful of plans, not one per fault.

A `restore` plan that some worker cannot load (`unrestorable`: the checkpoint files of its step
are missing or unreadable there) is decided again like a fault, with no copy in memory counted:
the loads that succeeded are of a checkpoint the job does not restore after all.

A worker that came back (`join`) and was not taken into the plan that answered it (the current
plan was kept) is on `standby`: alive, holding nothing, and offered again to every later decision,
so the next fault or rejoin can use it. So is a live worker of the previous plan that a new plan
leaves out (a drop plan's dropped pipelines, a dynamic plan's spares). It leaves standby when a
plan takes it, or when it fails.

The machine also keeps the job's `holdings` (core.holdings): who holds a current copy of which
layer, from the plans it adopts and the acknowledgements and commits it sees. Decisions restore
from these, not from the current plan's stage owners.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from chameleond.core.holdings import Holdings, Interval
from chameleond.core.policy import Policy


class Phase(StrEnum):
    WAITING = "waiting"  # before the initial plan: workers are registering
    TRAINING = "training"
    FAULT_DETECTED = "fault_detected"
    PLANNING = "planning"
    TRANSITIONING = "transitioning"  # a plan is published, not every worker has acknowledged it
    UNRECOVERABLE = "unrecoverable"
    FINISHED = "finished"  # every worker of the plan committed its last step and stopped


@dataclass(frozen=True)
class Transition:
    source: Phase
    target: Phase
    generation: int
    cause: str
    at: float


@dataclass(frozen=True)
class DecisionRequest:
    """What the planner is asked: every worker out now, the workers that may be taken back."""

    failed: frozenset[str]
    joined: frozenset[str]
    faults: Mapping[str, str]  # worker -> cause, the new faults this decision answers
    cause: str
    first_event_at: float  # when the oldest folded event was received
    generation: int  # the generation a plan from this request gets
    # worker -> why: the current `restore` plan cannot load there, so no copy in memory counts
    unrestorable: Mapping[str, str] = field(default_factory=dict)
    # worker -> the raw error text its cause shortens (a peer's collective error), for the record
    details: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DecisionResult:
    """What the planner answered, reduced to what the machine needs."""

    generation: int | None  # None: no new plan (unrecoverable, or nothing worth changing)
    policy: Policy | None
    workers: tuple[str, ...] = ()
    unrecoverable: str | None = None
    layers: Mapping[str, list[Interval]] = field(default_factory=dict)  # the plan's, per worker


@dataclass(frozen=True)
class Recovery:
    """A fault's recovery is complete: every worker of the new plan committed a step."""

    generation: int
    policy: Policy
    seconds: float


@dataclass
class _RecoveryWatch:
    generation: int
    policy: Policy
    since: float
    remaining: set[str]


@dataclass
class PolicyMachine:
    ready_timeout_seconds: float = 30.0
    phase: Phase = Phase.WAITING
    generation: int = 0
    failed: set[str] = field(default_factory=set)  # committed: excluded from the current plan
    plan_workers: tuple[str, ...] = ()
    awaiting_ready: set[str] = field(default_factory=set)
    awaiting_step: set[str] = field(default_factory=set)  # no step committed in this generation
    ready_deadline: float = 0.0
    pending_faults: dict[str, str] = field(default_factory=dict)
    fault_details: dict[str, str] = field(default_factory=dict)  # of pending faults: raw texts
    pending_joins: set[str] = field(default_factory=set)
    pending_unrestorable: dict[str, str] = field(default_factory=dict)  # worker -> why
    standby: set[str] = field(default_factory=set)  # back, but in no plan yet (module docstring)
    pending_since: float | None = None
    in_flight: DecisionRequest | None = None
    recovery: _RecoveryWatch | None = None
    holdings: Holdings = field(default_factory=Holdings)
    # plan_workers as a set, made once per plan (`member`: asked for every event of a large job)
    _members: tuple[tuple[str, ...], frozenset[str]] = field(
        default=((), frozenset()), repr=False, compare=False
    )

    def member(self, worker: str) -> bool:
        """Whether `worker` runs the current plan."""
        if self._members[0] is not self.plan_workers:
            self._members = (self.plan_workers, frozenset(self.plan_workers))
        return worker in self._members[1]

    # ---- transitions -------------------------------------------------------------------------

    def _move(self, target: Phase, cause: str, now: float) -> list[Transition]:
        if target == self.phase:
            return []
        t = Transition(self.phase, target, self.generation, cause, now)
        self.phase = target
        return [t]

    def _adopt(
        self, workers: Iterable[str], now: float, layers: Mapping[str, list[Interval]]
    ) -> None:
        """A new plan is published: its workers owe an acknowledgement and a first step. Live
        workers of the previous plan that this one leaves out (a drop plan's dropped pipelines,
        a dynamic plan's spares) go on standby, as a join the plan did not take does."""
        self.holdings.published(self.generation, layers)
        left = set(self.plan_workers) - self.failed - set(self.pending_faults)
        self.plan_workers = tuple(sorted(workers))
        self.standby = (self.standby | left) - set(self.plan_workers)
        self.awaiting_ready = set(self.plan_workers)
        self.awaiting_step = set(self.plan_workers)
        self.ready_deadline = now + self.ready_timeout_seconds

    # ---- inputs ------------------------------------------------------------------------------

    def fault(
        self, worker: str, cause: str, now: float, detail: str = ""
    ) -> tuple[bool, list[Transition]]:
        """A worker is reported out (`detail`: the raw text `cause` shortens, if any). Returns
        (new, transitions); new=False for a duplicate."""
        in_flight = self.in_flight.failed if self.in_flight else frozenset()
        if worker in self.failed or worker in self.pending_faults or worker in in_flight:
            return False, []
        self.pending_joins.discard(worker)
        self.standby.discard(worker)
        joining = self.in_flight.joined if self.in_flight else frozenset()
        if self.phase is not Phase.WAITING and worker not in {*self.plan_workers, *joining}:
            # Not running anything: no plan changes, it is simply no longer available.
            self.failed.add(worker)
            return True, []
        self.pending_faults[worker] = cause
        if detail:
            self.fault_details[worker] = detail
        if self.pending_since is None:
            self.pending_since = now
        if self.phase in (Phase.TRAINING, Phase.TRANSITIONING):
            return True, self._move(Phase.FAULT_DETECTED, f"{worker}: {cause}", now)
        return True, []

    def join(self, worker: str, now: float) -> tuple[bool, list[Transition]]:
        """A worker outside the current plan is available (repaired, restarted or new). Before
        any plan (waiting, or no initial plan could be made) there is nothing to take it into."""
        if self.phase is Phase.WAITING or self.generation == 0:
            return False, []
        in_plan = self.member(worker) and worker not in self.failed
        in_flight = self.in_flight.joined if self.in_flight else frozenset()
        if in_plan or worker in self.pending_joins or worker in in_flight:
            return False, []
        self.failed.discard(worker)
        self.standby.discard(worker)  # a new process of a worker on standby: joins again
        self.holdings.lost(worker)  # a new process: whatever the old one held is gone
        self.pending_joins.add(worker)
        if self.pending_since is None:
            self.pending_since = now
        return True, []

    def unrestorable(self, worker: str, cause: str, now: float) -> tuple[bool, list[Transition]]:
        """A worker of the current plan, a `restore`, cannot load its checkpoint (the caller
        checks the report is about this plan). Returns (new, transitions)."""
        in_flight = self.in_flight.unrestorable if self.in_flight else {}
        if self.pending_unrestorable or in_flight:
            return False, []  # one report is enough: the plan is decided again for every worker
        if not self.member(worker) or worker in self.failed:
            return False, []
        self.pending_unrestorable[worker] = cause
        if self.pending_since is None:
            self.pending_since = now
        if self.phase in (Phase.TRAINING, Phase.TRANSITIONING):
            why = f"{worker} cannot restore: {cause}"
            return True, self._move(Phase.FAULT_DETECTED, why, now)
        return True, []

    def initial(
        self,
        generation: int,
        workers: Iterable[str],
        now: float,
        layers: Mapping[str, list[Interval]] | None = None,
    ) -> list[Transition]:
        """Generation `generation` (the spec's layout) is published; `layers`: its owners'."""
        self.generation = generation
        self._adopt(workers, now, layers or {})
        self.holdings.initial(generation, layers or {})
        return self._move(Phase.TRANSITIONING, "initial plan", now)

    def unrecoverable(self, cause: str, now: float) -> list[Transition]:
        """No plan can run at all (the initial layout does not fit): the job waits for a person.
        The faults reported so far are answered by it: those workers are out."""
        self.failed |= set(self.pending_faults)
        self.pending_faults.clear()
        self.fault_details.clear()
        self.standby |= self.pending_joins
        self.pending_joins.clear()
        self.pending_since = None
        return self._move(Phase.UNRECOVERABLE, cause, now)

    def switch(
        self,
        generation: int,
        workers: Iterable[str],
        now: float,
        cause: str,
        layers: Mapping[str, list[Interval]] | None = None,
    ) -> list[Transition]:
        """Switch from a running reroute plan to the dynamic plan prepared alongside it (no new
        fault: the decision was made with the reroute, the switch only pays off later)."""
        if self.phase is not Phase.TRAINING or self.in_flight is not None:
            raise ValueError(f"a switch needs a training job and no decision running: {self.phase}")
        if generation <= self.generation:
            raise ValueError(f"generation {generation} does not follow {self.generation}")
        self.generation = generation
        self._adopt(workers, now, layers or {})
        self.failed -= set(self.plan_workers)
        return self._move(Phase.TRANSITIONING, cause, now)

    def next_request(self, now: float) -> tuple[DecisionRequest | None, list[Transition]]:
        """Start a decision when one is due and none is running (and there is a plan to start
        from: a job whose initial plan failed has none)."""
        if self.in_flight is not None or self.phase is Phase.WAITING or self.generation == 0:
            return None, []
        faults = dict(self.pending_faults)
        unrestorable = dict(self.pending_unrestorable)
        # Joins wait until the job trains again: taking a worker back mid-transition helps nobody.
        joins_due = self.phase in (Phase.TRAINING, Phase.UNRECOVERABLE) or bool(faults)
        joins = set(self.pending_joins) - set(faults) if joins_due else set()
        if not faults and not joins and not unrestorable:
            return None, []
        parts = [f"{w}: {c}" for w, c in sorted(faults.items())]
        parts += [f"{w} cannot restore: {c}" for w, c in sorted(unrestorable.items())]
        parts += [f"{w} rejoined" for w in sorted(joins)]
        request = DecisionRequest(
            failed=frozenset(self.failed | set(faults)),
            joined=frozenset(joins | (self.standby - set(faults))),
            faults=faults,
            cause="; ".join(parts),
            first_event_at=self.pending_since if self.pending_since is not None else now,
            generation=self.generation + 1,
            unrestorable=unrestorable,
            details={w: self.fault_details.pop(w) for w in faults if w in self.fault_details},
        )
        self.pending_faults.clear()
        self.pending_unrestorable.clear()
        self.pending_joins -= joins
        self.pending_since = None
        self.in_flight = request
        return request, self._move(Phase.PLANNING, request.cause, now)

    def decided(
        self, request: DecisionRequest, result: DecisionResult, now: float
    ) -> tuple[bool, list[Transition]]:
        """The planner answered `request`. Returns (commit, transitions); commit=False means the
        answer is superseded by faults that arrived meanwhile and is folded into the next one."""
        self.in_flight = None
        # A plan on a worker that failed meanwhile, or made while a worker could not load the
        # restore it was made from (its holdings count loads that are void), is not published.
        stale = bool(set(self.pending_faults) & set(result.workers) or self.pending_unrestorable)
        if result.generation is not None and stale:
            for w, c in request.faults.items():
                self.pending_faults.setdefault(w, c)
            for w, d in request.details.items():
                self.fault_details.setdefault(w, d)
            for w, c in request.unrestorable.items():
                self.pending_unrestorable.setdefault(w, c)
            self.pending_joins |= request.joined - self.standby
            self.pending_since = min(self.pending_since or now, request.first_event_at)
            return False, self._move(Phase.FAULT_DETECTED, "superseded by later faults", now)
        # A worker back while the decision ran (a new process, joining the next) is not failed.
        self.failed |= request.failed - self.pending_joins
        # Until a plan takes them (_adopt); not one that failed again while the decision ran.
        self.standby |= request.joined - request.failed - set(self.pending_faults)
        if result.unrecoverable is not None:
            return True, self._move(Phase.UNRECOVERABLE, result.unrecoverable, now)
        if result.generation is None or result.policy is None:
            self.failed -= request.joined
            back = Phase.TRANSITIONING if self.awaiting_ready else Phase.TRAINING
            return True, self._move(back, "current plan kept", now)
        if result.generation <= self.generation:
            raise ValueError(f"generation {result.generation} does not follow {self.generation}")
        self.generation = result.generation
        self._adopt(result.workers, now, result.layers)
        if result.policy == Policy.RESTORE:
            self.holdings.restored()
        self.failed -= set(self.plan_workers)
        if request.faults:
            self.recovery = _RecoveryWatch(
                result.generation, result.policy, request.first_event_at, set(self.plan_workers)
            )
        elif request.unrestorable and self.recovery is not None:
            # The recovery the failed restore was for goes on: it ends on this plan's steps.
            since = self.recovery.since
            self.recovery = _RecoveryWatch(
                result.generation, result.policy, since, set(self.plan_workers)
            )
        cause = f"{result.policy} plan for {request.cause}"
        return True, self._move(Phase.TRANSITIONING, cause, now)

    def finish(self, now: float) -> list[Transition]:
        """Every worker of the current plan stopped after its last step (`--max-steps`; the
        caller knows who stopped): nothing trains and nothing is left to decide. Not while a
        decision is due or running: its plan would have workers that are gone."""
        busy = self.in_flight or self.pending_faults or self.pending_unrestorable
        if busy or self.phase not in (Phase.TRAINING, Phase.TRANSITIONING):
            return []
        cause = f"every worker of generation {self.generation} finished its steps"
        return self._move(Phase.FINISHED, cause, now)

    def ready(self, worker: str, generation: int, now: float) -> tuple[bool, list[Transition]]:
        """A worker acknowledged `generation` (process groups built, migration done)."""
        if generation != self.generation or worker not in self.awaiting_ready:
            return False, []
        self.awaiting_ready.discard(worker)
        self.holdings.ready(worker, generation)
        if not self.awaiting_ready and self.phase is Phase.TRANSITIONING:
            cause = f"every worker runs generation {generation}"
            return True, self._move(Phase.TRAINING, cause, now)
        return True, []

    def step(
        self, worker: str, generation: int, now: float
    ) -> tuple[Recovery | None, list[Transition]]:
        """A worker committed a step of `generation`; a step also proves the plan was taken up."""
        transitions: list[Transition] = []
        if worker in self.awaiting_ready:
            transitions = self.ready(worker, generation, now)[1]
        if self.phase is Phase.FINISHED and generation == self.generation:
            transitions += self._move(Phase.TRAINING, f"{worker} committed a step again", now)
        if generation == self.generation:
            self.awaiting_step.discard(worker)
            self.holdings.committed(generation, self.failed | set(self.pending_faults))
        watch = self.recovery
        if watch is None or generation != watch.generation:
            return None, transitions
        watch.remaining.discard(worker)
        if watch.remaining:
            return None, transitions
        self.recovery = None
        return Recovery(watch.generation, watch.policy, max(0.0, now - watch.since)), transitions

    def overdue(self, now: float) -> tuple[str, ...]:
        """Workers of the current plan that have not acknowledged it in time, while others have.
        When none has, nothing tells them apart: a generation is built by all of its workers or none
        (chameleond.worker._rendezvous), so one that hangs keeps them all from it, and declaring all
        of them failed would leave no plan at all. The workers name the member missing from their
        attempts (chameleond.worker._absence)."""
        if not self.awaiting_ready or now <= self.ready_deadline:
            return ()
        if not set(self.plan_workers) - self.awaiting_ready:
            return ()
        return tuple(sorted(self.awaiting_ready - self.failed - set(self.pending_faults)))

    def busy(self) -> bool:
        return self.in_flight is not None

    def running(self) -> bool:
        """Every worker of the current plan acknowledged it and committed a step, and nothing
        waits for a decision: the plan demonstrably trains."""
        return (
            self.phase is Phase.TRAINING
            and not self.awaiting_step
            and self.in_flight is None
            and not self.pending_faults
            and not self.pending_joins
            and not self.pending_unrestorable
        )

    # ---- persistence -------------------------------------------------------------------------

    def snapshot(self, *, holdings: bool = True) -> dict[str, Any]:
        """The committed part of the machine; pending faults are not in it (their stream entries
        are still unacknowledged, so a restarted daemon reads them again). `holdings` False: all
        of it but the holdings (whose text is made apart, jobstate/snapshot.py)."""
        rec = self.recovery
        phase = self.phase
        if phase in (Phase.FAULT_DETECTED, Phase.PLANNING):
            phase = Phase.TRANSITIONING if self.awaiting_ready else Phase.TRAINING
        return {
            "phase": phase.value,
            "generation": self.generation,
            "failed": sorted(self.failed),
            "standby": sorted(self.standby),
            "plan_workers": list(self.plan_workers),
            "awaiting_ready": sorted(self.awaiting_ready),
            "awaiting_step": sorted(self.awaiting_step),
            "ready_deadline": self.ready_deadline,
            **({"holdings": self.holdings.to_json()} if holdings else {}),
            "recovery": None
            if rec is None
            else {
                "generation": rec.generation,
                "policy": rec.policy,
                "since": rec.since,
                "remaining": sorted(rec.remaining),
            },
        }

    @classmethod
    def restore(cls, d: Mapping[str, Any], *, ready_timeout_seconds: float) -> PolicyMachine:
        rec = d.get("recovery")
        return cls(
            ready_timeout_seconds=ready_timeout_seconds,
            phase=Phase(d["phase"]),
            generation=int(d["generation"]),
            failed=set(d["failed"]),
            standby=set(d.get("standby", ())),
            plan_workers=tuple(d["plan_workers"]),
            awaiting_ready=set(d["awaiting_ready"]),
            awaiting_step=set(d.get("awaiting_step", ())),
            ready_deadline=float(d["ready_deadline"]),
            holdings=Holdings.from_json(d["holdings"]) if "holdings" in d else Holdings(),
            recovery=None
            if not rec
            else _RecoveryWatch(
                int(rec["generation"]),
                Policy(rec["policy"]),
                float(rec["since"]),
                set(rec["remaining"]),
            ),
        )
