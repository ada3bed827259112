"""Who failed a generation: the worker's own device, or which of its peers.

A generation fails on an error from a collective, a group's set-up, the store or Redis (FAULTS).
The worker first rules out its own device (a CUDA error surfaces at the next synchronisation,
often inside a collective, where it looks like a peer's), then names in a fault only the peers
the daemon announced gone (their Redis connections closed: chameleond.worker._liveness), and of
those only the ones it is among the first reporters of (chameleond.protocol.fault_reporters: a
few live members spread round the plan's order); the rest it names only when no newer
plan has come FAULT_FALLBACK_SECONDS later (`overdue`). With nobody gone the generation is built
again; a live peer absent from ABSENT_ATTEMPTS rendezvous attempts in a row is named as hung
(chameleond.worker._absence).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from chameleond.core.plan import Plan
from chameleond.protocol import FAULT_FALLBACK_SECONDS, fault_reporters
from chameleond.worker._absence import ABSENT_ATTEMPTS, Absences
from chameleond.worker._backend import CollectiveFailed, DeviceChoice, check_device_health
from chameleond.worker._generation import Generation, GenerationAborted
from chameleond.worker._link import Reporter
from chameleond.worker._liveness import NOTICE_WAIT_SECONDS, PeerNotices
from chameleond.worker._outbox import RedisUnreachable
from chameleond.worker._rendezvous import GenerationAbandoned
from chameleond.worker._state import WorkerState
from chameleond.worker._store import StoreAborted
from chameleond.worker.api import DeviceFailed

log = logging.getLogger("chameleon.worker")
# The errors that mean a peer, a process group or Redis failed during a generation: the worker
# names the dead peers, or builds the generation again. Anything else is a bug (the worker's or
# the user's training) and ends the worker with its traceback instead of being retried forever.
FAULTS: tuple[type[BaseException], ...] = (
    CollectiveFailed,  # a collective, a point-to-point op or a group's set-up (backend.py)
    torch.distributed.DistError,  # torch's own: backend, network and store errors
    GenerationAborted,  # the groups were aborted: a peer is gone
    StoreAborted,
    RedisUnreachable,  # longer than a rendezvous may wait
)
# Those, and the ones the plan follower answers apart, that end a generation (their time is noted).
FAILS_GENERATION: tuple[type[BaseException], ...] = (*FAULTS, GenerationAbandoned, DeviceFailed)


class Deferred(NamedTuple):
    """Dead peers left to their first reporters: named by this worker too if no plan newer than
    `generation` has come by `due` (time.monotonic())."""

    generation: int
    dead: tuple[str, ...]
    cause: str
    detected: float
    due: float


class Attribution:
    """The evidence of one worker against its peers, and the faults it reports from it."""

    def __init__(
        self, notices: PeerNotices, me: str, device: DeviceChoice, reporter: Reporter
    ) -> None:
        self.notices = notices  # the daemon's announcements of processes gone
        self.me = me
        self.device = device
        self.reporter = reporter
        self.absences = Absences()  # peers missing from the rendezvous
        self._failed_at = 0.0
        self._peers: dict[str, str | None] = {}  # the failed generation's members (incarnations)
        self._deferred: Deferred | None = None

    def started(self) -> None:
        """A generation starts: an earlier generation's peers are no evidence in this one."""
        self._peers = {}

    def failed(self, gen: Generation) -> None:
        """`gen` failed: note when (before its groups are torn down) and who was in it."""
        self._failed_at = time.time()
        self._peers = gen.peers()

    def gone(self, gen: Generation) -> list[str]:
        """Members announced gone (no Redis command: the notices the worker holds)."""
        return self.notices.gone(gen.peers())

    def own_failure(self, plan: Plan, error: DeviceFailed) -> None:
        """This worker's computation failed: nobody else is to blame. Its peers see only a
        broken group; this report names the worker and the real cause, and the worker leaves
        (its state is suspect), so the peers also find it gone."""
        detected = self._failed_at or time.time()
        log.error("generation %d: this worker's computation failed: %s", plan.generation, error)
        self.reporter.fault(self.me, str(error), generation=plan.generation, at=detected)

    def fault(self, plan: Plan, state: WorkerState, error: BaseException) -> bool:
        """Discard the step and name the generation's dead peers in faults; False when none
        is found (the generation is then built again). First make sure the error was not this
        worker's own device's, surfacing outside its computation."""
        try:
            check_device_health(self.device.torch_device)
        except DeviceFailed as own:
            self.own_failure(plan, own)
            raise
        detected = self._failed_at or time.time()
        self._failed_at = 0.0
        if state.pending_step is None:
            state.discard_step()
        peers = self._peers or {w: None for w in plan.workers if w != self.me}
        t_close = time.time()
        dead = self.notices.wait_gone(peers, NOTICE_WAIT_SECONDS)
        log.info(
            "groups closed %.3fs after the error; dead peers announced in %.3fs",
            t_close - detected,
            time.time() - t_close,
        )
        cause = f"{type(error).__name__}: {error}"
        log.warning("generation %d failed (%s); dead peers: %s", plan.generation, cause, dead)
        first = fault_reporters(plan.workers, dead)
        later = tuple(w for w in dead if self.me not in first.get(w, ()))
        for w in dead:
            if w not in later:
                self.reporter.fault(w, cause, generation=plan.generation, at=detected)
        if later:
            due = time.monotonic() + FAULT_FALLBACK_SECONDS
            self._deferred = Deferred(plan.generation, later, cause, detected, due)
            log.info("left to their first reporters: %s", ", ".join(later))
        if not dead:
            log.warning("no dead peer found: building generation %d again", plan.generation)
        return bool(dead)

    def overdue(self, newest: int) -> None:
        """While the worker waits for a plan after a fault: once no plan newer than the failed
        generation (`newest`: the newest this worker has seen) has come FAULT_FALLBACK_SECONDS
        after it, name the dead peers left to their first reporters (those may have died or hung
        too, or held other notices); a newer plan answered them."""
        deferred = self._deferred
        if deferred is None:
            return
        if newest > deferred.generation:
            self._deferred = None
        elif time.monotonic() >= deferred.due:
            self._deferred = None
            log.warning("no plan after generation %d in %.0f s: naming %s too",
                        deferred.generation, FAULT_FALLBACK_SECONDS,
                        ", ".join(deferred.dead))  # fmt: skip
            for w in deferred.dead:
                self.reporter.fault(w, deferred.cause, generation=deferred.generation,
                                    at=deferred.detected)  # fmt: skip

    def name_absent(self, plan: Plan, absent: tuple[str, ...]) -> None:
        """Report the peers absent from ABSENT_ATTEMPTS attempts in a row of this generation."""
        peers = [w for w in plan.workers if w != self.me]
        for w in self.absences.abandoned(plan.generation, peers, absent):
            cause = (
                f"absent from {ABSENT_ATTEMPTS} rendezvous attempts of generation "
                f"{plan.generation} in a row: alive but not building it (hung?)"
            )
            log.warning("naming %s: %s", w, cause)
            self.reporter.fault(w, cause, generation=plan.generation, at=time.time())
