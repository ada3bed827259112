"""Test hooks of `chameleon-worker` (`CHAMELEON_WORKER_KILL_AT=KIND:N`): faults that cannot be
produced on demand otherwise, injected at exact points of a step, a commit vote or a migration.
docs/worker.md lists them; any other value is refused at start (usage error).

`WorkerHooks` carries them into the runtime, with the bench's step gate; `train` runs without
any, and only the command line (chameleond.worker._main) reads them from the environment."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from chameleond.worker._backend import CollectiveFailed

log = logging.getLogger("chameleon.worker")

FAULT_HOOKS = ("step", "migration", "vote", "vote-lost", "device", "hang")


@dataclass(frozen=True)
class WorkerHooks:
    """What is injected into a worker's training beside the training itself: never set by a
    user's program."""

    kill_at: str = ""  # a fault hook, KIND:N (fault_hook_error says which are valid)
    before_step: Callable[[int], None] | None = None  # called before each step (the bench's gate)


def fault_hook_error(text: str) -> str | None:
    """Why a CHAMELEON_WORKER_KILL_AT value is unusable (None when empty or valid): KIND:N with
    KIND one of FAULT_HOOKS and N an integer >= 0 (a step, or a generation for migration)."""
    if not text:
        return None
    kind, _, arg = text.partition(":")
    if kind not in FAULT_HOOKS or not arg.isdigit():
        return f"CHAMELEON_WORKER_KILL_AT={text!r}: expected KIND:N, KIND one of {FAULT_HOOKS}"
    return None


def step_hook(kill_at: str) -> Callable[[int, int, int], None] | None:
    """`step:N`: SIGKILL in the middle of step N. `device:N`: from the middle of step N,
    the next layer forward raises, as a failing device's kernel does. `hang:N`: in the middle of
    step N the training thread stops for good, as on a kernel that never returns; the process,
    its connections and its heartbeats live on."""
    what, _, arg = kill_at.partition(":")
    if what not in ("step", "device", "hang"):
        return None
    target = int(arg)

    hooks: list[RemovableHandle] = []

    def fail_next_forward(_module: object, _inputs: object) -> None:
        for h in hooks:
            h.remove()
        raise RuntimeError(f"injected device error (fault hook device:{target})")

    def on_op(step: int, i: int, n: int) -> None:
        if step != target or i != n // 2:
            return
        if what == "step":
            log.warning("kill hook: SIGKILL in the middle of step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)
        if what == "hang":
            log.warning("fault hook: the training thread hangs in the middle of step %d", step)
            threading.Event().wait()
        log.warning("fault hook: the next layer forward of step %d fails", step)
        hooks.append(register_module_forward_pre_hook(fail_next_forward))

    return on_op


def vote_hook(kill_at: str) -> Callable[[int], None] | None:
    """`vote:N`: SIGKILL right after this worker's commit vote of step N completed (everyone
    has its contribution). `vote-lost:N`: the vote completed, but this worker takes it as
    failed, as one does whose ring broke when a peer died inside the all-reduce."""
    what, _, arg = kill_at.partition(":")
    if what not in ("vote", "vote-lost"):
        return None
    target = int(arg)

    def after_vote(step: int) -> None:
        if step != target:
            return
        if what == "vote":
            log.warning("kill hook: SIGKILL right after the commit vote of step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)
        raise CollectiveFailed(f"fault hook: the commit vote of step {step} lost on this worker")

    return after_vote


def migration_hook(kill_at: str, generation: int) -> Callable[[int], None] | None:
    what, _, arg = kill_at.partition(":")
    if what != "migration" or int(arg) != generation:
        return None

    def on_round(_rnd: int) -> None:
        log.warning("kill hook: SIGKILL in the middle of generation %d's migration", generation)
        os.kill(os.getpid(), signal.SIGKILL)

    return on_round
