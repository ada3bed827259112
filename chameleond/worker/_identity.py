"""Who a worker is when no flag says so: the environment of the launcher that started it.

`chameleon-worker` flags win; then chameleond's own variables (CHAMELEON_REDIS_URL, CHAMELEON_JOB,
CHAMELEON_WORKER_ID, CHAMELEON_DEVICE, CHAMELEON_BIND_ADDRESS, CHAMELEON_CHECKPOINT_DIR: what
chameleon-agent and the systemd units set); then a launcher's: torchrun's RANK and LOCAL_RANK,
SLURM's SLURM_PROCID and SLURM_LOCALID. A launcher's rank r becomes worker id `w{r}`, and its local
rank n the device `cuda:{n}` when CUDA is present (else the CPU). torchrun's MASTER_ADDR /
MASTER_PORT are not used: the workers build their process groups per plan generation on the job's
Redis.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from chameleond.protocol import JOB_ENV, REDIS_URL_ENV

WORKER_ID_ENV = "CHAMELEON_WORKER_ID"
DEVICE_ENV = "CHAMELEON_DEVICE"
BIND_ADDRESS_ENV = "CHAMELEON_BIND_ADDRESS"
CHECKPOINT_DIR_ENV = "CHAMELEON_CHECKPOINT_DIR"


@dataclass(frozen=True)
class Identity:
    redis_url: str | None
    job: str
    worker_id: str | None  # None: nothing names this worker
    device: str
    bind_address: str = "127.0.0.1"
    checkpoint_dir: Path | None = None  # None: no checkpoints


def from_env(env: Mapping[str, str], cuda: bool) -> Identity:
    """The defaults the environment gives (`cuda`: CUDA devices are present)."""
    rank = env.get("RANK") or env.get("SLURM_PROCID")
    local = env.get("LOCAL_RANK") or env.get("SLURM_LOCALID")
    worker_id = env.get(WORKER_ID_ENV) or (f"w{rank}" if rank else None)
    device = env.get(DEVICE_ENV) or (f"cuda:{local}" if cuda and local else "cpu")
    checkpoint_dir = env.get(CHECKPOINT_DIR_ENV)
    return Identity(
        env.get(REDIS_URL_ENV), env.get(JOB_ENV) or "default", worker_id, device,
        env.get(BIND_ADDRESS_ENV) or "127.0.0.1", Path(checkpoint_dir) if checkpoint_dir else None,
    )  # fmt: skip
