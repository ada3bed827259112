"""Where an NCCL group's teardown and rebuild time goes, one process, one GPU (world size 1).

Prints one JSON line per part, then `RESULT` and all of them. `nonblocking`: the phases of
chameleond.worker._backend's path as a generation builds its groups (construct: ProcessGroupNCCL
on a store; communicator: its first collective, the lazy ncclCommInitRank; a warm all-reduce;
abort), `reps` times. `change_inline` / `change_retired`: a plan change, the old generation's
group torn down where the worker waits, or in a thread (backend.retire_groups), then the next one
built and used. `torch`: torch's own paths, init_process_group bound to the device (eager init), a
child by ncclCommSplit (new_group on the bound parent), destroy.

    python scripts/gpu/nccl_costs.py cuda:0      # REPS=3 for fewer repetitions
"""

import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from chameleond.worker._backend import (
    abort_group,
    allreduce_sum,
    build_communicator,
    check_device,
    new_group,
    parse_device,
)

dev = parse_device(sys.argv[1] if len(sys.argv) > 1 else "cuda:0")
reps = int(os.environ.get("REPS", "4"))
check_device(dev)
out: dict = {"device": str(dev), "torch": torch.__version__, "reps": reps}
if dev.kind == "cuda":
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    out["gpu"] = torch.cuda.get_device_name(dev.index)
x = torch.ones(1)
allreduce_sum_dev = dev.torch_device


def ours(tag: str, blocking: bool) -> dict:
    phases: dict[str, list[float]] = {
        k: [] for k in ("construct", "communicator", "allreduce", "abort")
    }
    base = dist.HashStore()
    for i in range(reps):
        store = dist.PrefixStore(f"{tag}{i}/", base)
        t0 = time.perf_counter()
        if blocking and dev.backend == "nccl":
            o = dist.ProcessGroupNCCL.Options()
            o._timeout = timedelta(seconds=60)
            g = dist.ProcessGroupNCCL(store, 0, 1, o)
        else:
            g = new_group(store, 0, 1, dev, bind_address="127.0.0.1", timeout=timedelta(seconds=60))
        t1 = time.perf_counter()
        build_communicator(g, dev)
        t2 = time.perf_counter()
        allreduce_sum(g, x, allreduce_sum_dev)
        t3 = time.perf_counter()
        abort_group(g)
        t4 = time.perf_counter()
        del g
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=False):
            phases[k].append(round(v, 6))
    phases_med = {k + "_median": round(statistics.median(v), 6) for k, v in phases.items()}
    return {
        **phases,
        **phases_med,
        "rebuild_median": round(
            statistics.median(
                map(sum, zip(phases["construct"], phases["communicator"], strict=True))
            ),
            6,
        ),
    }


def step(name, fn):
    t = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:  # one failing phase does not hide the others
        out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    out[name + "_seconds"] = round(time.perf_counter() - t, 3)
    print(json.dumps({name: out[name]}), flush=True)


step("nonblocking", lambda: ours("nb", False))


def used_group(store: dist.Store) -> object:
    """A one-rank group of the worker's backend on `store`, its communicator built and used."""
    g = new_group(store, 0, 1, dev, bind_address="127.0.0.1", timeout=timedelta(seconds=60))
    build_communicator(g, dev)
    allreduce_sum(g, x, allreduce_sum_dev)
    return g


def next_generation(tag: str, background: bool) -> dict:
    """A plan change as a worker makes it: the old generation's group torn down, the next built
    and used (its first all-reduce). background: the teardown in a thread (retire_groups)."""
    from chameleond.worker._backend import retire_groups, wait_retired

    base = dist.HashStore()
    path, total = [], []
    for i in range(reps):
        g = used_group(dist.PrefixStore(f"{tag}{i}a/", base))
        t0 = time.perf_counter()
        if background:
            retire_groups([g])
        else:
            abort_group(g)
        del g
        g2 = used_group(dist.PrefixStore(f"{tag}{i}b/", base))
        path.append(round(time.perf_counter() - t0, 6))
        wait_retired(30)
        total.append(round(time.perf_counter() - t0, 6))
        abort_group(g2)
        del g2
    return {
        "critical_path": path,
        "critical_path_median": round(statistics.median(path), 6),
        "until_torn_down": total,
    }


step("change_inline", lambda: next_generation("ci", False))
step("change_retired", lambda: next_generation("cr", True))


def torch_paths() -> dict:
    r: dict = {}
    store = dist.HashStore()
    t0 = time.perf_counter()
    kw = {"device_id": dev.torch_device} if dev.kind == "cuda" else {}
    dist.init_process_group(dev.backend, store=store, rank=0, world_size=1, **kw)
    r["init_bound"] = round(time.perf_counter() - t0, 6)
    t0 = time.perf_counter()
    t = torch.ones(1, device=dev.torch_device)
    dist.all_reduce(t)
    torch.cuda.synchronize() if dev.kind == "cuda" else None
    r["first_allreduce"] = round(time.perf_counter() - t0, 6)
    splits = []
    for _ in range(reps):
        t0 = time.perf_counter()
        child = dist.new_group([0])  # ncclCommSplit from the bound parent
        t = torch.ones(1, device=dev.torch_device)
        dist.all_reduce(t, group=child)
        torch.cuda.synchronize() if dev.kind == "cuda" else None
        splits.append(round(time.perf_counter() - t0, 6))
        t0 = time.perf_counter()
        dist.destroy_process_group(child)
        r.setdefault("destroy_child", []).append(round(time.perf_counter() - t0, 6))
    r["split_child_with_allreduce"] = splits
    r["split_median"] = round(statistics.median(splits), 6)
    try:
        from torch.distributed.distributed_c10d import _get_default_group

        pg = _get_default_group()
        be = pg._get_backend(dev.torch_device)
        r["supports_shrinking"] = bool(getattr(be, "supports_shrinking", False))
        r["supports_splitting"] = bool(getattr(be, "supports_splitting", False))
    except Exception as e:
        r["backend_query"] = f"{type(e).__name__}: {e}"
    t0 = time.perf_counter()
    dist.destroy_process_group()
    r["destroy_world"] = round(time.perf_counter() - t0, 6)
    return r


step("torch", torch_paths)
print("RESULT " + json.dumps(out), flush=True)
