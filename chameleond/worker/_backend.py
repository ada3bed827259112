"""Which collective backend a device uses, and how one process group is built on a store.

cpu -> gloo, cuda:N -> nccl, npu:N -> hccl (Ascend, through the optional `torch_npu` package: the
`npu` extra). A missing or broken backend is a `BackendUnavailable` whose message says what to
install, never an import trace. Groups are built directly on a store (no global default group), so
every plan generation's groups are plain objects that can be dropped when the generation ends.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from chameleond.worker.api import BackendUnavailable, DeviceFailed

log = logging.getLogger("chameleon.worker")


class CollectiveFailed(RuntimeError):
    """A collective or point-to-point operation, or the building of a group, failed: a peer's
    fault (it died, or its groups closed), which the worker answers by naming the dead peers."""


@contextmanager
def communicating() -> Iterator[None]:
    """Around the worker's communication: torch raises a plain RuntimeError when a peer's
    connection closes; here it becomes a CollectiveFailed, told apart from the worker's own
    errors and from bugs, which are not retried."""
    try:
        yield
    except (CollectiveFailed, DeviceFailed, dist.DistError):
        raise
    except RuntimeError as e:
        raise CollectiveFailed(f"{type(e).__name__}: {e}") from e


@contextmanager
def computing() -> Iterator[None]:
    """Around a worker's own computation (forward, backward, update): an error there is the
    device's, told apart from the errors of collectives, which a failed peer causes."""
    try:
        yield
    except DeviceFailed:
        raise
    except RuntimeError as e:  # torch's errors, CUDA's and out-of-memory included
        raise DeviceFailed(f"{type(e).__name__}: {e}") from e


def check_device_health(device: torch.device) -> None:
    """Raise DeviceFailed when the device no longer computes. A CUDA kernel's error is reported
    at the next synchronisation, often inside a collective, where it looks like a peer's; a
    sticky one (an ECC error, an illegal address) then fails every later kernel, this one too."""
    with computing():
        x = torch.ones(4, device=device)
        (x * 2).sum().item()  # .item() waits for the kernel


@dataclass(frozen=True)
class DeviceChoice:
    kind: str  # "cpu" | "cuda" | "npu"
    index: int
    backend: str  # "gloo" | "nccl" | "hccl"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.index)

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"


def parse_device(text: str) -> DeviceChoice:
    """`cpu`, `cuda:N` or `npu:N`; raises ValueError with the accepted forms."""
    kind, _, idx = text.partition(":")
    if kind == "cpu" and not idx:
        return DeviceChoice("cpu", 0, "gloo")
    if kind in ("cuda", "npu") and (idx.isdigit() or not idx):
        return DeviceChoice(kind, int(idx or 0), "nccl" if kind == "cuda" else "hccl")
    raise ValueError(f"device {text!r}: expected cpu, cuda:N or npu:N")


def check_device(dev: DeviceChoice) -> None:
    """Make the device current, or raise BackendUnavailable saying, in one line naming the
    device, what is missing."""
    if dev.kind == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
            raise BackendUnavailable(
                f"device {dev} is not there: torch {torch.__version__} ({build}) sees no CUDA "
                "device on this machine"
            )
        if dev.index >= (n := torch.cuda.device_count()):
            raise BackendUnavailable(f"device {dev} is not there: {_seen('cuda', n)}")
        if not dist.is_nccl_available():
            raise BackendUnavailable(f"device {dev}: this torch build has no NCCL backend")
        try:
            torch.cuda.set_device(dev.index)
        except RuntimeError as e:  # a device that is listed but cannot be used (busy, broken)
            raise BackendUnavailable(f"device {dev} cannot be used: {_first_line(e)}") from None
        # By default a timed-out NCCL operation ends the process (3: tear down). A survivor of a
        # peer's death must live on to the next plan: abort the communicator only, so that the
        # pending operation fails and the worker reports the fault.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    elif dev.kind == "npu":
        try:
            npu = _torch_npu()
        except BackendUnavailable as e:
            raise BackendUnavailable(f"device {dev}: {e}") from None
        if not npu.npu.is_available():  # pragma: no cover - needs Ascend hardware
            raise BackendUnavailable(f"device {dev} is not there: torch_npu sees no NPU device")
        if dev.index >= (n := npu.npu.device_count()):  # pragma: no cover
            raise BackendUnavailable(f"device {dev} is not there: {_seen('npu', n)}")
        npu.npu.set_device(dev.index)  # pragma: no cover


def _seen(kind: str, n: int) -> str:
    """What this machine has of a kind of device, as a user names them."""
    names = f"{kind}:0" if n == 1 else f"{kind}:0 to {kind}:{n - 1}"
    return f"this machine has {n} {kind.upper()} device{'s' if n != 1 else ''} ({names})"


def _first_line(e: BaseException) -> str:
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _torch_npu() -> Any:
    try:
        return importlib.import_module("torch_npu")
    except ImportError as e:
        raise BackendUnavailable(
            "torch_npu is not installed: pip install 'chameleond[npu]' "
            f"(torch-npu matching torch {torch.__version__.split('+')[0]}) ({e})"
        ) from None
    except Exception as e:  # a broken install raises anything at import time
        raise BackendUnavailable(f"torch_npu is installed but fails to import: {e}") from None


