"""The start of a generation: agree on the committed step, then move layer state per the plan.

1. Reconcile. Every worker contributes one row (its last committed step, its pending update's step,
   the version of every layer it holds and which of them the pending update covers) to a SUM
   all-reduce over the world group, i.e. an all-gather. The job's committed step is the MAX of the
   committed steps. A commit vote may have completed on some workers only; every worker that voted
   had finished the gradient sync, so whoever holds a pending update for exactly that step applies
   it now (divided by the global batch of the plan it was summed under, which the new plan may
   have changed; unscaled, clipped or skipped as the step's `Commit` says, which the workers whose
   vote completed hand over in their rows), and a pending update for a later step (whose vote
   completed nowhere) is discarded.
2. Migrate. A worker needs every layer the plan gives it whose copy is not at the committed step.
   Each missing layer comes from the plan's Transfer when its source really holds a current copy,
   and otherwise from the lowest-ranked worker that does (a fault in the middle of an earlier
   migration leaves the plan's idea of who holds what behind the truth). Transfers run in the plan's
   rounds, repairs in one extra round. A layer's state is a byte buffer whose length only its
   sender knows (the user's optimizer decides what it holds), so each round first exchanges the
   lengths, then the buffers. Before any step has committed, missing layers are built from
   their initial weights instead. Sources keep their layers; the runtime drops unowned layers
   after the generation's first commit.

Every worker derives the same moves from the same gathered rows, and issues a round's transfers in
one order (`round_order`: by layer, source, destination): between any two workers, the sends of
one side are the receives of the other, in the same order, as backends that match messages by
order (NCCL, HCCL; every op carries tag 0) need.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from chameleond.core.plan import Plan
from chameleond.worker._backend import P2POp, allreduce_sum, communicating, exchange
from chameleond.worker._commit import Commit
from chameleond.worker._generation import Generation
from chameleond.worker._layer import LayerState
from chameleond.worker._state import WorkerState

log = logging.getLogger("chameleon.worker")

_ABSENT = -2.0


class StateLost(RuntimeError):
    """No worker holds a current copy of a layer: backup-free recovery is impossible."""


@dataclass(frozen=True)
class Move:
    src: str | None  # None: build from the seed (nothing committed yet)
    dst: str
    layer: int
    round: int


@dataclass(frozen=True)
class Reconciled:
    committed_step: int
    applied_pending: int | None  # the step this worker applied late, if it did
    moves: tuple[Move, ...]


def _rows(gen: Generation, state: WorkerState) -> torch.Tensor:
    n = state.model.n_layers
    rows = torch.zeros((len(gen.world), 2, n + 2), dtype=torch.float64)
    mine = rows[gen.rank]
    mine[0, 0] = state.committed_step
    mine[0, 1] = -1 if state.pending_step is None else state.pending_step
    mine[0, 2:] = _ABSENT
    for i, layer in state.layers.items():
        mine[0, 2 + i] = layer.version
    for i in state.pending_layers:
        mine[1, 2 + i] = 1.0
    # The outcome of the vote of this worker's last committed step, for a peer whose vote did not
    # complete: [sum of squares, overflow] (overflow -1: not known here).
    last = state.last_commit
    if last is not None and last.step == state.committed_step:
        mine[1, 0] = 0.0 if last.overflow else last.grad_sq
        mine[1, 1] = 1.0 if last.overflow else 0.0
    else:
        mine[1, 1] = -1.0
    return rows


def handed_commit(rows: torch.Tensor, step: int) -> Commit | None:
    """Pure: step `step`'s Commit from the rows of the workers that committed it (None: none of
    them knows its outcome, e.g. all loaded it from a checkpoint)."""
    for r in range(rows.shape[0]):
        if int(rows[r, 0, 0].item()) == step and rows[r, 1, 1] >= 0:
            overflow = bool(rows[r, 1, 1] > 0)
            grad_sq = math.inf if overflow else float(rows[r, 1, 0].item())
            return Commit(step, math.nan, grad_sq, 0, overflow)
    return None


def plan_moves(
    plan: Plan, rows: torch.Tensor, world: tuple[str, ...], *, job_trained: bool = False
) -> Reconciled:
    """Pure: from the gathered rows, the committed step and the moves every worker agrees on.

    `job_trained`: some step of the job has committed before (chameleond.worker._runtime keeps the
    mark in Redis). Then a world in which nobody holds any committed state has lost it, and starting
    again from the seed would silently throw the training away: that is StateLost, not a fresh
    start."""
    committed = int(rows[:, 0, 0].max().item())
    n = rows.shape[2] - 2
    current: dict[str, set[int]] = {}
    for r, w in enumerate(world):
        pending = int(rows[r, 0, 1].item())
        held = set()
        for i in range(n):
            version = int(rows[r, 0, 2 + i].item())
            if pending == committed and rows[r, 1, 2 + i] > 0:
                version = committed
            if version == committed and rows[r, 0, 2 + i] != _ABSENT:
                held.add(i)
        current[w] = held
    planned = {(t.dst, layer): t for t in plan.migration for layer in t.layers}
    repair_round = 1 + max((t.round for t in plan.migration), default=-1)
    moves: list[Move] = []
    for w in world:
        for layer in plan.owned_layers(w):
            if layer in current[w]:
                continue
            if committed < 0 and not job_trained:
                moves.append(Move(None, w, layer, 0))
                continue
            t = planned.get((w, layer))
            if t is not None and t.src in current and layer in current[t.src]:
                moves.append(Move(t.src, w, layer, t.round))
                continue
            holders = [h for h in world if layer in current[h]] if committed >= 0 else []
            if not holders and committed < 0:
                raise StateLost(
                    f"the job has trained, but none of {', '.join(world)} holds committed state"
                )
            if not holders:
                raise StateLost(
                    f"layer {layer} has no copy at step {committed} among {', '.join(world)}"
                )
            moves.append(Move(holders[0], w, layer, repair_round))
    return Reconciled(committed, None, tuple(moves))


def reconcile(
    gen: Generation,
    state: WorkerState,
    *,
    job_trained: bool = False,
    on_round: Callable[[int], None] | None = None,
) -> Reconciled:
    """Run steps 1 and 2 of the module docstring over the world group."""
    rows = allreduce_sum(gen.world_group, _rows(gen, state), state.device)
    gen.check()
    plan = gen.plan
    result = plan_moves(plan, rows, gen.world, job_trained=job_trained)
    applied: int | None = None
    if state.pending_step is not None:
        commit = None
        if state.pending_step == result.committed_step:
            commit = handed_commit(rows, result.committed_step)
            if commit is None:
                log.warning(
                    "step %d committed elsewhere, but no worker knows its vote's outcome: "
                    "its layers are fetched instead", state.pending_step,
                )  # fmt: skip
        if commit is not None:
            # With the batch the step's gradients were summed over, not this plan's: a plan that
            # changed B would scale the late update wrongly.
            applied = state.apply_pending(commit=commit)
            log.info("applied step %d late: its commit vote reached other workers", applied)
        else:
            state.discard_step()
    state.global_batch = plan.global_batch  # the batch of this generation's steps
    # Layers at an older step are stale: they can be neither trained nor sent.
    for i in [i for i, lay in state.layers.items() if lay.version != result.committed_step]:
        if result.committed_step >= 0:
            del state.layers[i]
    state.committed_step = max(state.committed_step, result.committed_step)
    _execute(gen, state, result.moves, result.committed_step, on_round)
    return Reconciled(result.committed_step, applied, result.moves)


def round_order(moves: Iterable[Move]) -> list[list[Move]]:
    """The moves of each round, rounds in ascending order, each round in the order every worker
    lists it: by (layer, source, destination)."""
    rounds: dict[int, list[Move]] = {}
    for m in moves:
        rounds.setdefault(m.round, []).append(m)
    return [sorted(rounds[r], key=lambda m: (m.layer, m.src or "", m.dst)) for r in sorted(rounds)]


def round_transfers(moves: Sequence[Move], me: str) -> list[tuple[bool, str, int]]:
    """`me`'s point-to-point transfers of one round (from `round_order`), in issue order:
    (send?, peer, layer). A pair's sends on one side are its receives on the other, in order."""
    out: list[tuple[bool, str, int]] = []
    for m in moves:
        if m.src is None or me not in (m.src, m.dst):
            continue
        out.append((m.src == me, m.dst if m.src == me else m.src, m.layer))
    return out


