"""One TorchFT replica group of `chameleonctl bench peers`: examples/recipe.py's model, data and
recipe trained as a TorchFT user trains it.

    python -m chameleond.bench.peers_torchft --spec SPEC --replica R --replicas N
        --lighthouse http://127.0.0.1:PORT --log FILE [--patched] [--ready DIR]

Each replica group is this one process (group world size 1) and hosts its own TCPStore, as
torchrun's agent would (MASTER_ADDR:MASTER_PORT). It uses torchft 0.2's documented pieces: a
`Manager` heartbeating to the Lighthouse, `ProcessGroupGloo`, `torchft.DistributedDataParallel`,
`torchft.Optimizer` (quorum at `zero_grad`, `should_commit` at `step`), and `DistributedSampler`
sharding the data across replica groups. The recipe is the same as the chameleond workers': the
GPT-2 from the spec's `[model.arch]`, AdamW over the same named groups, warm-up + cosine, global
clipping, shuffled samples, the job's global batch and micro-batch (the global batch split
evenly over the replica groups, each accumulating its micro-batches before one all-reduce).

The data follows the manager's step: step s reads chunk s of this group's shard, so a group that
heals from a peer reads the shard where the job is (torchft's own examples iterate a loader
whose position the heal does not carry). Every iteration appends one JSON line to --log: the step,
the sample ids read, their summed loss, whether the group took part (a healing group's gradient
is zeroed) and whether `should_commit()` let the optimizer step.

--patched replaces `DistributedDataParallel._comm_hook` with one that, when the all-reduce failed
(the manager holds the error and the step will not commit), returns a completed future instead of
asserting on the missing inner future: on gloo, a peer killed during an all-reduce otherwise
raises AssertionError in the survivor's backward, which ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_CRASHES = 4  # replica groups that end by themselves more often: the runner itself is broken
EPOCHS = 50  # the sampler's positions: 50 passes over the dataset


def sample_id(arch: dict[str, Any], position: int) -> int:
    """The sample a position reads, as the chameleond workers and recipe.py's plain loop read it."""
    from chameleond.worker._sampler import permutation

    n = int(arch["samples"])
    if not arch["shuffle"]:
        return position % n
    return int(permutation(n, int(arch["seed"]), position // n)[position % n])


def patch_comm_hook() -> None:
    """The smallest fix: a failed all-reduce gives back the bucket as it is (the manager has
    recorded the error, so should_commit() is False and the gradient is thrown away)."""
    import torch
    import torch.distributed as dist
    from torchft.ddp import DistributedDataParallel

    def comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        work.wait()
        inner = getattr(work.get_future(), "_fut", None)
        if inner is None:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return inner

    # DDP checks the hook's annotations as objects, not as this module's postponed strings.
    comm_hook.__annotations__["bucket"] = dist.GradBucket
    comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]

    DistributedDataParallel._comm_hook = staticmethod(comm_hook)


def recipe_module() -> Any:
    from chameleond.local.examples import find_example

    sys.path.insert(0, str(find_example("recipe").script.parent))
    import recipe

    return recipe


def train(args: argparse.Namespace) -> int:
    import torch
    import torchft
    from torch.distributed import TCPStore

    from chameleond.core.spec import load_spec
    from chameleond.worker.hf import causal_lm_loss

    torch.set_num_threads(1)  # the chameleond workers' kernels
    if args.patched:
        patch_comm_hook()
    recipe = recipe_module()
    spec = load_spec(args.spec)
    arch = recipe.arch_of(spec.arch)
    B, b, W = spec.training.global_batch, spec.training.micro_batch, args.replicas
    local = B // W
    model = recipe.model_of(arch)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    inner = recipe.optimizer_of(arch)(named)
    schedule = recipe.schedule_of(arch)(inner)
    data = recipe.dataset(arch)

    def load_state(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        schedule.load_state_dict(state["schedule"])

    def state() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optim": inner.state_dict(),
            "schedule": schedule.state_dict(),
        }

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        load_state_dict=load_state,
        state_dict=state,
        min_replica_size=1,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.timeout),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"peers_{args.replica}",
        hostname="127.0.0.1",
        init_sync=False,  # every group builds the same seeded model (torchft's advice)
    )
    ddp = torchft.DistributedDataParallel(manager, model)
    optimizer = torchft.Optimizer(manager, inner)
    positions = list(range(B * (EPOCHS * int(arch["samples"]) // B)))
    shard = list(
        torchft.DistributedSampler(
            positions, replica_rank=args.replica, num_replica_groups=W,
            group_rank=0, num_replicas=1, shuffle=False,
        )
    )  # fmt: skip
    if args.ready is not None:  # the first quorum: every group heartbeating before the first step
        (args.ready / f"{args.replica}").touch()
        while len(list(args.ready.iterdir())) < W:
            time.sleep(0.05)
    log = args.log.open("a")
    while True:
        optimizer.zero_grad()  # starts the quorum
        read_step = manager.current_step()
        ids = [sample_id(arch, p) for p in shard[read_step * local : (read_step + 1) * local]]
        loss_sum = 0.0
        for k in range(0, local, b):
            rows = [data[i] for i in ids[k : k + b]]
            batch = {key: torch.stack([r[key] for r in rows]) for key in ("input_ids", "labels")}
            last = k + b >= local
            with contextlib.nullcontext() if last else ddp.no_sync():
                per_sample = causal_lm_loss(ddp(input_ids=batch["input_ids"]).logits, batch)
                (per_sample.sum() / local).backward()
            loss_sum += float(per_sample.detach().sum())
        norm = torch.nn.utils.clip_grad_norm_(
            [p for _, p in named], arch["max_grad_norm"] or math.inf
        )
        step = manager.current_step()  # a healing group's is the job's, set by the quorum
        optimizer.step()  # should_commit()
        committed = manager.current_step() == step + 1
        if committed:
            schedule.step()
        line = {
            "replica": args.replica, "step": step, "read_step": read_step, "ids": ids,
            "loss_sum": loss_sum, "grad_norm": float(norm),
            "participating": manager.is_participating(), "committed": committed,
            "participants": manager.num_participants(), "t": time.time(),
            "quorum": manager._quorum_id,
        }  # fmt: skip
        log.write(json.dumps(line) + "\n")
        log.flush()


# -- the bench's side: a Lighthouse, the replica groups, the kill and the return ------------------


@dataclass
class Schedule:
    """When the victim is killed (once this step has committed; None: never), how long it stays
    away, and when the run ends: this many seconds after the return, or once `end_step` has
    committed."""

    victim: int
    kill_step: int | None
    away_seconds: float
    after_seconds: float
    end_step: int | None = None
    timeout_seconds: float = 300.0


@dataclass
class TorchftRun:
    lines: list[dict[str, Any]]
    kill_at: float | None
    return_at: float | None
    crashes: list[str] = field(default_factory=list)  # a replica that ended by itself, and why


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    from chameleond.local.cluster import _die_with_parent

    with log.open("ab") as out:
        return subprocess.Popen(  # noqa: S603 - this interpreter and torchft's binary, no shell
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_torchft(
    spec: Path, run_dir: Path, replicas: int, when: Schedule, *, patched: bool,
    heartbeat_timeout_ms: int | None,
) -> TorchftRun:  # fmt: skip
    """A Lighthouse and one process per replica group; the victim kill -9'd and started again
    as `when` says. A group that exits by itself is started again at once, as torchrun's
    restarts would."""
    from chameleond.redis_server import free_port

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "ready").mkdir()
    port = free_port()
    beat = (
        []
        if heartbeat_timeout_ms is None
        else ["--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    )
    binary = str(Path(sys.executable).parent / "torchft_lighthouse")
    lighthouse = _spawn([binary, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}", *beat],
                        run_dir / "lighthouse.log")  # fmt: skip
    logs = [run_dir / f"replica{r}.jsonl" for r in range(replicas)]

    def start(r: int, first: bool) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "chameleond.bench.peers_torchft",
                "--spec", str(spec), "--replica", str(r),
                "--replicas", str(replicas), "--lighthouse", f"http://127.0.0.1:{port}",
                "--log", str(logs[r])] + (["--patched"] if patched else [])  # fmt: skip
        return _spawn(argv + (["--ready", str(run_dir / "ready")] if first else []),
                      run_dir / f"replica{r}.log")  # fmt: skip

    procs = {r: start(r, True) for r in range(replicas)}
    readers: dict[int, IO[str]] = {}
    partial = dict.fromkeys(range(replicas), "")
    lines: list[dict[str, Any]] = []
    out = TorchftRun(lines, None, None)
    deadline = time.monotonic() + when.timeout_seconds
    try:
        while True:
            time.sleep(0.05)
            for r, path in enumerate(logs):
                if r not in readers and path.exists():
                    readers[r] = path.open()
                if r in readers:
                    *whole, partial[r] = (partial[r] + readers[r].read()).split("\n")
                    lines += [json.loads(x) for x in whole]
            done = max((x["step"] for x in lines if x["committed"]), default=-1)
            now = time.time()
            if out.kill_at is None and when.kill_step is not None and done >= when.kill_step:
                out.kill_at = time.time()
                _kill(procs[when.victim])
            away = out.kill_at is not None and out.return_at is None
            if away and now >= out.kill_at + when.away_seconds:  # type: ignore[operator]
                out.return_at = time.time()
                procs[when.victim] = start(when.victim, False)
            for r, proc in procs.items():
                if proc.poll() is not None and not (away and r == when.victim):
                    out.crashes.append(f"replica {r} exited {proc.returncode} at {now:.3f}: "
                                       f"{_last_error(run_dir / f'replica{r}.log')}")  # fmt: skip
                    if len(out.crashes) > MAX_CRASHES:
                        raise RuntimeError(f"torchft run in {run_dir}: {out.crashes[-1]}")
                    procs[r] = start(r, False)
            if when.end_step is not None and done + 1 >= when.end_step:
                return out
            if out.return_at is not None and now >= out.return_at + when.after_seconds:
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchft run in {run_dir}: no end in {when.timeout_seconds} s")
    finally:
        for proc in [*procs.values(), lighthouse]:
            _kill(proc)
        for f in readers.values():
            f.close()


def _last_error(log: Path) -> str:
    """The last line of a replica's log that names an exception."""
    text = log.read_text(errors="replace").splitlines()
    errors = [x for x in text if "Error" in x or "Exception" in x]
    return (errors or text or ["(nothing logged)"])[-1][-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description="one TorchFT replica group of bench peers")
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--lighthouse", required=True, help="http://HOST:PORT")
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--ready", type=Path, help="a directory: wait for every group's mark")
    parser.add_argument("--patched", action="store_true", help="see the module's docstring")
    parser.add_argument("--timeout", type=float, default=60.0, help="torchft's timeouts, seconds")
    return train(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
