"""Simulated workers for `chameleonctl bench control-plane`: one process, many asyncio tasks, each a
worker that speaks the real protocol (docs/protocol.md) and trains nothing.

Each simulated worker has what a real one has on its job's Redis: a command connection and a pub/sub
connection (chameleond/bench/resp.py: the same commands as redis-py's, at a fraction of its CPU),
both named `chameleon-worker:{job}:{worker}:{incarnation}` (chameleond/worker/_link.py
`connection_name`), a new incarnation per process. It sends `profile` (every layer of the spec, as a
start-up profile) then `register`; a heartbeat every `heartbeat_seconds` of the job's size unless a
step or an ack went out within it (as a real worker's); on every announcement of a newer generation
on `Keys(job).plans_channel`, and when the committed generation (polled every PLAN_POLL_SECONDS) is
newer than its own, it GETs the plan's delta from the one it holds, else the packed plan, as the
real PlanWatcher does, and acks `ready` for each new generation it is a member of (at once: no
process groups to build). As a member it commits a step every step period of the shared clock,
reported as a real worker's (its first of a plan, then `step_reported`), and
a training `profile` of the layers it holds every `profile_every_steps` of its plan (at its
`profile_phase`, as a real worker's from a plan's second report on). It listens on the job's
liveness channel; when a member of its plan is reported gone, its generation has failed (the
world group and the commit vote span the plan): it notes when, commits no more steps of that plan,
and names the dead member in a `fault`, with the generation it saw it fail in, if it is one of
the member's first reporters (chameleond.protocol.fault_reporters), else only when no newer plan
has come FAULT_FALLBACK_SECONDS later, as a real worker does (chameleond/worker/_attribution.py).

The plan bytes each worker reads (a delta, or the packed plan) are parsed once per process
(applied to their base, verified, then `plan_from_dict`), and so is each liveness notice (and
who names whom after it): the
load on Redis is every worker's, the parsing cost one worker's. Every event is signed with the
job's keyring ($CHAMELEON_SECRET_FILE). Observations go to stdout, one JSON list a line:
`["up", n]` once every worker has registered, `["ack", worker, generation, at]`,
`["learned", worker, peer, incarnation, at]` (once per worker and notice: the first member it
names gone), `["error", text]`.

Run: `python -m chameleond.bench.simworkers CONFIG.json`, the config holding `url`, `job`,
`spec` (a spec file), `workers` ([[id, host], ...]), `step_seconds` and `epoch` (the shared
clock's origin, unix time).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import secrets
import sys
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import uvloop

from chameleond.auth import AuthError, Keyring
from chameleond.bench.resp import Connection
from chameleond.core.plan import PlanError, plan_from_dict
from chameleond.core.plandelta import DeltaError, apply_delta, parse_delta
from chameleond.core.spec import JobSpec, load_spec
from chameleond.events import HEARD, Ack, AckPhase, Event, Fault, Heartbeat, Profile, Register, Step
from chameleond.protocol import (
    FAULT_FALLBACK_SECONDS,
    PLAN_POLL_SECONDS,
    Keys,
    fault_reporters,
    heartbeat_seconds,
    profile_every_steps,
    profile_phase,
    step_reported,
    unpacked_plan,
)
from chameleond.protocol import worker_connection_name as connection_name

MEMORY_BYTES = 80 * 2**30
LIVENESS = "liveness"  # the kind a liveness notice is signed as (chameleond/daemon/connwatch.py)


@dataclass(frozen=True)
class Layout:
    """One plan as the simulated workers use it: its generation, global batch, workers (sorted,
    as the world group's ranks), members, and each member's layers."""

    generation: int
    global_batch: int
    workers: tuple[str, ...]
    members: frozenset[str]
    layers: dict[str, tuple[int, ...]]


def layout_of(doc: dict[str, Any]) -> Layout:
    plan = plan_from_dict(doc)
    owned: dict[str, tuple[int, ...]] = {}
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            w = stage.worker
            if w not in owned:  # most workers own one stage
                owned[w] = tuple(stage.layers)
            else:
                owned[w] = tuple(sorted({*owned[w], *stage.layers}))
    return Layout(plan.generation, plan.global_batch, plan.workers, plan.members, owned)


def notice_of(
    raw: bytes, keyring: Keyring | None, job: str
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The gone and the live incarnations a liveness notice names; ValueError, TypeError or
    AuthError when it is not one of the job's daemon."""
    doc = json.loads(raw)
    if keyring is not None:
        keyring.verify_doc(LIVENESS, job, doc)
    gone, live = ([(str(w), str(i)) for w, i in doc.get(k, [])] for k in ("gone", "live"))
    return gone, live


class Shared:
    """What a process's simulated workers share: the connection settings, the keyring, the spec's
    layer figures, parsed plans by their bytes, and the observation output."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.url: str = cfg["url"]
        self.keys = Keys(cfg["job"])
        self.keyring = Keyring.configured(os.environ)
        self.spec: JobSpec = load_spec(cfg["spec"])
        self.step_seconds = float(cfg["step_seconds"])
        self.epoch = float(cfg["epoch"])
        self._plans: dict[bytes, Layout | None] = {}  # by the bytes read (packed plan or delta)
        self._bases: dict[bytes, int] = {}  # a delta's base generation
        self._docs: dict[int, dict[str, Any]] = {}  # the newest plans' documents: deltas' bases
        self._notice: tuple[bytes, list[tuple[str, str]]] | None = None  # the last liveness
        self._dead: set[str] = set()  # the ids the notices hold gone (not live again)
        self._named: dict[int, dict[str, set[str]]] = {}  # by generation: who names whom at once
        # The dead members each worker left to their first reporters, in the order deferred:
        # (due, worker, generation failed, the dead, when it failed); one task for them all.
        self._deferred: deque[tuple[float, SimWorker, int, list[str], float]] = deque()
        self._fallbacks: asyncio.Task[None] | None = None
        self._late: set[asyncio.Task[None]] = set()  # held: the loop keeps weak references
        self._reports: dict[tuple[int, ...] | None, list[dict[str, Any]]] = {}
        self._out: list[str] = []
        self.registered = 0

    def layout(self, raw: bytes) -> Layout | None:
        """The plan in `raw`, verified and parsed once per distinct bytes; None when it is not a
        valid plan of the job's daemon (the worker keeps the plan it holds)."""
        if raw not in self._plans:
            try:
                self._keep(raw, unpacked_plan(raw))
            except (ValueError, zlib.error) as e:
                self._refuse(raw, e)
        return self._plans[raw]

    def delta(self, raw: bytes) -> tuple[int, Layout | None]:
        """The plan the delta in `raw` makes from the plan of generation `base` (a worker holding
        that one reads it): (base, the plan), once per distinct bytes; (-1, None) when it is
        not one of the job's daemon, or this process never held its base."""
        if raw not in self._plans:
            self._bases[raw] = -1
            try:
                delta = parse_delta(zlib.decompress(raw))
                held = delta.get("base")
                base = self._docs.get(held) if isinstance(held, int) else None
                if base is None:
                    self._plans[raw] = None
                else:
                    made = apply_delta(base, delta, check_digest=self.keyring is None)
                    self._keep(raw, made)  # verifies its signature, when signed
                    self._bases[raw] = int(base["generation"])
            except (DeltaError, zlib.error) as e:
                self._refuse(raw, e)
        return self._bases[raw], self._plans[raw]

    def gone(self, raw: bytes) -> list[tuple[str, str]]:
        """A liveness notice's gone incarnations, verified once per process (the newest)."""
        if self._notice is None or self._notice[0] != raw:
            gone, live = notice_of(raw, self.keyring, self.keys.job)
            self._notice = (raw, gone)
            self._dead |= {w for w, _ in gone}
            self._dead -= {w for w, _ in live}
            self._named.clear()
        return self._notice[1]

    def names(self, plan: Layout, worker: str) -> set[str]:
        """The dead members of `plan` that `worker` names at once (it is among their first
        reporters, from the notices this process holds), worked out once per plan and notice."""
        named = self._named.get(plan.generation)
        if named is None:
            named = self._named[plan.generation] = {}
            for dead, reporters in fault_reporters(plan.workers, self._dead).items():
                for w in reporters:
                    named.setdefault(w, set()).add(dead)
        return named.get(worker, set())

    def defer(self, sim: SimWorker, generation: int, dead: list[str], at: float) -> None:
        """`sim` names `dead` if no plan newer than `generation` has come FAULT_FALLBACK_SECONDS
        from now: as each real worker's own deferral, with one timer for the process."""
        due = time.monotonic() + FAULT_FALLBACK_SECONDS
        self._deferred.append((due, sim, generation, dead, at))
        if self._fallbacks is None or self._fallbacks.done():
            self._fallbacks = asyncio.create_task(self._fall_back())

    async def _fall_back(self) -> None:
        while self._deferred:
            due, sim, generation, dead, at = self._deferred[0]
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            self._deferred.popleft()
            if sim.held <= generation:
                late = asyncio.create_task(sim.name_late(generation, dead, at))
                self._late.add(late)
                late.add_done_callback(self._late.discard)

    def _keep(self, raw: bytes, doc: object) -> None:
        if len(self._plans) > 8:
            gone = next(iter(self._plans))
            self._plans.pop(gone)
            self._bases.pop(gone, None)
        try:
            if not isinstance(doc, dict):
                raise PlanError("not a JSON object")
            if self.keyring is not None:
                self.keyring.verify_doc("plan", self.keys.job, doc)
            self._plans[raw] = layout = layout_of(doc)
        except (AuthError, PlanError) as e:
            self._refuse(raw, e)
            return
        self._docs[layout.generation] = doc
        while len(self._docs) > 4:
            self._docs.pop(min(self._docs))

    def _refuse(self, raw: bytes, e: Exception) -> None:
        self.note("error", f"plan refused: {e}")
        self._plans[raw] = None

    def fields(self, event: Event) -> dict[str, str]:
        entry = event.to_fields()
        return self.keyring.sign_event(self.keys.job, entry) if self.keyring else entry

    def layer_report(self, layers: tuple[int, ...] | None) -> list[dict[str, Any]]:
        """The spec's figures of `layers` (all of them: None) as a profile's `layers` list (made
        once per set of layers: the process's workers report the same figures)."""
        report = self._reports.get(layers)
        if report is None:
            ids = range(len(self.spec.layers)) if layers is None else layers
            report = self._reports[layers] = [
                {**asdict(self.spec.layers[i]), "index": i} for i in ids
            ]
        return report

    def note(self, *record: Any) -> None:
        self._out.append(json.dumps(record))

    async def flush_forever(self) -> None:
        while True:
            if self._out:
                out, self._out = self._out, []
                sys.stdout.write("\n".join(out) + "\n")
                sys.stdout.flush()
            await asyncio.sleep(0.1)


class SimWorker:
    """One simulated worker: its two named connections and its loops."""

    def __init__(self, shared: Shared, worker: str, host: str) -> None:
        self.s = shared
        self.worker = worker
        self.host = host
        self.incarnation = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.name = connection_name(shared.keys.job, worker, self.incarnation)
        self.cmd: Connection  # opened by run()
        self.plan: Layout | None = None
        self.acked = 0  # the newest generation acked ready
        self.stepped = 0  # the generation of its newest step
        self.failed = 0  # the newest generation it saw fail (a member gone): no more steps of it
        self.heard_at = 0.0  # time.monotonic() of the last heartbeat, step or ack sent
        self.raw: bytes | None = None  # the plan bytes held: an unchanged GET parses nothing
        self.reported: set[tuple[str, str]] = set()  # (peer, incarnation) seen gone
        self._nap: asyncio.Future[bool] | None = None  # the steps loop's sleep

    async def send(self, event: Event) -> None:
        fields = [x for kv in self.s.fields(event).items() for x in kv]
        await self.cmd.call("XADD", self.s.keys.events, "*", *fields)
        if isinstance(event, HEARD):
            self.heard_at = time.monotonic()

    async def run(self) -> None:
        self.cmd = await Connection.open(self.s.url, self.name)
        sub = await Connection.open(self.s.url, self.name)
        messages = sub.subscribe(self.s.keys.plans_channel, self.s.keys.liveness_channel)
        await self.send(Profile(self.worker, {"layers": self.s.layer_report(None)}))
        reg = Register(self.worker, self.host, MEMORY_BYTES, "cuda:0", os.getpid())
        await self.send(reg)
        await self.read_plan()
        self.s.registered += 1
        await asyncio.gather(self.beat(), self.steps(), self.listen(messages), self.poll())

    async def beat(self) -> None:
        period = heartbeat_seconds(len(self.s.spec.workers))
        await asyncio.sleep(random.uniform(0, period))  # noqa: S311 - a phase, not a secret
        while True:  # skipped when a step or an ack went out within the period, as a worker's
            if time.monotonic() - self.heard_at >= period * 0.9:
                await self.send(Heartbeat(self.worker, at=time.time()))
            await asyncio.sleep(period)

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(PLAN_POLL_SECONDS * random.uniform(0.9, 1.1))  # noqa: S311
            stored = await self.cmd.call("HGET", self.s.keys.state, "generation")
            if int(stored or 0) > self.held:
                await self.read_plan()

    async def listen(self, messages: AsyncIterator[tuple[bytes, bytes]]) -> None:
        liveness = self.s.keys.liveness_channel.encode()
        async for channel, data in messages:
            if channel == liveness:
                await self.on_liveness(data)
            elif int(data) > self.held:
                await self.read_plan()

    @property
    def held(self) -> int:
        return self.plan.generation if self.plan is not None else 0

    async def read_plan(self) -> None:
        """As the real PlanWatcher: the plan's delta from the one held, else the whole plan."""
        if self.plan is not None:
            raw = await self.cmd.call("GET", self.s.keys.plan_delta)
            if raw is not None:
                if raw == self.raw:
                    return
                base, made = self.s.delta(raw)
                if made is not None and made.generation <= self.plan.generation:
                    return
                if made is not None and base == self.plan.generation:
                    await self.take(raw, made)
                    return
        raw = await self.cmd.call("GET", self.s.keys.plan_packed)
        if raw is None or raw == self.raw:
            return
        await self.take(raw, self.s.layout(raw))

    async def take(self, raw: bytes, layout: Layout | None) -> None:
        if layout is None or (self.plan is not None and layout.generation <= self.plan.generation):
            return
        self.plan, self.raw = layout, raw
        self.poke()
        if self.worker in layout.members and layout.generation > self.acked:
            ready = Ack(self.worker, layout.generation, AckPhase.READY, 1, build_seconds=0.0,
                        migration_seconds=0.0)  # fmt: skip
            await self.send(ready)
            self.acked = layout.generation
            self.poke()
            self.s.note("ack", self.worker, layout.generation, time.time())

    def training(self) -> Layout | None:
        """The plan this worker commits steps of: one it acked, is a member of, and has not
        seen fail; else None."""
        plan = self.plan
        if plan is None or self.acked != plan.generation or self.worker not in plan.members:
            return None
        return plan if self.failed < plan.generation else None

    def next_due(self, plan: Layout, step: int) -> int:
        """The first step from `step` on at which this worker sends something: its first of
        the plan, a step it reports, or a training profile."""
        if self.stepped != plan.generation:
            return step
        n, period = len(plan.members), self.s.step_seconds
        every = profile_every_steps(n, period)
        phase = profile_phase(self.worker, every)
        while not (step_reported(self.worker, step, n, period) or step % every == phase):
            step += 1
        return step

    async def nap(self, seconds: float | None) -> bool:
        """Sleep `seconds` (None: until poked); True when `poke` woke it first."""
        loop = asyncio.get_running_loop()
        woken = self._nap = loop.create_future()
        timer = None if seconds is None else loop.call_later(seconds, _settle, woken, False)
        try:
            return bool(await woken)
        finally:
            if timer is not None:
                timer.cancel()
            self._nap = None

    def poke(self) -> None:
        """The plan, or this worker's part in it, changed: the steps loop looks again."""
        if self._nap is not None:
            _settle(self._nap, True)

    async def steps(self) -> None:
        """A `step` at each period of the shared clock while a member of an acked plan, reported
        as `step_reported` says; a training profile of its layers every `profile_every_steps`.
        The loop wakes only at the steps where it sends something, or when poked."""
        period, step = self.s.step_seconds, 0
        while True:
            plan = self.training()
            if plan is None:
                await self.nap(None)
                continue
            now = time.time()
            # The next period's step, never one already taken: a timer may wake a little early.
            due = self.next_due(plan, max(step + 1, int((now - self.s.epoch) / period) + 1))
            if await self.nap(self.s.epoch + due * period - now):
                continue  # poked: the plan changed meanwhile
            step = due
            plan = self.training()
            if plan is None:
                continue
            first, self.stepped = self.stepped != plan.generation, plan.generation
            if first or step_reported(self.worker, step, len(plan.members), period):
                await self.send(Step(self.worker, plan.generation, step, plan.global_batch,
                                     period, 2.0, vote_seconds=0.01, at=time.time()))  # fmt: skip
            every = profile_every_steps(len(plan.members), period)
            if step % every == profile_phase(self.worker, every):
                data = {
                    "layers": self.s.layer_report(plan.layers.get(self.worker, ())),
                    "source": "training", "generation": plan.generation, "steps": every,
                    "seconds_per_step": period, "micro_batch": self.s.spec.training.micro_batch,
                    "device": "cuda:0",
                }  # fmt: skip
                await self.send(Profile(self.worker, data))

    async def on_liveness(self, raw: bytes) -> None:
        """A liveness document: a member of this worker's plan newly gone fails its generation;
        it names each such member in a fault with that generation, at once where it is one of the
        member's first reporters, else after FAULT_FALLBACK_SECONDS without a newer plan."""
        now = time.time()
        try:
            gone = self.s.gone(raw)
        except (ValueError, TypeError, AuthError) as e:
            self.s.note("error", f"liveness refused: {e}")
            return
        plan = self.plan
        if plan is None or self.worker not in plan.members:
            return
        members, me, seen = plan.members, self.worker, self.reported
        dead = [(p, i) for p, i in gone if p in members and p != me and (p, i) not in seen]
        if not dead:
            return
        self.failed = max(self.failed, plan.generation)
        self.reported.update(dead)
        self.s.note("learned", self.worker, *dead[0], now)
        names = self.s.names(plan, self.worker)
        later = [p for p, _ in dead if p not in names]
        for peer in (p for p, _ in dead if p in names):
            await self.send(Fault(peer, "peer process gone", plan.generation,
                                  reporter=self.worker, at=now))  # fmt: skip
        if later:
            self.s.defer(self, plan.generation, later, now)

    async def name_late(self, generation: int, dead: list[str], at: float) -> None:
        """The fallback: name `dead`, which no newer plan than `generation` answered."""
        for peer in dead:
            await self.send(Fault(peer, "peer process gone", generation,
                                  reporter=self.worker, at=at))  # fmt: skip


def _settle(future: asyncio.Future[bool], poked: bool) -> None:
    if not future.done():
        future.set_result(poked)


async def main(cfg: dict[str, Any]) -> None:
    shared = Shared(cfg)
    flusher = asyncio.create_task(shared.flush_forever())
    sims = [SimWorker(shared, w, h) for w, h in cfg["workers"]]
    tasks = []
    for sim in sims:  # connect in waves: thousands of connects at once overflow the accept queue
        tasks.append(asyncio.create_task(sim.run()))
        if len(tasks) % 64 == 0:
            await asyncio.sleep(0.05)
    while shared.registered < len(sims) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    if shared.registered == len(sims):
        shared.note("up", len(sims))
    # The workers' connections, tasks and first plan last as long as the process: out of the
    # collector's reach, so that a full collection, which a new plan's thousands of objects
    # set off, does not walk them all again (py-spy, 2,048 workers: the 8,192-device plan's
    # expansion took about 1 s of the process before, 0.3 s after).
    gc.freeze()
    finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in finished:  # a worker's loops end only on an error
        shared.note("error", repr(t.exception()))
    await asyncio.sleep(0.2)
    flusher.cancel()


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        config = json.load(f)
    uvloop.run(main(config))
