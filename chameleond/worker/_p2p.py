"""The point-to-point messages of a training step: which peer, which message, and in which batches.

A forward receives its input activation from the executor of the stage before and sends its output
to the one after; a backward receives the output gradient from the stage after and sends the input
gradient to the one before. Each message is named by a `MessageId` (kind, pipeline, stage boundary,
micro-batch), which the worker uses to pair an output with its batch and a receive with its op. The
name never goes on the wire: every point-to-point op carries tag 0
(`chameleond.worker._backend.P2P_TAG`), because NCCL and HCCL ignore tags and match a pair's
messages in the order they are issued. So every pair of workers must issue them in one order:
between any two workers, the sends of one side, in issue order, are the receives of the other side,
in issue order, message for message. Both sides derive that order from the plan alone.

A send larger than NCCL's and HCCL's buffers waits on the device's communication stream until the
peer's receive runs. Issued one by one in op order, plain 1F1B can then wait in a cycle: stage 0
sends F1 before it receives B0, stage 1 sends B0 before it receives F1. So a step's messages are
issued in *batches* (`step_batches`), each a group that the backend progresses as a whole:

* The worker's op order comes with a timeline (`chameleond.core.schedule`: each op's start and end
  when every worker runs its ops in that order). A message happens at the end of the op that
  produces it; the batch of a worker at time t holds every message it sends or receives at t, in
  message order, and is issued once the ops that started before t have run.
* Both ends of a message are in their batch of the same time (the sender's op end, read from the
  one timeline), and a worker's batches follow its timeline, so a pair's messages are issued in
  (time, message) order on both sides, and batches complete in time order: no cycle, whatever
  the buffers. Receives are posted early, when their message is produced, and waited for just
  before the op that uses it.

A message is several point-to-point ops (a forward's header and tensors, a backward's gradients:
chameleond.worker._wire), all in the sender's batch; the receiver posts a forward's header with its
batch and its tensors once the header is in, in the peer's order (_wire says why that keeps these
guarantees). The batches here list messages, one endpoint each.

`rendezvous_fault` checks a set of batches under the strictest rules (messages matched per pair in
issue order, every send waiting for its receive); a worker on NCCL or HCCL checks every plan it is
given and refuses, with the reason, one that fails. The tests check it over many rerouted and
re-partitioned plans, and that the op-by-op order fails it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from chameleond.core.plan import Plan
from chameleond.core.schedule import BACKWARD, FORWARD, Op


@dataclass(frozen=True, order=True)
class MessageId:
    """One message of a step: boundary s is the link between stage s and s + 1. Ordered by
    (micro-batch, pipeline, boundary, kind): the order within a batch."""

    micro_batch: int
    pipeline: int
    boundary: int
    kind: str  # FORWARD (an activation) | BACKWARD (a gradient)

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@p{self.pipeline}:{self.boundary}"


Message = tuple[str, MessageId]  # (peer, message)


def forward_input(op: Op) -> Message | None:
    """The activation a forward receives (None at stage 0: it reads the corpus)."""
    if op.stage == 0:
        return None
    assert op.upstream is not None
    return op.upstream, MessageId(op.micro_batch, op.pipeline, op.stage - 1, FORWARD)


def forward_output(op: Op, n_stages: int) -> Message | None:
    """The activation a forward sends downstream (None at the last stage: it computes the loss)."""
    if op.stage == n_stages - 1:
        return None
    assert op.downstream is not None
    return op.downstream, MessageId(op.micro_batch, op.pipeline, op.stage, FORWARD)


def backward_input(op: Op, n_stages: int) -> Message | None:
    """The output gradient a backward receives (None at the last stage: from the loss)."""
    if op.stage == n_stages - 1:
        return None
    assert op.downstream is not None
    return op.downstream, MessageId(op.micro_batch, op.pipeline, op.stage, BACKWARD)


def backward_output(op: Op) -> Message | None:
    """The input gradient a backward sends upstream (None at stage 0)."""
    if op.stage == 0:
        return None
    assert op.upstream is not None
    return op.upstream, MessageId(op.micro_batch, op.pipeline, op.stage - 1, BACKWARD)


def op_messages(plan: Plan, op: Op) -> tuple[Message | None, Message | None]:
    """(what the op receives, what it sends); None where it reads the corpus or the loss."""
    n = len(plan.pipelines[op.pipeline].stages)
    if op.kind == FORWARD:
        return forward_input(op), forward_output(op, n)
    return backward_input(op, n), backward_output(op)


@dataclass(frozen=True)
class Endpoint:
    """One worker's end of a message: its send or its receive."""

    send: bool
    peer: str
    message: MessageId


@dataclass(frozen=True)
class Batch:
    """Endpoints issued together, once the worker's first `before` ops of the step have run."""

    before: int
    endpoints: tuple[Endpoint, ...]


