"""The collective backend of each kind of local device, in this process, as the workers use it
(chameleond.worker._backend): gloo on the CPU always, nccl on each CUDA device, hccl on each
Ascend NPU; each a single-rank group on an in-memory store: build, all-reduce, abort, rebuild.
torch is imported here only when the checks run (the daemon's install has none)."""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from chameleond.cli.doctor.check import Check, first_line
from chameleond.extras import install_hint

GROUP_TIMEOUT_SECONDS = 60.0  # a backend check that takes longer has hung
ALLREDUCES = 5  # timed all-reduces per backend (the median is reported)


def backends() -> list[Check]:
    """gloo on the CPU, nccl on each CUDA device, hccl on each NPU; absent ones skipped, why."""
    try:
        import torch
    except ImportError:
        why = f"torch is not installed: the daemon needs none, a worker {install_hint('worker')}"
        return [Check(f"{b} on {d}", "skip", why) for b, d in (("gloo", "cpu"), ("nccl", "cuda"))]
    out = [group_check("cpu")]
    if torch.cuda.is_available():
        out += [group_check(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    else:
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        why = f"no CUDA device on this machine (torch {torch.__version__}, {build})"
        out.append(Check("nccl on cuda", "skip", why, figures={"device": "cuda"}))
    npus = _npu_count()
    if isinstance(npus, str):
        out.append(Check("hccl on npu", "skip", npus, figures={"device": "npu"}))
    else:
        out += [group_check(f"npu:{i}") for i in range(npus)]  # pragma: no cover - Ascend
    return out


def _npu_count() -> int | str:
    """The NPUs torch_npu sees, or why there are none."""
    import importlib

    try:
        npu = importlib.import_module("torch_npu")
    except ImportError:
        return f"torch_npu is not installed ({install_hint('npu')} on an Ascend machine)"
    except Exception as e:  # a broken install raises anything at import time
        return f"torch_npu fails to import: {first_line(str(e))}"
    try:  # pragma: no cover - needs Ascend hardware
        n = int(npu.npu.device_count()) if npu.npu.is_available() else 0
    except Exception as e:  # pragma: no cover
        return f"torch_npu cannot list devices: {first_line(str(e))}"
    return n if n else "torch_npu sees no NPU device"  # pragma: no cover


def group_check(device: str) -> Check:
    """One device's backend as a worker uses it: build a group, all-reduce, abort, rebuild. In a
    thread with a deadline: a backend that hangs is that check's failure."""
    from chameleond.worker._backend import parse_device

    dev = parse_device(device)
    check = Check(f"{dev.backend} on {device}", figures={"backend": dev.backend, "device": device})
    done = threading.Event()

    def body() -> None:
        try:
            _exercise(dev, check)
        except Exception as e:
            check.verdict, check.detail = "fail", f"{type(e).__name__}: {first_line(str(e))}"
        finally:
            done.set()

    t0 = time.perf_counter()
    threading.Thread(target=body, name=f"doctor-{device}", daemon=True).start()
    if not done.wait(GROUP_TIMEOUT_SECONDS):
        check.verdict = "fail"
        check.detail = f"did not finish within {GROUP_TIMEOUT_SECONDS:.0f} s (hung)"
    check.seconds = time.perf_counter() - t0
    return check


def _exercise(dev: Any, check: Check) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from chameleond.worker._backend import (
        BackendUnavailable,
        abort_group,
        allreduce_sum,
        build_communicator,
        check_device,
        new_group,
    )

    try:
        check_device(dev)
    except BackendUnavailable as e:
        check.verdict, check.detail = "fail", str(e)
        return
    base = dist.HashStore()
    timeout = timedelta(seconds=GROUP_TIMEOUT_SECONDS)

    def build(generation: int) -> Any:
        # A fresh prefix per group, as the workers key each generation's store by its number.
        store = dist.PrefixStore(f"generation{generation}/", base)
        group = new_group(store, 0, 1, dev, bind_address="127.0.0.1", timeout=timeout)
        build_communicator(group, dev)
        return group

    t0 = time.perf_counter()
    group = build(1)
    built = time.perf_counter() - t0
    times, x = [], torch.ones(1024)
    for _ in range(ALLREDUCES):
        t0 = time.perf_counter()
        got = allreduce_sum(group, x, dev.torch_device)
        times.append(time.perf_counter() - t0)
    if not torch.equal(got, x):
        check.verdict, check.detail = "fail", "the all-reduce of one rank changed its input"
        return
    t0 = time.perf_counter()
    aborted = abort_group(group)
    abort = time.perf_counter() - t0
    t0 = time.perf_counter()
    rebuilt = build(2)
    allreduce_sum(rebuilt, x, dev.torch_device)
    rebuild = time.perf_counter() - t0  # not the group's teardown (NCCL's: 0.4 s and more)
    abort_group(rebuilt)
    check.figures.update(
        build_seconds=round(built, 6),
        allreduce_seconds=round(statistics.median(times), 6),
        abort_seconds=round(abort, 6),
        rebuild_seconds=round(rebuild, 6),
    )
    check.detail = (
        f"build {built:.3f} s, all-reduce {statistics.median(times) * 1e3:.2f} ms, "
        f"abort {abort * 1e3:.2f} ms, rebuild {rebuild:.3f} s (rebuild_seconds, one rank)"
    )
    if not aborted:
        check.verdict = "warn"
        check.detail += "; this backend cannot abort a group: a survivor waits for its timeout"
