"""The point-to-point messages of a training step: which peer, which tag, in which order.

A forward receives its input activation from the executor of the stage before and sends its output
to the one after; a backward receives the output gradient from the stage after and sends the input
gradient to the one before. Each message has a tag naming (kind, pipeline, stage boundary,
micro-batch), so on gloo no receive can take another's message. NCCL and HCCL ignore tags and match
a pair's messages in the order they are issued, so for them each ordered pair of workers must issue
the same sequence on both sides. Every worker runs its ops in the one order that
`workers.generation.op_order` derives from the plan; `pair_order_mismatch` checks that this gives
each pair one sequence. The tests check it over many rerouted and re-partitioned plans, and a
worker on NCCL or HCCL checks the plan it is given, so a plan that broke it would stop with a
reason instead of mixing up tensors of the same shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from chameleond.core.plan import Plan
from chameleond.core.schedule import BACKWARD, FORWARD, Op

_MAX_BOUNDARY = 256
_MAX_PIPELINES = 256
MIGRATION_TAG_BASE = 1 << 30


def p2p_tag(kind: str, pipeline: int, boundary: int, micro_batch: int) -> int:
    """Unique per message of a step; boundary s is the link between stage s and s + 1."""
    if pipeline >= _MAX_PIPELINES or boundary >= _MAX_BOUNDARY:
        raise ValueError("more than 256 pipelines or stages: widen p2p_tag")
    tag = ((micro_batch * _MAX_PIPELINES + pipeline) * _MAX_BOUNDARY + boundary) * 2
    tag += 0 if kind == FORWARD else 1
    if tag >= MIGRATION_TAG_BASE:
        raise ValueError(f"micro-batch {micro_batch} too large for the p2p tag space")
    return tag


Message = tuple[str, int]  # (peer, tag)


def forward_input(op: Op) -> Message | None:
    """The activation a forward receives (None at stage 0: it reads the corpus)."""
    if op.stage == 0:
        return None
    assert op.upstream is not None
    return op.upstream, p2p_tag(FORWARD, op.pipeline, op.stage - 1, op.micro_batch)


def forward_output(op: Op, n_stages: int) -> Message | None:
    """The activation a forward sends downstream (None at the last stage: it computes the loss)."""
    if op.stage == n_stages - 1:
        return None
    assert op.downstream is not None
    return op.downstream, p2p_tag(FORWARD, op.pipeline, op.stage, op.micro_batch)


def backward_input(op: Op, n_stages: int) -> Message | None:
    """The output gradient a backward receives (None at the last stage: from the loss)."""
    if op.stage == n_stages - 1:
        return None
    assert op.downstream is not None
    return op.downstream, p2p_tag(BACKWARD, op.pipeline, op.stage, op.micro_batch)


def backward_output(op: Op) -> Message | None:
    """The input gradient a backward sends upstream (None at stage 0)."""
    if op.stage == 0:
        return None
    assert op.upstream is not None
    return op.upstream, p2p_tag(BACKWARD, op.pipeline, op.stage - 1, op.micro_batch)


def pair_order_mismatch(plan: Plan, ops: Mapping[str, Sequence[Op]]) -> str | None:
    """Where a sender and its receiver would issue one pair's messages in different orders, as a
    reason; None when every ordered pair of workers agrees (what a backend without tags needs)."""
    sent: dict[tuple[str, str], list[int]] = {}
    received: dict[tuple[str, str], list[int]] = {}
    for worker, worker_ops in ops.items():
        for op in worker_ops:
            n = len(plan.pipelines[op.pipeline].stages)
            if op.kind == FORWARD:
                ins, outs = forward_input(op), forward_output(op, n)
            else:
                ins, outs = backward_input(op, n), backward_output(op)
            if ins is not None and ins[0] != worker:
                received.setdefault((ins[0], worker), []).append(ins[1])
            if outs is not None and outs[0] != worker:
                sent.setdefault((worker, outs[0]), []).append(outs[1])
    for pair in sorted(set(sent) | set(received)):
        if sent.get(pair) != received.get(pair):
            return (
                f"{pair[0]} sends to {pair[1]} tags {sent.get(pair, [])} but {pair[1]} receives "
                f"{received.get(pair, [])}"
            )
    return None