def step_batches(
    plan: Plan, order: Mapping[str, Sequence[Op]], workers: Iterable[str] | None = None
) -> dict[str, list[Batch]]:
    """The batches of one step (see the module docstring) of `workers` (default: all), from the
    op order and its timeline. Messages a worker sends itself are not endpoints. Raises
    ValueError for a receive that the op before it in the pipeline does not send."""
    ended = {  # (kind, pipeline, stage, micro-batch) -> (executor, end)
        (op.kind, op.pipeline, op.stage, op.micro_batch): (w, op.end)
        for w, ops in order.items()
        for op in ops
    }
    batches: dict[str, list[Batch]] = {}
    for worker in order if workers is None else workers:
        ops = order.get(worker, [])
        rounds: dict[float, list[Endpoint]] = {}  # when -> what happens then
        for op in ops:
            ins, out = op_messages(plan, op)
            if out is not None and out[0] != worker:
                rounds.setdefault(op.end, []).append(Endpoint(True, out[0], out[1]))
            if ins is not None and ins[0] != worker:
                source = op.stage - 1 if op.kind == FORWARD else op.stage + 1
                sender, when = ended.get((op.kind, op.pipeline, source, op.micro_batch), ("", 0.0))
                if sender != ins[0]:
                    raise ValueError(f"{worker} receives {ins[1]} that {ins[0]} does not send")
                rounds.setdefault(when, []).append(Endpoint(False, ins[0], ins[1]))
        starts = [op.start for op in ops]
        batches[worker] = [
            Batch(
                bisect.bisect_left(starts, t),
                tuple(sorted(ends, key=_message) if ends[1:] else ends),
            )
            for t, ends in sorted(rounds.items())
        ]
    return batches


def _message(end: Endpoint) -> MessageId:
    return end.message


def rendezvous_fault(batches: Mapping[str, Sequence[Batch]]) -> str | None:
    """Why these batches could fail on a backend that matches by order, as a reason; None if they
    cannot.

    The strictest rules: each worker issues its batches in order, one at a time; a pair's
    messages match in the order issued (the k-th send from a to b with the k-th receive at b from
    a, which must be the same message); a message completes only while both ends' batches are
    issued (a send waits for its receive); a batch is done when all its endpoints are.
    """
    # (sender, receiver) -> that side's endpoints in issue order: (batch, index, message)
    sides: dict[bool, dict[tuple[str, str], list[tuple[int, int, MessageId]]]] = {
        True: {},
        False: {},
    }
    for worker, seq in batches.items():
        for b, batch in enumerate(seq):
            for i, end in enumerate(batch.endpoints):
                pair = (worker, end.peer) if end.send else (end.peer, worker)
                sides[end.send].setdefault(pair, []).append((b, i, end.message))
    partner: dict[tuple[str, int, int], tuple[str, int, int]] = {}  # an endpoint -> its other end
    for sender, receiver in sorted(set(sides[True]) | set(sides[False])):
        sent = sides[True].get((sender, receiver), [])
        received = sides[False].get((sender, receiver), [])
        sent_ids, received_ids = [m for *_, m in sent], [m for *_, m in received]
        if sent_ids != received_ids:
            return (
                f"{sender} sends to {receiver} {_names(sent_ids)} but {receiver} receives "
                f"{_names(received_ids)}"
            )
        for (sb, si, _), (rb, ri, _) in zip(sent, received, strict=True):
            partner[(sender, sb, si)] = (receiver, rb, ri)
            partner[(receiver, rb, ri)] = (sender, sb, si)
    current = dict.fromkeys(batches, 0)
    done: set[tuple[str, int, int]] = set()
    progressed = True
    while progressed:
        progressed = False
        for worker, seq in batches.items():
            while (b := current[worker]) < len(seq):
                for i in range(len(seq[b].endpoints)):
                    other = partner[(worker, b, i)]
                    if current[other[0]] == other[1]:  # both ends issued: it completes
                        done.update({(worker, b, i), other})
                if any((worker, b, i) not in done for i in range(len(seq[b].endpoints))):
                    break
                current[worker] = b + 1
                progressed = True
    waits = []
    for worker, seq in sorted(batches.items()):
        b = current[worker]
        if b < len(seq):
            i = next(i for i in range(len(seq[b].endpoints)) if (worker, b, i) not in done)
            end = seq[b].endpoints[i]
            what = f"send {end.message} to" if end.send else f"receive {end.message} from"
            waits.append(f"{worker} waits to {what} {end.peer} (batch before op {seq[b].before})")
    return "a cycle of waits: " + "; ".join(waits) if waits else None


def _names(messages: Sequence[MessageId]) -> str:
    return "[" + ", ".join(map(str, messages)) + "]"