def device_memory_bytes(dev: DeviceChoice) -> int:
    if dev.kind == "cuda":
        return int(torch.cuda.get_device_properties(dev.index).total_memory)
    if dev.kind == "npu":  # pragma: no cover - needs Ascend hardware
        return int(_torch_npu().npu.get_device_properties(dev.index).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def new_group(
    store: dist.Store,
    rank: int,
    size: int,
    dev: DeviceChoice,
    *,
    bind_address: str,
    timeout: timedelta,
) -> Any:
    """One process group over `store`; blocks until all `size` members joined (or the store
    aborts)."""
    with communicating():
        return _new_group(store, rank, size, dev, bind_address, timeout)


def _new_group(
    store: dist.Store, rank: int, size: int, dev: DeviceChoice, bind: str, timeout: timedelta
) -> Any:
    if dev.backend == "gloo":
        # The options type is private in torch's stubs; it is the only way to pass the device.
        opts = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
        return dist.ProcessGroupGloo(store, rank, size, opts)
    if dev.backend == "nccl":
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        nccl_opts.config.blocking = False  # an abort from another thread can end its set-up
        return dist.ProcessGroupNCCL(store, rank, size, nccl_opts)
    npu = _torch_npu()  # pragma: no cover - needs Ascend hardware
    hccl = npu._C._distributed_c10d.ProcessGroupHCCL  # pragma: no cover
    return hccl(store, rank, size, timeout)  # pragma: no cover


def abort_group(group: Any) -> bool:
    """Fail every pending and later operation of `group` (its generation ended, or a member is
    gone); False when the backend cannot abort a group (dropping it still closes it)."""
    try:
        group.abort()
    except RuntimeError as e:
        log.debug("group abort: %s", e)
        return False
    return True


_retiring: list[threading.Thread] = []
_retiring_lock = threading.Lock()


def retire_groups(groups: list[Any]) -> None:
    """Abort and drop `groups` (an ended generation's) in a thread of their own, and return at
    once. NCCL's abort of a communicator took 1.0 s on an H200 (NCCL 2.28.9; building one took
    20 ms), and dropping one that was not aborted 0.4 to 0.5 s: on the worker's path, every
    plan change would wait for it before building the next generation. The list is emptied: the
    thread holds the last references."""
    held = list(groups)
    groups.clear()

    def run() -> None:
        t0 = time.perf_counter()
        for g in held:
            abort_group(g)
        held.clear()  # the destructors run here, not in the worker's thread
        log.debug("retired groups in %.3f s", time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="chameleond-retire", daemon=True)
    with _retiring_lock:
        _retiring[:] = [t for t in _retiring if t.is_alive()]
        _retiring.append(thread)
    thread.start()


def wait_retired(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the groups being retired (before the process exits);
    False when some are still being torn down."""
    deadline = time.monotonic() + timeout
    with _retiring_lock:
        threads = list(_retiring)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def build_communicator(group: Any, dev: DeviceChoice) -> None:
    """NCCL and HCCL build a group's communicator at its first collective, which every member
    must join. A batch of point-to-point transfers (`exchange`) runs on that communicator, and
    the members with nothing to send in the first batch would not join it: so every member builds
    it right after the group, with one small all-reduce, in the order the groups are built (the
    same everywhere). Nothing to do on gloo, whose groups connect when they are made."""
    if dev.backend != "gloo":
        allreduce_sum(group, torch.zeros(1), dev.torch_device)


def allreduce_sum(group: Any, host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """SUM all-reduce of a small host tensor (a commit vote, the reconcile rows); the result on
    the host. NCCL and HCCL reduce device tensors only, so it makes the trip through `device`."""
    t = host.to(device)
    with communicating():
        group.allreduce([t]).wait()
        return t.cpu()  # on a GPU, an error of the collective may surface at this copy


# One point-to-point operation: (send?, tensor, peer rank). It goes on the wire with P2P_TAG.
P2POp = tuple[bool, torch.Tensor, int]

# The tag of every point-to-point op. NCCL and HCCL ignore tags and match a pair's messages in the
# order they are issued; so that a run on gloo is a run of what they do, no op carries another tag
# and every caller issues a pair's messages in the same order on both sides
# (chameleond.worker._p2p).
P2P_TAG = 0


def exchange(group: Any, ops: Sequence[P2POp]) -> list[Any]:
    """Issue `ops` as one batch, in order; one work per op, to wait on.

    A backend that coalesces (NCCL, HCCL) runs the batch as one group, which progresses all its
    ops at once, so a send that waits for its receive cannot block a receive of the same
    batch (chameleond.worker._p2p says why that is enough); its single work stands for every op. On
    gloo each op runs on its own, asynchronously; gloo, too, matches a pair's messages of one tag
    in issue order.
    """
    if not ops:
        return []
    coalesce = bool(getattr(group, "supports_coalescing", False))
    with communicating():
        if coalesce:  # NCCL, HCCL (not gloo)
            group._start_coalescing()
        works = [
            (group.send if send else group.recv)([tensor], peer, P2P_TAG)
            for send, tensor, peer in ops
        ]
        if coalesce:
            return [group._end_coalescing()] * len(ops)
    return works
