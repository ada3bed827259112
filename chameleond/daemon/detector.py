"""Failure detection: heartbeat lapse, plans not acknowledged in time, and fencing.

Only on evidence: a worker that stopped cleanly (`ack phase=stopped` as a member of the plan:
finished, or left) is never suspected; a failed worker is `fenced` only when it was heard from
after it was declared failed (otherwise it is dead, and logged so).

What the detector suspects it writes to the event stream as an ordinary `fault` (with
`source=detector`), so a suspicion takes the same durable path as a reported fault and an operator
sees it in the stream. A worker declared failed that still heartbeats is fenced: it is in the
plan's `excluded` list, and the current generation is published again now and then so it learns.
Silence while Redis is unreachable, and for one timeout after it is back, is nobody's fault: a
Redis restart must not turn into every worker declared failed. Nor is silence while the daemon
itself did not run (stopped, starved: a tick comes more than STALL_SECONDS late): nobody's
heartbeat was read meanwhile. Nor is silence the daemon has not read yet: while the consumer is
behind its stream (a backlog of events), a live worker's newest heartbeat or ack may be sitting
unread, so silence and lateness are judged only up to the time through which every event in the
stream has been handled (`Ingest.handled_through`), never up to the clock. A worker silent for the
timeout before that time is silent indeed. A suspicion is written only while this daemon holds
the lease (`Lease.xadd`), so one that stalled past its lease and wakes up writes nothing.

The detector is given what it reads and the two things it may do, nothing else of the daemon:
the job (it reads the workers and the plan; it changes nothing in it), the configuration,
the daemon's view of Redis, how far the daemon has read its stream, a function that writes
events to the job's stream (a host's thousands of suspicions go in a few round trips, not one
each), and one that publishes a generation again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import RedisError

from chameleond.core.machine import Phase
from chameleond.daemon.config import Config
from chameleond.daemon.reachability import Reachability
from chameleond.events import Event, Fault
from chameleond.jobstate.job import Job
from chameleond.jobstate.records import WorkerState

log = logging.getLogger("chameleond.detector")
TICK_SECONDS = 0.2
STALL_SECONDS = 1.0  # a tick this much late: the daemon was not running
NUDGE_SECONDS = 2.0


class Detector:
    def __init__(
        self,
        job: Job,
        cfg: Config,
        reachability: Reachability,
        write_events: Callable[[Sequence[Event]], Awaitable[None]],
        nudge: Callable[[int], Awaitable[None]],
        handled_through: Callable[[], float] | None = None,
    ) -> None:
        self.job, self.cfg, self.reachability = job, cfg, reachability
        # The time up to which every event in the stream has been handled (None: the clock's).
        self.handled_through = handled_through
        self.write_events = write_events  # to the job's event stream, signed, while leading
        self.nudge = nudge  # publish this generation again (the fenced learn they are out)
        self.reported: dict[str, float] = {}  # worker -> when a suspicion was written
        self.last_nudge = 0.0
        self.fenced_logged: set[str] = set()
        self.dead_logged: set[str] = set()
        self.last_tick = time.monotonic()
        self.quiet_until = 0.0  # after a stall of the daemon: nobody is suspected until then

    def suspects(self, now: float) -> dict[str, str]:
        """Workers of the current plan or on standby to declare failed now, with the reason."""
        job, cfg = self.job, self.cfg
        m = job.machine
        if m.phase in (Phase.WAITING, Phase.UNRECOVERABLE) or job.plan is None:
            return {}
        timeout = job.heartbeat_timeout(cfg.heartbeat_timeout_seconds)
        hold = max(2.0, timeout)
        # While Redis was away no heartbeat or ack could arrive; once it is back every worker
        # gets a whole timeout to be heard from again (their kept events come first).
        redis = self.reachability
        if redis.error or now - redis.since < hold or now < self.quiet_until:
            return {}
        # Silence is judged up to what was read: a heartbeat still in the backlog is not silence.
        through = now if self.handled_through is None else min(now, self.handled_through())
        out: dict[str, str] = {}
        # A worker on standby is offered to every decision, a joining one to the next: one that
        # died must not be planned in.
        heard_after = through - timeout
        for w in (*m.plan_workers, *sorted(m.standby), *sorted(m.pending_joins)):
            rec = job.workers.get(w)
            if rec is not None and rec.last_heartbeat >= heard_after:
                continue  # heard within the timeout: the common case, looked at first
            if w in out or w in m.failed or now - self.reported.get(w, 0.0) < hold:
                continue
            if job.ended(w) or (job.pending(w) and w not in m.pending_joins):
                continue
            age = through - job.worker(w).last_heartbeat
            if age > timeout:
                out[w] = f"heartbeat lapse: none for {age:.1f} s (timeout {timeout:g} s)"
        for w in m.overdue(through):
            if job.ended(w):
                continue
            if w not in out and not job.pending(w) and now - self.reported.get(w, 0.0) >= hold:
                out[w] = (
                    f"did not acknowledge generation {m.generation} within "
                    f"{cfg.ready_timeout_seconds:g} s"
                )
        return out

    def out_of_plans(self, now: float) -> dict[str, WorkerState]:
        """The state of each worker declared failed or excluded by the plan: only these can be
        fenced or dead (Job.worker_state), so the others are not looked at on every tick."""
        job, m = self.job, self.job.machine
        timeout = job.heartbeat_timeout(self.cfg.heartbeat_timeout_seconds)
        out = {}
        for w in sorted(m.failed | set(job.plan.excluded if job.plan else ())):
            rec = job.workers.get(w)
            state = job.worker_state(rec, now, timeout) if rec else None
            if state is not None:
                out[w] = state
        return out

    async def run(self) -> None:
        job, cfg = self.job, self.cfg
        while True:
            await asyncio.sleep(TICK_SECONDS)
            # Late against the end of the tick before: the time its own writes took is not the
            # daemon not running.
            late = time.monotonic() - self.last_tick - TICK_SECONDS
            now = time.time()
            if late > STALL_SECONDS:
                hold = max(2.0, job.heartbeat_timeout(cfg.heartbeat_timeout_seconds))
                self.quiet_until = now + hold
                log.warning("the daemon did not run for %.1f s: suspecting nobody for %.0f s",
                            late, hold)  # fmt: skip
            try:
                suspected = self.suspects(now)
                for worker, cause in suspected.items():
                    self.reported[worker] = now
                    log.warning("suspect %s: %s", worker, cause)
                if suspected:
                    await self.write_events(
                        [Fault(w, cause, source="detector") for w, cause in suspected.items()]
                    )
                states = self.out_of_plans(now)
                fenced = sorted(w for w, s in states.items() if s is WorkerState.FENCED)
                for w in set(fenced) - self.fenced_logged:
                    log.warning("fenced %s: heard from after it was declared failed", w)
                self.fenced_logged = set(fenced)
                dead = {w for w, s in states.items() if s is WorkerState.FAILED}
                for w in sorted(dead - self.dead_logged):
                    log.warning("%s is dead: nothing heard from it since it was declared failed", w)
                self.dead_logged = dead
                if fenced and now - self.last_nudge >= NUDGE_SECONDS:
                    self.last_nudge = now
                    await self.nudge(job.machine.generation)
            except (RedisError, OSError) as e:
                log.warning("detector: %s", e)
            self.last_tick = time.monotonic()
