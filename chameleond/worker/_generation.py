"""One plan generation on one worker: its process groups and its op list.

The "world" group spans every worker of the plan (rank = index in `plan.workers`, which is sorted)
and carries point-to-point activations, gradients, migration and the commit vote. Each SyncGroup of
more than one worker gets its own group (rank = index in the group's workers) for its gradient
all-reduce. All groups live on the generation's own store prefix, are built in one global order
(world, then sync groups in (round, index) order, each worker skipping those it is not in: a global
order cannot deadlock), and are dropped together when the generation ends, which closes their
connections so that peers blocked on this worker fail fast instead of waiting for the timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import redis

from chameleond.core.plan import Plan, SyncGroup
from chameleond.core.schedule import BACKWARD, Op, build_schedule, idle_before
from chameleond.protocol import Keys
from chameleond.worker._backend import (
    DeviceChoice,
    abort_group,
    build_communicator,
    new_group,
    retire_groups,
)
from chameleond.worker._p2p import Batch, rendezvous_fault, step_batches
from chameleond.worker._rendezvous import join_generation
from chameleond.worker._store import RedisStore

log = logging.getLogger("chameleon.worker")

# Op costs used only to order ops: plan-independent constants (F = 1, B = 2 per layer, free
# transfers), so every worker derives the same order from the same plan.
FORWARD_UNITS = 1.0
BACKWARD_UNITS = 2.0


def op_order(plan: Plan) -> dict[str, list[Op]]:
    def op_seconds(p: int, s: int, kind: str, _w: str) -> float:
        n = len(plan.pipelines[p].stages[s].layers)
        return n * (BACKWARD_UNITS if kind == BACKWARD else FORWARD_UNITS)

    def comm_seconds(_p: int, _s: int, _k: str, _a: str, _b: str) -> float:
        return 0.0

    return build_schedule(plan.pipelines, plan.routing, op_seconds, comm_seconds).ops


def sync_order(plan: Plan) -> list[tuple[int, SyncGroup]]:
    return sorted(enumerate(plan.sync_groups), key=lambda ig: (ig[1].round, ig[0]))


class GenerationAborted(RuntimeError):
    """The generation's groups were aborted (a peer is gone): what they returned is partial."""


