"""The policies: how each fault-tolerance strategy answers a trace event (docs/simulator.md).

Every price comes from the daemon's core: step times from `core.estimator`, layouts from
`core.search`, migrations from `core.restorer`, and the choice from `core.decide`, which the
`chameleon`, `reroute` and `dynamic` policies call exactly as the daemon does (the last two with
`force`), acting on the decision by the daemon's rules (`core.decision`: a join the planner does
not take, the prepared switch). Where a policy cannot continue without a checkpoint (its layout
lost the only copy of some layer, or its forced candidate is infeasible), it falls back to the
newest bubble checkpoint (PAPER.md section 9): a restore plan over the live workers, priced as
checkpoint load + the work since that checkpoint + rebuild (`core.candidates.restore_seconds`).

Fail-slow (a trace event's `slowed`): the baselines ignore it, training at the pace of their plan
with the workers' current speeds (`core.estimator` over `JobSpec.with_speeds`); `chameleon` and
`chameleon-elastic` answer each change of speeds with `core.slowdecide.decide_slow`, as the daemon
does, over the mean duration of the episodes seen so far. The daemon tells a slow worker only
from its training profiles, held for a while (`jobstate.slowness.detect_seconds`): the job trains
at its plan's slowed pace that long before the decision takes effect.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

from chameleond.core import restorer, selector
from chameleond.core.candidates import restore_seconds
from chameleond.core.decide import decide, initial_plan
from chameleond.core.decision import Decision, join_not_taken, prepared_switch, same_layout
from chameleond.core.estimator import Estimator, pipeline_seconds
from chameleond.core.holdings import Held, of_plan
from chameleond.core.layout import own_routing
from chameleond.core.plan import Pipeline, Plan
from chameleond.core.policy import Policy as PlanPolicy
from chameleond.core.slowdecide import decide_slow
from chameleond.core.spec import JobSpec
from chameleond.jobstate.slowness import (
    EPISODE_PRIOR_SECONDS,
    detect_seconds,
    expected_episode_seconds,
)
from chameleond.sim.timeline import Kind, Phase, Timeline
from chameleond.sim.trace import JobEvent, after

POLICIES = (
    "chameleon",
    "reroute",
    "dynamic",
    "redundant",
    "restart",
    "drop-replica",
    "chameleon-elastic",
)
# Policies whose steps train fewer samples than B after a fault (the others keep B: PAPER.md).
VARIABLE_BATCH = ("drop-replica", "chameleon-elastic")
# Policies that answer fail-slow (the others train at the slow worker's pace).
SLOW_AWARE = ("chameleon", "chameleon-elastic")
INF = math.inf


@dataclass(frozen=True)
class SimConfig:
    """Parameters of the baselines that the job spec does not carry (docs/simulator.md)."""

    # BAFT: checkpoints taken in pipeline bubbles cost about 1% of training time.
    bubble_checkpoint_overhead: float = 0.01
    # Checkpoint-and-restart: relaunching every process and re-initialising communicators
    # before the checkpoint is loaded (an assumption; docs/simulator.md).
    relaunch_seconds: float = 120.0
    # A baseline takes a worker slow for this long as failed (None: it waits for it forever).
    straggler_timeout_seconds: float | None = None


@dataclass(frozen=True)
class JobState:
    plan: Plan
    held: Held  # what each worker holds (core.holdings)
    mode: str = ""  # policy-specific ("fallback" once a policy restored from a checkpoint)


@dataclass
class Record:
    """One decision the simulator made: what it asked the core, and the answer."""

    seconds: float
    policy: str
    selected: str | None
    transition_seconds: float
    step_seconds: float
    note: str = ""


class Policy:
    """Shared machinery: the job, the fault history (for D), checkpoints, the restore fallback."""

    name = ""

    def __init__(self, spec: JobSpec, cfg: SimConfig) -> None:
        self.spec, self.cfg = spec, cfg
        self.est = Estimator(spec)
        self.initial = initial_plan(spec)
        self.batch = spec.training.global_batch
        self.fault_times: list[float] = []
        self.down_since: dict[str, float] = {}  # worker out -> when it failed
        self.repairs: list[tuple[float, float]] = []  # (went out, seconds out) per return
        self.generation = self.initial.generation
        self.records: list[Record] = []
        self.ids = [w.id for w in spec.workers]
        self.speeds: dict[str, float] = {}  # live workers below full speed
        self.slow_since: dict[str, float] = {}  # when each of them became slow
        self.episodes: list[float] = []  # durations of the episodes that ended in recovery
        self.at_speeds: dict[int, Plan] = {}  # plans the core priced with some worker slow
        self._steps: dict[tuple[int, tuple[tuple[str, float], ...]], tuple[Plan, float]] = {}
        self._slow_est: tuple[tuple[tuple[str, float], ...], Estimator] = ((), self.est)

    # -- set-up ------------------------------------------------------------------------------

    def window_seconds(self) -> float:
        """Training seconds one bubble checkpoint spans: its write (the largest slot over the
        storage bandwidth) fits in the pipeline bubbles (N_pp - 1)/(N_pp + N_m - 1) of the
        steps it spans."""
        write = self.write_seconds(self.initial)
        pipe = self.initial.pipelines[0]
        n, m = len(pipe.stages), pipe.micro_batches
        bubble = (n - 1) / (n + m - 1) if n > 1 else 0.0
        return write / bubble if bubble > 0 else write * 100.0

    def checkpoint_seconds(self, mtbf: float | None = None) -> float:
        """Training seconds between bubble checkpoints: Young's interval sqrt(2 c D) for a
        checkpoint costing c = BAFT's share of its window, never shorter than the window."""
        window = self.window_seconds()
        cost = self.cfg.bubble_checkpoint_overhead * window
        d = self.spec.mtbf_prior_seconds if mtbf is None else mtbf
        return max(window, math.sqrt(2 * cost * d))

    def kept(self) -> float:
        """The share of training time bubble checkpoints leave to training."""
        cost = self.cfg.bubble_checkpoint_overhead * self.window_seconds()
        return 1 - cost / self.interval

    def write_seconds(self, plan: Plan) -> float:
        largest = max(
            self.est.table.state_bytes(st.first_layer, st.end_layer)
            for p in plan.pipelines
            for st in p.stages
        )
        return largest / self.spec.costs.checkpoint_read_bytes_per_second

    def start(self) -> Timeline:
        state = JobState(self.initial, of_plan(self.initial))
        self.interval = self.checkpoint_seconds()
        tl = Timeline(state, self.interval)
        tl.follow([Phase(Kind.TRAINING, INF, self.throughput(self.initial))])
        return tl

    def throughput(self, plan: Plan) -> float:
        """Samples per second: the plan's batch (B, or fewer under a drop plan) per step."""
        return plan.global_batch / self.step_seconds(plan) * self.kept()

    def estimator(self) -> Estimator:
        """The model at the workers' current speeds."""
        if not self.speeds:
            return self.est
        key = tuple(sorted(self.speeds.items()))
        if self._slow_est[0] != key:
            self._slow_est = (key, Estimator(self.spec.with_speeds(self.speeds)))
        return self._slow_est[1]

    def step_seconds(self, plan: Plan) -> float:
        """The plan's step at the workers' current speeds: its estimate, unless a slow worker
        runs it or it was priced while one did."""
        slow = any(w in self.speeds for pipe in plan.routing for stage in pipe for w in stage)
        if not slow and id(plan) not in self.at_speeds:
            return plan.estimates.step_seconds
        key = (id(plan), tuple(sorted(self.speeds.items())))
        if key not in self._steps:
            step = self.estimator().step_seconds(plan.pipelines, plan.routing, plan.sync_groups)
            self._steps[key] = (plan, step)  # the plan kept: its id stays its own
        return self._steps[key][1]

    def mtbf(self, now: float) -> float:
        return selector.estimate_mtbf(self.fault_times, now, 0.0, self.spec.mtbf_prior_seconds)

    def window(self, now: float) -> float:
        """The expected time to the next fault or return (selector.window_seconds)."""
        return selector.window_at(now, self.mtbf(now), self.repairs, list(self.down_since.values()))

    def next_generation(self, plan: Plan) -> int:
        self.generation = max(self.generation, plan.generation) + 1
        return self.generation

    def note(
        self, now: float, selected: str | None, plan: Plan | None, tr: float, why: str = ""
    ) -> None:
        step = plan.estimates.step_seconds if plan is not None else INF
        self.records.append(Record(now, self.name, selected, tr, step, why))

    # -- events ------------------------------------------------------------------------------

    def event(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        if ev.failed:
            self.fault_times.append(ev.seconds)
        for w in ev.failed:
            self.down_since.setdefault(w, ev.seconds)
        for w in ev.joined:
            if w in self.down_since:
                start = self.down_since.pop(w)
                self.repairs.append((start, ev.seconds - start))
        if not isinstance(self, Restart):  # the interval follows D (Young, D estimated online)
            self.interval = self.checkpoint_seconds(self.mtbf(ev.seconds))
            tl.checkpoint_seconds = self.interval
        state: JobState = tl.state
        held = {w: iv for w, iv in state.held.items() if w not in ev.failed and w not in down}
        # A worker that comes back is a new process: it holds nothing.
        for w in ev.joined:
            held.pop(w, None)
        tl.state = replace(state, held=held)
        before = self.speeds
        _, self.speeds = after(ev, down, before)
        for w in set(before) - set(self.speeds):
            start = self.slow_since.pop(w)
            if w not in down:  # recovered (a failure ends an episode as a fault)
                self.episodes.append(ev.seconds - start)
        for w in set(self.speeds) - set(before):
            self.slow_since[w] = ev.seconds
        changed = self.speeds != before
        if ev.failed or ev.joined:
            self.answer(tl, ev, down)
        if changed:
            self.slowed(tl, ev, down)

    def answer(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        raise NotImplementedError

    def slowed(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        """Speeds changed: the policy ignores it, every training phase from now on trains at its
        plan's pace at the new speeds (a slow worker holds up its pipeline and, through the
        synchronous step, the job)."""
        state: JobState = tl.state
        plan = state.plan
        pending = []
        for ph in tl.pending:
            if isinstance(ph.state, JobState):
                plan = ph.state.plan
            if ph.kind == Kind.TRAINING:
                ph = replace(ph, throughput=self.rate(plan, down))
            pending.append(ph)
        tl.pending = pending

    def rate(self, plan: Plan, down: frozenset[str]) -> float:
        """Samples per second while training `plan` with `down` out, at the current speeds."""
        return self.throughput(plan)

    def joined_for(self, plan: Plan, down: Collection[str]) -> list[str]:
        """Live workers the plan does not run: spares and workers back from a failure."""
        running = {st.worker for p in plan.pipelines for st in p.stages} - set(plan.excluded)
        return [w for w in self.ids if w not in down and w not in running]

    def checkpoint(self, tl: Timeline) -> tuple[int, int]:
        """(the newest bubble checkpoint's step, the job's step)."""
        step = int(tl.samples // self.batch)
        return step - int(tl.lost_samples() // self.batch), step

    def decide(
        self, tl: Timeline, now: float, down: Collection[str], *, force: PlanPolicy | None = None,
        current: Plan | None = None, holdings: Held | None = None,
    ) -> Decision:  # fmt: skip
        state: JobState = tl.state
        plan = current or state.plan
        ckpt, step = self.checkpoint(tl)
        # A policy that answers fail-slow decides on the workers' current speeds.
        spec = self.spec.with_speeds(self.speeds) if self.name in SLOW_AWARE else self.spec
        d = decide(
            spec, plan, sorted(down), mtbf_seconds=self.mtbf(now),
            window_seconds=self.window(now), generation=self.next_generation(plan),
            joined=self.joined_for(plan, down),
            force=force, holdings=state.held if holdings is None else holdings,
            checkpoint_step=ckpt, step=step,
        )  # fmt: skip
        if d.follow_up is not None:
            self.generation = d.follow_up.generation
        if spec is not self.spec:
            self.priced_at_speeds(d.plan, d.follow_up)
        return d

    def priced_at_speeds(self, *plans: Plan | None) -> None:
        self.at_speeds.update((id(p), p) for p in plans if p is not None)

    def restore(self, tl: Timeline, now: float, down: Collection[str], extra: float = 0.0) -> None:
        """Back to the newest checkpoint on a layout searched over the live workers."""
        d = self.decide(tl, now, down, holdings={})
        if d.plan is None:
            self.note(now, None, None, INF, d.unrecoverable or "")
            tl.follow([Phase(Kind.DOWN, INF, 0.0)])
            return
        self.apply_restore(tl, now, d.plan, extra, "fallback")

    def apply_restore(self, tl: Timeline, now: float, plan: Plan, extra: float, mode: str) -> None:
        state: JobState = tl.state
        ckpt, step = self.checkpoint(tl)
        lost = (step - ckpt) * state.plan.estimates.step_seconds
        total = restore_seconds(self.spec, state.plan, plan, ckpt, step) + extra
        self.note(now, "restore", plan, total)
        tl.roll_back()
        tl.follow([
            Phase(Kind.RESTART, total - lost, 0.0),
            Phase(Kind.LOST, lost, 0.0),
            Phase(Kind.TRAINING, INF, self.throughput(plan), JobState(plan, of_plan(plan), mode)),
        ])  # fmt: skip

    def switch(
        self, tl: Timeline, now: float, plan: Plan, transition: float, mode: str = ""
    ) -> None:
        """Stop for `transition`, then train on `plan`."""
        state: JobState = tl.state
        tl.follow([
            Phase(Kind.TRANSITION, transition, 0.0, JobState(plan, state.held, mode)),
            Phase(Kind.TRAINING, INF, self.throughput(plan), JobState(plan, of_plan(plan), mode)),
        ])  # fmt: skip


class Choose(Policy):
    """`chameleon` (the selector decides), `reroute` and `dynamic` (forced): core.decide."""

    def __init__(self, spec: JobSpec, cfg: SimConfig, name: str, force: PlanPolicy | None) -> None:
        super().__init__(spec, cfg)
        self.name, self.force = name, force

    def answer(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        now = ev.seconds
        state: JobState = tl.state
        current = state.plan
        if self.force == PlanPolicy.REROUTE and not ev.failed:
            # ReCycle keeps its layout: a worker back from a failure takes its own slot again,
            # receiving its layers from a peer (the reroute candidate's repairs).
            back = set(ev.joined) & set(current.excluded)
            if not back:
                return
            current = replace(current, excluded=tuple(w for w in current.excluded if w not in back))
        d = self.decide(tl, now, down, force=self.force, current=current)
        if d.selected is None or d.plan is None:
            self.note(now, None, None, INF, d.unrecoverable or "")
            tl.follow([Phase(Kind.DOWN, INF, 0.0)])
            return
        if d.selected is PlanPolicy.RESTORE:
            self.apply_restore(tl, now, d.plan, 0.0, "fallback")
            return
        if self.force is not None and d.selected != self.force:
            # The forced policy cannot continue (d.note says why): restart from the checkpoint.
            self.restore(tl, now, down)
            return
        plan, tr = d.plan, d.plan.estimates.transition_seconds
        if self.force == PlanPolicy.REROUTE:
            # ReCycle's rejoin: the returning worker takes its slot back only where the step
            # gets faster (its stage's data-parallel group grows, and syncs slower).
            if not ev.failed and plan.estimates.step_seconds >= current.estimates.step_seconds:
                return
        elif join_not_taken(current, plan, joins_only=not ev.failed):
            return  # a join the planner does not take: keep the current plan (as the daemon)
        self.note(now, d.selected, plan, tr, d.note)
        phases = [
            Phase(Kind.TRANSITION, tr, 0.0, JobState(plan, state.held)),
            Phase(Kind.TRAINING, INF, self.throughput(plan), JobState(plan, of_plan(plan))),
        ]
        prepared = prepared_switch(d, self.force)
        if prepared is not None:  # reroute first, switch once the prepared plan is ready
            f, _ = prepared
            phases[-1] = replace(phases[-1], seconds=d.search_seconds)
            phases += [
                Phase(
                    Kind.TRANSITION, f.estimates.transition_seconds, 0.0, JobState(f, of_plan(plan))
                ),
                Phase(Kind.TRAINING, INF, self.throughput(f), JobState(f, of_plan(f))),
            ]
        tl.follow(phases)

    def slowed(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        if self.force is not None or (not ev.slowed and (ev.failed or ev.joined)):
            super().slowed(tl, ev, down)  # a baseline; or speeds the fault's decision saw
            return
        now = ev.seconds
        state: JobState = tl.state
        current = state.plan
        running = {w for pipe in current.routing for stage in pipe for w in stage}
        back = frozenset(w for w, f in ev.slowed.items()
                         if f >= 1.0 and w not in down and w not in running)  # fmt: skip
        if back:  # back to speed, left out while slow: a join (the decision sees the speeds)
            self.answer(tl, JobEvent(now, frozenset(), back), down)
            return
        # A worker back at full speed is named at 1.0: it takes its share back.
        speeds = {**{w: 1.0 for w in ev.slowed if w not in down}, **self.speeds}
        cause = ", ".join(
            f"{w} recovered" if f >= 1.0 else f"{w} slow: speed {f:.2f}"
            for w, f in sorted(speeds.items())
            if w in ev.slowed
        )
        d = decide_slow(
            self.spec, current, speeds,
            duration_seconds=expected_episode_seconds(self.episodes, EPISODE_PRIOR_SECONDS),
            generation=self.next_generation(current), mtbf_seconds=self.mtbf(now),
            holdings=state.held, cause=cause,
        )  # fmt: skip
        self.priced_at_speeds(d.plan)
        if d.plan is None or same_layout(d.plan, current):
            self.note(now, d.selected or "keep", current, 0.0, cause)
            super().slowed(tl, ev, down)  # the current plan at the new pace
            return
        # Until the change is detected the job trains on at the current plan's new pace.
        pace = self.rate(current, down)
        detect = detect_seconds(self.batch / pace if pace > 0 else 0.0, len(current.members))
        if d.plan.policy is PlanPolicy.RESTORE:  # excluding the slow workers lost some state
            # Priced as a stop that long (training on through it would only do better).
            self.apply_restore(tl, now, d.plan, detect, "fallback")
            return
        plan, tr = d.plan, d.plan.estimates.transition_seconds
        self.note(now + detect, d.selected, plan, tr, cause)
        self.switch(tl, now, plan, tr)
        tl.pending.insert(0, Phase(Kind.TRAINING, detect, pace))


class Restart(Policy):
    """Checkpoint-and-restart of the whole job: synchronous checkpoints every Young interval
    sqrt(2 C D) (C: one checkpoint's write, D: the spec's prior); on a fault, relaunch, load the
    newest checkpoint on a layout searched over the live workers, train the lost steps again."""

    name = "restart"

    def __init__(self, spec: JobSpec, cfg: SimConfig) -> None:
        super().__init__(spec, cfg)
        self.write = self.write_seconds(self.initial)
        self.interval = math.sqrt(2 * self.write * spec.mtbf_prior_seconds)

    def checkpoint_seconds(self, mtbf: float | None = None) -> float:
        return math.sqrt(2 * self.write * (self.spec.mtbf_prior_seconds if mtbf is None else mtbf))

    def throughput(self, plan: Plan) -> float:
        return self.batch / self.step_seconds(plan) * self.interval / (self.interval + self.write)

    def answer(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        now = ev.seconds
        state: JobState = tl.state
        if ev.failed & {st.worker for p in state.plan.pipelines for st in p.stages}:
            self.restore(tl, now, down, self.cfg.relaunch_seconds)
            # The interval follows the faults seen so far (Young, with D estimated online).
            self.interval = math.sqrt(2 * self.write * self.mtbf(now))
            tl.checkpoint_seconds = self.interval
            return
        if not ev.joined:
            return
        # Scale up only when the larger layout pays for a planned restart within D.
        d = self.decide(tl, now, down, holdings={})
        if d.plan is None:
            return
        gain = self.throughput(d.plan) - self.throughput(state.plan)
        cost = self.write + self.cfg.relaunch_seconds + d.plan.estimates.transition_seconds
        if gain > 0 and gain * self.mtbf(now) > cost * self.throughput(state.plan):
            tl.roll_back()  # a planned restart saves first: nothing is lost
            self.note(now, "restore", d.plan, cost, "scale up")
            plan = d.plan
            tl.follow([
                Phase(Kind.RESTART, cost, 0.0),
                Phase(Kind.TRAINING, INF, self.throughput(plan), JobState(plan, of_plan(plan))),
            ])  # fmt: skip


class DropReplica(Policy):
    """TorchFT-style: a data-parallel replica (pipeline) with a failed worker drops out and the
    others go on with fewer samples per step; it rejoins, after a transfer of its state from a
    healthy replica, once all its workers are back."""

    name = "drop-replica"

    def live_plan(
        self, plan: Plan, down: Collection[str]
    ) -> tuple[tuple[Pipeline, ...], float, float]:
        """The pipelines that can train, their samples per second and their step's seconds."""
        live = tuple(p for p in plan.pipelines if not any(st.worker in down for st in p.stages))
        if not live:
            return live, 0.0, INF
        routing = own_routing(live)
        groups = restorer.sync_groups(live, ())
        step = self.estimator().step_seconds(live, routing, groups)
        samples = sum(p.micro_batches for p in live) * self.spec.training.micro_batch
        return live, samples / step * self.kept(), step

    def rate(self, plan: Plan, down: frozenset[str]) -> float:
        return self.live_plan(plan, down)[1]

    def answer(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        now = ev.seconds
        state: JobState = tl.state
        # Who was down before this event: its failures were not, its rejoins were.
        before, thr_before, step_before = self.live_plan(state.plan, (down - ev.failed) | ev.joined)
        live, thr, _ = self.live_plan(state.plan, down)
        if not live:
            self.restore(tl, now, down)
            return
        if ev.failed:
            self.note(now, "drop", state.plan, self.spec.rebuild_seconds)
            tl.follow([Phase(Kind.TRANSITION, self.spec.rebuild_seconds, 0.0),
                       Phase(Kind.TRAINING, INF, thr)])  # fmt: skip
            return
        back = [p for p in live if p not in before]
        if not back:
            return
        # Each returning worker fetches its slot's parameters and optimizer state (what a
        # migration moves, core.restorer) from a live replica; its host's interface carries all
        # of it.
        per_host: dict[str, int] = {}
        host = {w.id: w.host for w in self.spec.workers}
        layers = self.spec.layers
        for p in back:
            for st in p.stages:
                b = sum(
                    lp.param_bytes + lp.optimizer_bytes
                    for lp in layers[st.first_layer : st.end_layer]
                )
                per_host[host[st.worker]] = per_host.get(host[st.worker], 0) + b
        fetch = max(per_host.values()) / self.spec.nic_bytes_per_second()
        stall, overlap = rejoin_seconds(self.spec.rebuild_seconds, fetch, step_before)
        self.note(now, "rejoin", state.plan, stall + overlap)
        tl.follow([
            Phase(Kind.TRAINING, overlap, thr_before),
            Phase(Kind.TRANSITION, stall, 0.0),
            Phase(Kind.TRAINING, INF, thr),
        ])  # fmt: skip


def rejoin_seconds(rebuild: float, fetch: float, step: float) -> tuple[float, float]:
    """A TorchFT replica's rejoin: (seconds nothing trains, seconds one step of the live replicas
    trains meanwhile). At the step whose quorum admits it, every replica's quorum thread rebuilds
    its process group, which then includes the healing replica, and the healing replica receives
    its state from a healthy peer in that thread; each replica's gradient all-reduce waits for its
    quorum thread and, being one collective over the group, for the healing replica's
    (torchft/manager.py: `_async_quorum`, `allreduce` -> `wait_quorum`). The live replicas'
    forward and backward of that step run meanwhile (asynchronous quorum): at most one step
    overlaps the rebuild and the transfer; the rest stops training."""
    total = rebuild + fetch
    overlap = min(step, total)
    return total - overlap, overlap


class Redundant(Policy):
    """Bamboo-style redundant computation: each stage also holds its successor's layers (the last
    stage holds the first's) and runs their forward pass every step (eager forward redundant
    computation), so a failed stage is taken over at once by its predecessor, which then runs
    both. Two failed neighbours lose a stage: the bubble-checkpoint fallback."""

    name = "redundant"

    def pipeline_time(self, pipe: Pipeline, down: Collection[str]) -> float:
        t = self.est.table
        n = len(pipe.stages)
        speed = [self.speeds.get(st.worker, 1.0) for st in pipe.stages]
        f = [t.forward_seconds(s.first_layer, s.end_layer) for s in pipe.stages]
        b = [t.backward_seconds(s.first_layer, s.end_layer) for s in pipe.stages]
        # eager FRC: each stage also runs its successor's forward
        fwd = [(f[s] + (f[(s + 1) % n] if n > 1 else 0.0)) / speed[s] for s in range(n)]
        bwd = [b[s] / speed[s] for s in range(n)]
        keep = [True] * n
        for s, st in enumerate(pipe.stages):
            if st.worker in down:
                pred = (s - 1) % n
                fwd[pred] += f[s] / speed[pred]  # runs the failed stage for real
                bwd[pred] += b[s] / speed[pred]
                keep[s] = False
        fwd = [x for x, k in zip(fwd, keep, strict=True) if k]
        bwd = [x for x, k in zip(bwd, keep, strict=True) if k]
        comm = [
            self.spec.intra_host.transfer_seconds(t.output_bytes(st.end_layer))
            for st in pipe.stages[:-1]
        ]
        return pipeline_seconds(fwd, bwd, comm[: len(fwd) - 1], pipe.micro_batches)

    def rc_step_seconds(self, plan: Plan, down: Collection[str]) -> float:
        base = self.estimator().makespan(plan.pipelines, plan.routing)
        worst = max(self.pipeline_time(p, down) for p in plan.pipelines)
        return self.step_seconds(plan) - base + worst

    def broken(self, plan: Plan, down: Collection[str]) -> bool:
        for p in plan.pipelines:
            n = len(p.stages)
            gone = [st.worker in down for st in p.stages]
            if n == 1 and gone[0]:
                return True
            if n > 1 and any(gone[s] and gone[(s - 1) % n] for s in range(n)):
                return True
        return False

    def memory_ok(self, plan: Plan) -> bool:
        t = self.est.table
        for p in plan.pipelines:
            n = len(p.stages)
            for s, st in enumerate(p.stages):
                nxt = p.stages[(s + 1) % n]
                need = (plan.estimates.peak_memory_bytes.get(st.worker, 0)
                        + t.state_bytes(nxt.first_layer, nxt.end_layer))  # fmt: skip
                if need > self.spec.worker(st.worker).memory_bytes:
                    return False
        return True

    def start(self) -> Timeline:
        tl = super().start()
        if not self.memory_ok(self.initial):
            tl.follow([Phase(Kind.DOWN, INF, 0.0)])
        return tl

    def throughput(self, plan: Plan) -> float:
        return self.rc_throughput(plan, ())

    def rc_throughput(self, plan: Plan, down: Collection[str]) -> float:
        return self.batch / self.rc_step_seconds(plan, down) * self.kept()

    def rate(self, plan: Plan, down: frozenset[str]) -> float:
        in_plan = {st.worker for p in plan.pipelines for st in p.stages}
        return self.rc_throughput(plan, down & in_plan)

    def answer(self, tl: Timeline, ev: JobEvent, down: frozenset[str]) -> None:
        now = ev.seconds
        state: JobState = tl.state
        plan = state.plan
        if not self.memory_ok(self.initial):
            return
        in_plan = {st.worker for p in plan.pipelines for st in p.stages}
        if self.broken(plan, down & in_plan):
            d = self.decide(tl, now, down, holdings={})
            if d.plan is None:
                self.note(now, None, None, INF, d.unrecoverable or "")
                tl.follow([Phase(Kind.DOWN, INF, 0.0)])
                return
            self.apply_restore(tl, now, d.plan, 0.0, "fallback")
            return
        thr = self.rc_throughput(plan, down & in_plan)
        extra = 0.0
        back = ev.joined & in_plan
        if back:  # a returning worker receives its slot's and its successor's state
            t = self.est.table
            extra = max(
                2 * t.state_bytes(st.first_layer, st.end_layer)
                for p in plan.pipelines for st in p.stages if st.worker in back
            ) / self.spec.nic_bytes_per_second()  # fmt: skip
        self.note(now, "redundant", plan, self.spec.rebuild_seconds + extra)
        tl.follow([Phase(Kind.TRANSITION, self.spec.rebuild_seconds + extra, 0.0),
                   Phase(Kind.TRAINING, INF, thr)])  # fmt: skip


def elastic(spec: JobSpec) -> JobSpec:
    """The job with drop-replica's freedom: its batch may shrink to one micro-batch
    (`training.min_global_batch`), so `decide` also weighs the drop candidate."""
    training = replace(spec.training, min_global_batch=spec.training.micro_batch)
    return replace(spec, training=training)


def make_policy(name: str, spec: JobSpec, cfg: SimConfig | None = None) -> Policy:
    cfg = cfg or SimConfig()
    if name == "chameleon":
        return Choose(spec, cfg, "chameleon", None)
    if name == "chameleon-elastic":
        return Choose(elastic(spec), cfg, name, None)
    if name in (PlanPolicy.REROUTE, PlanPolicy.DYNAMIC):
        return Choose(spec, cfg, name, PlanPolicy(name))
    if name == "restart":
        return Restart(spec, cfg)
    if name == "drop-replica":
        return DropReplica(spec, cfg)
    if name == "redundant":
        return Redundant(spec, cfg)
    raise ValueError(f"unknown policy {name!r}: one of {', '.join(POLICIES)}")
