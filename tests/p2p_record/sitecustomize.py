"""Instrumentation of tests/test_worker_p2p_wire.py: the worker processes of that test have this
folder on their PYTHONPATH, so Python imports this module at start-up. It wraps the real gloo
process group's `send` and `recv` (each call still goes to gloo) and appends one JSON line per
call to $CHAMELEON_P2P_RECORD/<pid>.jsonl: the worker, which of the process's groups (numbered
in the order they first carried a message), the group's size and this process's rank in it, the
op, the peer's rank, the tag, and the tensor's shape and dtype."""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import weakref
from typing import Any

_DIRECTORY = os.environ.get("CHAMELEON_P2P_RECORD")


def _worker() -> str:
    argv = sys.argv
    return argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else "?"


def _install(directory: str) -> None:
    import torch.distributed as dist

    gloo: Any = dist.ProcessGroupGloo
    lock = threading.Lock()
    out = open(os.path.join(directory, f"{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    groups: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
    numbers = itertools.count()

    def wrap(name: str) -> None:
        real = getattr(gloo, name)

        def op(self: Any, tensors: list[Any], peer: int, tag: int = 0) -> Any:
            with lock:
                if self not in groups:
                    groups[self] = next(numbers)
                (t,) = tensors
                line = {
                    "worker": _worker(), "group": groups[self], "size": self.size(),
                    "rank": self.rank(), "op": name, "peer": peer, "tag": tag,
                    "shape": list(t.shape), "dtype": str(t.dtype),
                }  # fmt: skip
                out.write(json.dumps(line) + "\n")
            return real(self, tensors, peer, tag)

        setattr(gloo, name, op)

    wrap("send")
    wrap("recv")


if _DIRECTORY:
    _install(_DIRECTORY)
