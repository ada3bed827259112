"""The devices a local job's workers train on (`chameleonctl up --device cuda|npu|cpu`).

By default, what this machine has: CUDA when torch sees a CUDA device, else Ascend NPUs when
torch_npu is installed and sees one, else the CPU. On an accelerator every worker gets a device
of its own (`cuda:0`, `cuda:1`, ...: NCCL and HCCL take one rank per device), so the job has as
many workers as there are devices; on the CPU the job keeps its own worker count. torch is
imported here only when asked (the daemon's install has none).
"""

from __future__ import annotations

import importlib
from typing import Any

KINDS = ("cuda", "npu", "cpu")


class DeviceError(ValueError):
    """The device kind asked for is not on this machine; the message says what is."""


def present() -> str:
    """The device kind this machine trains on by default."""
    if count("cuda"):
        return "cuda"
    if count("npu"):
        return "npu"
    return "cpu"


def count(kind: str) -> int:
    """How many devices of `kind` this process sees (0: none, or no software for them)."""
    if kind == "cpu":
        return 1
    if kind == "cuda":
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    npu = _torch_npu()
    if npu is None:
        return 0
    try:
        return int(npu.npu.device_count()) if npu.npu.is_available() else 0
    except Exception:  # a broken driver raises anything  # pragma: no cover - needs Ascend
        return 0


def require(kind: str) -> int:
    """The number of devices of `kind`; DeviceError when there are none."""
    n = count(kind)
    if n:
        return n
    if kind == "cuda":
        import torch

        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
        raise DeviceError(
            f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device on this "
            "machine; --device cpu trains on the CPU"
        )
    why = "torch_npu is not installed" if _torch_npu() is None else "torch_npu sees no NPU"
    raise DeviceError(
        f"--device npu: {why} (pip install 'chameleond[npu]'); --device cpu trains on the CPU"
    )


def memory_bytes(kind: str, index: int) -> int:
    """The device's memory, as its worker registers it."""
    if kind == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(index).total_memory)
    npu = _torch_npu()  # pragma: no cover - needs Ascend hardware
    assert npu is not None  # pragma: no cover
    return int(npu.npu.get_device_properties(index).total_memory)  # pragma: no cover


def _torch_npu() -> Any | None:
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # not installed, or an install that fails at import time
        return None
