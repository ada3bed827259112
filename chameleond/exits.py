"""A worker's exit codes (docs/worker.md): what `chameleon-worker`, and a user's script that ends in
`chameleond.worker.run`, tell the process that started it. Supervisors (chameleon-agent, the
systemd unit's RestartPreventExitStatus) read them without importing the worker library."""

from __future__ import annotations

from enum import IntEnum


class WorkerExit(IntEnum):
    OK = 0  # finished its --max-steps, or stopped by SIGTERM/SIGINT
    USAGE = 2  # bad command line or environment (no secret, a bad id, a bad directory)
    REDIS = 3  # Redis unreachable at start, a write refused, or away too long
    SPEC = 4  # the job spec is missing or malformed
    BACKEND = 5  # the device is not there, or its collective backend is unavailable
    DATA = 6  # no training data, or other data than the job's
    DEVICE = 7  # this worker's own computation failed (it reported itself first)
    MODEL = 8  # the user's model is malformed
    FENCED = 9  # a plan fenced it: the job went on without it; started again, it rejoins


# Codes a restart cannot mend: the same command, spec, data or model fails the same way, and a
# failed device stays failed until someone repairs it.
PERMANENT = frozenset(
    {WorkerExit.USAGE, WorkerExit.SPEC, WorkerExit.DATA, WorkerExit.DEVICE, WorkerExit.MODEL}
)
