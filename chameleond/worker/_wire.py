"""A step's messages on the wire: activations of variable shapes, received in each peer's order.

A forward message is its header (chameleond.worker._activation.encode_header: each tensor's dtype
and shape, in an int64 tensor whose size the boundary's structure fixes) followed by its tensors,
one send each, all in the sender's batch, in that order. A backward message is the gradients of the
activation's floating tensors, one send each: their shapes are those of the forward the receiver
sent, so it needs no header.

A receiver cannot allocate a forward message's tensors before its header is in, and every backend
matches the messages between one pair of workers by the order they are issued (NCCL ignores
tags; chameleond.worker._p2p), so a worker must post each peer's receives in exactly the order that
peer sends them. `Receives` keeps, per peer, the messages whose receives are not all posted yet, in
the peer's order:

* with its batch, a receive is posted as far as that order allows: a forward message's header (or
  a backward message's gradients) when no earlier message from the same peer still waits for its
  data receives; otherwise nothing yet, so that no receive ever overtakes an earlier message's
  data;
* `take` (an op needs a message) posts, in order, everything of the peer's earlier messages and of
  this one: waiting each earlier header, then posting its data receives;
* `poll` (before each op) posts, without waiting, the data receives of messages whose headers have
  already arrived, so transfers still overlap compute.

Why this cannot deadlock where the header-less exchange (every receive posted with its batch) does
not: a header is posted with its batch exactly as the whole message was, so the batches of
chameleond.worker._p2p still pair up and complete in time order. The data receives are posted later,
never later than the op that uses the message; there the worker waits only for the headers of the
peer's messages up to that one, which the peer sent in batches no later than the message needed
(its batches go in time order), and a header is complete once both sides' batches are issued: the
wait is the one that op made before. A sender's data sends wait at most until the receiver's next
op boundary, and the sender itself waits for its sends only at the end of the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from chameleond.worker._activation import Structure, decode_header, header_size
from chameleond.worker._backend import P2POp, communicating, exchange
from chameleond.worker._p2p import MessageId
from chameleond.worker.api import ModelError

Spec = tuple[torch.dtype, tuple[int, ...]]  # a tensor to receive: (dtype, shape)


@dataclass
class _Incoming:
    peer: int  # the sender's rank
    structure: Structure | None  # forward: the boundary's; None: a backward message
    specs: list[Spec]  # the tensors to receive (a forward's: known once its header is in)
    state: str = "waiting"  # nothing posted | "header" posted | every receive "posted"
    header: torch.Tensor | None = None
    header_work: Any = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)


class Receives:
    """The receives one worker has posted (or is to post) in one step, per peer in its order."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device
        self._in: dict[MessageId, _Incoming] = {}
        self._queue: dict[int, deque[MessageId]] = {}  # per peer: messages not all posted

    def __len__(self) -> int:
        return len(self._in)

    def clear(self) -> None:
        self._in.clear()
        self._queue.clear()

    def add(
        self, message: MessageId, peer: int, structure: Structure | None, specs: list[Spec]
    ) -> list[P2POp]:
        """Expect `message` from rank `peer` (a forward of `structure`, or a backward message:
        structure None and its gradients' `specs`): the receives to post with the current batch,
        in order, none when an earlier message from `peer` still waits for its data receives.
        `issued` takes their works."""
        self._in[message] = incoming = _Incoming(peer, structure, list(specs))
        queue = self._queue.setdefault(peer, deque())
        queue.append(message)
        return self._first(incoming) if len(queue) == 1 else []

    def issued(self, message: MessageId, works: list[Any]) -> None:
        """The works of the receives `add` (or the order) posted for `message`, in order."""
        incoming = self._in[message]
        if incoming.state == "header":
            incoming.header_work = works[0]
        elif incoming.state == "posted":
            incoming.works = works
            assert self._queue[incoming.peer][0] == message
            self._queue[incoming.peer].popleft()

    def poll(self) -> None:
        """Post, without waiting, what each peer's order allows now."""
        for peer in self._queue:
            self._advance(peer, None, block=False)

    def take(self, message: MessageId) -> tuple[Structure | None, list[torch.Tensor]]:
        """`message`'s tensors, received: (its structure, or None for gradients; its tensors)."""
        incoming = self._in.get(message)
        if incoming is None:
            raise RuntimeError(f"receive of {message} is in no batch before it")
        self._advance(incoming.peer, message, block=True)
        del self._in[message]
        with communicating():
            for work in incoming.works:
                work.wait()
        return incoming.structure, incoming.buffers

    # posting, in the peer's order ---------------------------------------------------------------

    def _first(self, incoming: _Incoming) -> list[P2POp]:
        """The first receives of a message: a forward's header, a backward's gradients."""
        if incoming.structure is not None:
            size = header_size(incoming.structure)
            incoming.header = torch.empty(size, dtype=torch.int64, device=self.device)
            incoming.state = "header"
            return [(False, incoming.header, incoming.peer)]
        return self._data(incoming)

    def _data(self, incoming: _Incoming) -> list[P2POp]:
        incoming.buffers = [torch.empty(s, dtype=d, device=self.device) for d, s in incoming.specs]
        incoming.state = "posted"
        return [(False, b, incoming.peer) for b in incoming.buffers]

    def _advance(self, peer: int, until: MessageId | None, block: bool) -> None:
        """Post `peer`'s receives in its order: up to `until`, or (None) as far as the headers
        already in allow, waiting for headers only when `block`."""
        queue = self._queue[peer]
        if until is not None and until not in queue:
            return  # posted already
        while queue:
            message = queue[0]
            incoming = self._in[message]
            if incoming.state == "waiting":
                self.issued(message, exchange(self.group, self._first(incoming)))
            if incoming.state == "header":
                if not block and not incoming.header_work.is_completed():
                    return
                with communicating():
                    incoming.header_work.wait()
                assert incoming.header is not None and incoming.structure is not None
                incoming.specs = self._specs(message, incoming.structure, incoming.header)
                self.issued(message, exchange(self.group, self._data(incoming)))
            if message == until:
                return

    def _specs(self, message: MessageId, structure: Structure, header: torch.Tensor) -> list[Spec]:
        specs = decode_header(header.cpu())
        dtypes = tuple(d for d, _ in specs)
        if dtypes != structure.dtypes:
            raise ModelError(
                f"message {message} holds dtypes {[str(d) for d in dtypes]}, but its boundary "
                f"carries {structure}: a layer's output dtypes must not change in training"
            )
        return specs