@dataclass
class Generation:
    plan: Plan
    me: str
    device: DeviceChoice
    world: tuple[str, ...]
    ops: list[Op]
    batches: list[Batch]  # this worker's point-to-point batches of a step (chameleond.worker._p2p)
    incarnation: str = ""
    attempt: int = 1  # the how-manieth build of this generation (see WorkerRuntime.follow_plans)
    group_prefix: str = ""  # the generation's store prefix + the members' incarnations
    members: dict[str, str] = field(default_factory=dict)  # worker -> incarnation, once joined
    world_group: Any = None
    sync_groups: dict[int, Any] = field(default_factory=dict)  # index in plan.sync_groups -> group
    aborted: str | None = None  # why the groups were aborted from another thread (see abort)
    # Idle time in the op order's timeline before each op, then after the last (schedule.
    # idle_before): where its checkpoint writes go until bubbles are measured
    # (chameleond.worker._saver).
    idle: list[float] = field(default_factory=list)
    # The links to this worker's pipeline neighbours, measured once the groups are built
    # (chameleond.worker._linkprobe): the `links` of its training profiles.
    links: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.world.index(self.me)

    def rank_of(self, worker: str) -> int:
        return self.world.index(worker)

    def peers(self) -> dict[str, str | None]:
        """The other members, by incarnation once the rendezvous completed, else by id."""
        return {w: self.members.get(w) for w in self.world if w != self.me}

    @classmethod
    def for_plan(
        cls, plan: Plan, me: str, device: DeviceChoice, incarnation: str, attempt: int = 1
    ) -> Generation:
        if me not in plan.workers:
            raise ValueError(f"worker {me} has no part in generation {plan.generation}")
        order = op_order(plan)
        # Every backend matches a pair's messages by order (all carry tag 0); the batches derived
        # from the plan agree pair by pair (tests/test_worker_p2p_order.py). Where a send may
        # wait for its receive (NCCL, HCCL) the worker also checks every worker's batches for a
        # cycle of waits; gloo's sends never wait, so it derives its own only.
        batches = step_batches(plan, order, [me] if device.backend == "gloo" else None)
        mine = order.get(me, [])
        gen = cls(plan, me, device, plan.workers, mine, batches.get(me, []), incarnation, attempt)
        gen.idle = idle_before(
            mine, max((op.end for ops in order.values() for op in ops), default=0)
        )
        gen.check_ownership()
        if device.backend != "gloo":  # a send may wait for its receive
            why = rendezvous_fault(batches)
            if why is not None:
                raise ValueError(
                    f"plan generation {plan.generation} cannot run on {device.backend}, which "
                    f"matches messages by order: {why}"
                )
        return gen

    def check_ownership(self) -> None:
        """Every stage this worker executes must be one whose layers it owns under the plan."""
        owned = set(self.plan.owned_layers(self.me))
        for op in self.ops:
            layers = set(self.plan.pipelines[op.pipeline].stages[op.stage].layers)
            if not layers <= owned:
                raise ValueError(
                    f"plan generation {self.plan.generation} routes pipeline {op.pipeline} stage "
                    f"{op.stage} to {self.me}, which does not own layers {sorted(layers - owned)}"
                )

    def connect(
        self,
        client: redis.Redis,
        *,
        bind_address: str,
        timeout: timedelta,
        abort: Callable[[], None],
        give_up: Callable[[], str | None],
        sync: bool,
    ) -> None:
        """Build the world group (sync=False) or the sync groups (sync=True).

        `give_up` may end the generation before every member has joined
        (chameleond.worker._rendezvous); once all have, only `abort` (a member is gone) cuts the
        store waits short."""
        if not sync:
            base = Keys(self.plan.job).store(self.plan.generation, self.attempt)
            self.group_prefix, self.members = join_generation(
                client, base, self.me, self.incarnation, self.world,
                timeout=timeout, give_up=give_up,
            )  # fmt: skip
            prefix = self.group_prefix
            store = RedisStore(client, prefix + "world/", timeout=timeout, abort=abort)
            self.world_group = new_group(
                store,
                self.rank,
                len(self.world),
                self.device,
                bind_address=bind_address,
                timeout=timeout,
            )
            self.check()  # an abort before the group existed could not reach it
            build_communicator(self.world_group, self.device)
            return
        prefix = self.group_prefix
        for index, group in sync_order(self.plan):
            if self.me not in group.workers or len(group.workers) < 2:
                continue
            store = RedisStore(client, f"{prefix}sync{index}/", timeout=timeout, abort=abort)
            self.sync_groups[index] = new_group(
                store,
                group.workers.index(self.me),
                len(group.workers),
                self.device,
                bind_address=bind_address,
                timeout=timeout,
            )
            self.check()
            build_communicator(self.sync_groups[index], self.device)

    def groups(self) -> list[Any]:
        return [g for g in [self.world_group, *self.sync_groups.values()] if g is not None]

    def abort(self, reason: str) -> None:
        """From another thread: fail every pending and later operation of the generation's
        groups. `aborted` is set first, so the worker can tell a result that an abort cut short
        (NCCL may leave it unfinished, not failed) from a real one: see `check`."""
        self.aborted = reason
        _abort(self.groups())

    def check(self) -> None:
        """Raise if the groups were aborted: what the last collective returned may be partial."""
        if self.aborted is not None:
            raise GenerationAborted(f"generation {self.plan.generation} aborted: {self.aborted}")

    def close(self) -> None:
        groups = self.groups()
        self.world_group = None
        self.sync_groups = {}
        if self.device.backend != "gloo":
            # NCCL's abort takes about a second: the next generation builds meanwhile.
            retire_groups(groups)
            return
        _abort(groups)
        # Dropping the last reference closes the connections (a full gc.collect() would cost
        # ~0.2 s here); the step runner releases its pending sends on its way out, too.
        del groups


def _abort(groups: list[Any]) -> None:
    for g in groups:
        abort_group(g)  # not every backend supports abort; dropping the group still closes it