def _execute(
    gen: Generation,
    state: WorkerState,
    moves: tuple[Move, ...],
    committed: int,
    on_round: Callable[[int], None] | None,
) -> None:
    me = gen.me
    for moves_of_round in round_order(moves):
        sends: list[tuple[int, torch.Tensor]] = []  # (peer rank, state buffer)
        receives: list[tuple[int, LayerState]] = []  # (peer rank, skeleton)
        for m in moves_of_round:
            if m.dst == me and m.src is None:
                state.build_from_seed(m.layer)
        for send, peer, index in round_transfers(moves_of_round, me):
            if send:
                sends.append(
                    (gen.rank_of(peer), state.layer(index).state_buffer().to(state.device))
                )
            else:
                receives.append((gen.rank_of(peer), LayerState(state.model, index, state.device)))
        # One batch per round, twice: the lengths, then the buffers. The plan's rounds give a
        # worker one transfer each, but the repair round may give it several, both ways; every
        # worker lists a round's transfers in one order (round_transfers), so each pair matches
        # by order alone.
        lengths = [torch.empty(1, dtype=torch.int64, device=state.device) for _ in receives]
        ops: list[P2POp] = [
            (True, torch.tensor([b.numel()], dtype=torch.int64, device=state.device), r)
            for r, b in sends
        ] + [(False, n, r) for (r, _), n in zip(receives, lengths, strict=True)]
        with communicating():
            for work in exchange(gen.world_group, ops):
                work.wait()
        if receives:
            gen.check()
        bufs = [torch.empty(int(n.item()), dtype=torch.uint8, device=state.device) for n in lengths]
        ops = [(True, b, r) for r, b in sends] + [
            (False, b, r) for (r, _), b in zip(receives, bufs, strict=True)
        ]
        works = exchange(gen.world_group, ops)
        if on_round is not None:
            on_round(moves_of_round[0].round)
        with communicating():
            for work in works:
                work.wait()
        if receives:
            gen.check()  # an aborted round may leave its buffers unfinished
        for (_, layer), buf in zip(receives, bufs, strict=True):
            layer.load_buffer(buf, committed)
            state.layers[layer.index] = layer
