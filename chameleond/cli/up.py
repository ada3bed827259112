"""Run a whole fault-tolerant training job on this machine, inject faults, and report.

Starts an embedded redis-server, one chameleond and N chameleon-worker processes (on --device:
by default CUDA, else Ascend NPUs, else the CPU; one worker per accelerator), trains the default
job (or --spec; a user's own training script with --script), injects the faults of --faults (or
replays --trace), shows live progress, and at the end prints a recovery report and writes
report.json and report.png to --report. Everything is torn down on exit, Ctrl-C or SIGTERM. See
docs/local.md.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from chameleond.core.policy import Selection
from chameleond.core.spec import JobSpec, SpecError, load_spec, parse_spec
from chameleond.extras import require
from chameleond.local import devices
from chameleond.local.cluster import ClusterError, Interrupted
from chameleond.local.examples import EXAMPLES, ExampleError, find_example
from chameleond.local.faults import FaultSpecError, check_workers, parse_faults
from chameleond.local.progress import ProgressView
from chameleond.local.report import build_report, print_table, write_report
from chameleond.local.run import LocalRun, RunOptions
from chameleond.protocol import Keys, url_error
from chameleond.redisurl import connect
from chameleond.traces.replay import ReplayStep, TraceError, load_trace, plan_replay

# The default schedule (docs/local.md, "Why the two default faults end differently").
# w0 has a replica of its stage (w2): rerouting keeps the layout and wins. w5 then holds a layer
# range no surviving stage holds: rerouting is infeasible and the job re-partitions (docs/local.md).
UP_SPEC = "cpu-mixed.toml"
DEFAULT_FAULTS = "kill:w0@step=40,kill:w5@step=100"
DEFAULT_STEPS = 160
DEFAULT_CHECKPOINT_EVERY = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        type=int,
        help="number of workers (default: the job's on the CPU, one per device on cuda and npu)",
    )
    parser.add_argument(
        "--device",
        choices=devices.KINDS,
        help="what the workers train on (default: what this machine has: cuda, else npu, else "
        "cpu); on cuda and npu each worker gets a device of its own",
    )
    parser.add_argument("--pp", type=int, help="stages per pipeline (default: the job's)")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help="steps to train (default: %(default)s)"
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--faults",
        default=None,
        help=f"faults to inject, e.g. kill:w3@step=5,event:w1@t=20s:ECC; corrupt:w3@step=9 cuts "
        f"w3's newest checkpoint file short; slow:w3@step=5:0.5[:SECONDS] runs w3 at half speed "
        f"(default: {DEFAULT_FAULTS}; 'none' for a failure-free run)",
    )
    src.add_argument(
        "--trace",
        type=Path,
        help="replay a time_ms,add|remove,nodeN trace: a file, or a packaged trace by name "
        "(oobleck-10m, oobleck-p3-trace, ...; see chameleond/traces)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=60.0,
        help="trace seconds per wall-clock second (default: %(default)s)",
    )
    parser.add_argument(
        "--report", type=Path, default=Path("chameleon-report"), help="output directory"
    )
    parser.add_argument(
        "--policy",
        choices=[s.value for s in Selection],
        default=Selection.ADAPTIVE.value,
        help="adaptive (the selector decides) or force one policy (default: %(default)s)",
    )
    parser.add_argument("--spec", type=Path, help="job description (default: the packaged job)")
    parser.add_argument(
        "--example",
        choices=sorted(EXAMPLES),
        help="train a user script of examples/ with its own job spec instead of the built-in "
        "model: hf = " + EXAMPLES["hf"].about + " (docs/local.md)",
    )
    parser.add_argument(
        "--script",
        type=Path,
        help="your own training script on the worker library (e.g. examples/sgd_tied.py), run "
        "as every worker with chameleon-worker's flags; needs --spec, the job spec of its model",
    )
    parser.add_argument(
        "--job",
        help="job name (default: 'local' on the embedded Redis, a new 'local-RUN_ID' on "
        "--redis-url; a name that already has state in that Redis is refused)",
    )
    parser.add_argument(
        "--mtbf-prior",
        type=float,
        default=None,
        help="the D prior in seconds (job.mtbf_prior_seconds; default: the spec's own)",
    )
    parser.add_argument(
        "--bind-addresses",
        default="",
        help="comma-separated loopback addresses, assigned to workers in turn (each is a host)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=DEFAULT_CHECKPOINT_EVERY,
        help="workers checkpoint every N steps into the report directory; the daemon restores "
        "the newest when a fault leaves some layer with no copy (0: never; default: %(default)s)",
    )
    parser.add_argument("--redis-url", help="use this Redis instead of an embedded one")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="give up after this many seconds"
    )


def _default_spec() -> JobSpec:
    from chameleond.jobs import load_spec_named

    return load_spec_named(UP_SPEC)


def build_spec_document(
    base: JobSpec,
    *,
    job: str,
    workers: int | None,
    pp: int | None,
    bind_addresses: list[str],
    mtbf_prior_seconds: float | None,
) -> dict[str, Any]:
    """The spec the daemon runs: the base job, laid out for --workers/--pp, a host per address."""
    from chameleond.jobstate.jobspec import spec_document

    doc = spec_document(base)
    doc["job"]["name"] = job
    if mtbf_prior_seconds is not None:
        doc["job"]["mtbf_prior_seconds"] = mtbf_prior_seconds
    if workers is not None or pp is not None:
        n = workers if workers is not None else len(base.workers)
        stages = pp if pp is not None else len(base.layout[0])
        if n <= 0 or stages <= 0:
            raise SpecError("--workers and --pp must be positive")
        if n % stages:
            raise SpecError(f"--pp {stages} does not divide --workers {n}")
        template = base.workers[0]
        doc["workers"] = [
            {"id": f"w{i}", "host": template.host, "memory_bytes": template.memory_bytes}
            for i in range(n)
        ]
        doc["plan"] = {"stages": stages}
    for i, w in enumerate(doc["workers"] if bind_addresses else ()):
        w["host"] = bind_addresses[i % len(bind_addresses)]
    parse_spec(doc)  # every layout problem surfaces here, as a SpecError naming the field
    return doc


def accelerator_layout(
    base: JobSpec, kind: str, devices_here: int, workers: int | None, pp: int | None
) -> tuple[int | None, int | None]:
    """--workers and --pp for a job on accelerators, one worker per device: the job's own layout
    when it has one worker per device here and neither is given, else the same model as pipelines
    of the job's first pipeline's depth at most, dividing the workers."""
    n = devices_here if workers is None else workers
    if n > devices_here:
        raise SpecError(
            f"--workers {n}: this machine has {devices_here} {kind} device(s), one worker each"
        )
    if workers is None and pp is None and n == len(base.workers):
        return None, None
    if pp is None:
        pp = max(d for d in range(1, len(base.layout[0]) + 1) if n % d == 0)
    return n, pp


def on_devices(doc: dict[str, Any], kind: str) -> dict[str, str]:
    """Worker i of the spec document on device `kind:i`, with that device's memory (what the
    planner fits stages into: docs/spec.md); worker -> device."""
    out = {}
    for i, w in enumerate(doc["workers"]):
        w["device"] = out[w["id"]] = f"{kind}:{i}"
        w["memory_bytes"] = devices.memory_bytes(kind, i)
    return out


def new_run_id() -> str:
    """Names one run: its start time (UTC) and a few random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def fresh_run_dir(report_dir: Path) -> Path:
    """Every run starts from nothing: the previous run's Redis data (its append-only file holds a
    finished job the daemon would resume), daemon state, logs and checkpoints go, and so does its
    report, so a run that fails can never leave the old report looking like its own."""
    run_dir = report_dir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    for name in ("report.json", "report.png"):
        (report_dir / name).unlink(missing_ok=True)
    run_dir.mkdir(parents=True)
    return run_dir


def job_taken(redis_url: str, job: str) -> bool:
    """Whether an external Redis already holds state of this job (a run would resume it)."""
    keys = Keys(job)
    with connect(redis_url) as client:
        return bool(client.exists(keys.state, keys.plan, keys.events, keys.decisions))


def run(args: argparse.Namespace) -> int:
    require("worker", "starting workers")
    require("local", "the report")
    err = sys.stderr
    run_id = new_run_id()
    if args.job is None:
        args.job = f"local-{run_id}" if args.redis_url else "local"
    worker_command: list[str] = []
    model = None
    try:
        if args.example:
            if args.spec:
                raise SpecError("--example brings its own job spec: drop --spec")
            if args.script:
                raise SpecError("--example and --script exclude each other: drop one")
            example = find_example(args.example)
            base = load_spec(example.spec)
            worker_command = example.worker_command()
            model = example.example.model
        elif args.script:
            if not args.spec:
                raise SpecError(
                    f"--script {args.script} needs --spec: the job spec of its model (as many "
                    "layers, the same batch sizes; docs/spec.md)"
                )
            if not args.script.is_file():
                raise SpecError(f"--script {args.script}: no such file")
            base = load_spec(args.spec)
            worker_command = [sys.executable, str(args.script.resolve())]
        else:
            base = load_spec(args.spec) if args.spec else _default_spec()
        device = args.device or devices.present()
        workers, pp = args.workers, args.pp
        if device != "cpu":
            workers, pp = accelerator_layout(base, device, devices.require(device), workers, pp)
        prior = args.mtbf_prior
        addresses = [a.strip() for a in args.bind_addresses.split(",") if a.strip()]
        doc = build_spec_document(
            base,
            job=args.job,
            workers=workers,
            pp=pp,
            bind_addresses=addresses,
            mtbf_prior_seconds=prior,
        )
        placed = on_devices(doc, device) if device != "cpu" else {}
        spec = parse_spec(doc)
        worker_ids = [w.id for w in spec.workers]
        if args.steps <= 0:
            raise SpecError("--steps must be positive")
        if args.checkpoint_every < 0:
            raise SpecError("--checkpoint-every must be >= 0")
        faults = (
            ()
            if args.trace
            else parse_faults(
                DEFAULT_FAULTS
                if args.faults is None
                else ("" if args.faults == "none" else args.faults)
            )
        )
        if args.faults is None and device != "cpu":
            # One worker per device: the default faults' workers may not exist, and killing
            # the only worker leaves nothing to recover with.
            kept = [f for f in faults if f.worker in worker_ids and len(worker_ids) > 1]
            if len(kept) < len(faults):
                print(
                    f"default faults: {len(faults) - len(kept)} of {len(faults)} left out on "
                    f"{len(worker_ids)} {device} worker(s) (--faults to choose)"
                )
            faults = tuple(kept)
        check_workers(faults, worker_ids)
        if args.redis_url and (why := url_error(args.redis_url)) is not None:
            raise SpecError(f"--redis-url {why}")
        if not args.checkpoint_every and any(f.action == "corrupt" for f in faults):
            raise FaultSpecError("corrupt: faults need checkpoints to corrupt: --checkpoint-every")
        late = [f for f in faults if f.at_step is not None and f.at_step >= args.steps - 1]
        if late:
            raise FaultSpecError(
                f"{late[0].action}:{late[0].worker}@{late[0].when}: beyond --steps {args.steps}"
            )
        replay: tuple[ReplayStep, ...] = ()
        if args.trace:
            r = plan_replay(load_trace(args.trace), worker_ids, time_scale=args.time_scale)
            replay = r.steps
            print(
                f"trace {args.trace}: {len(r.steps)} actions on {len(r.mapping)} mapped nodes, "
                f"{r.skipped} events skipped (nodes beyond the local cluster, or no change)"
            )
    except (SpecError, FaultSpecError, TraceError, ExampleError, devices.DeviceError) as e:
        print(f"chameleonctl up: {e}", file=err)
        return 2
    if args.redis_url:
        try:
            taken = job_taken(args.redis_url, args.job)
        except (OSError, RedisError) as e:
            print(f"chameleonctl up: cannot read Redis: {e}", file=err)
            return 1
        if taken:
            print(
                f"chameleonctl up: job {args.job!r} already has state in that Redis; name a new "
                "--job (or leave it out for a fresh one) so its finished run is not resumed",
                file=err,
            )
            return 2
    report_dir: Path = args.report
    run_dir = fresh_run_dir(report_dir)
    on = f"{len(worker_ids)} workers on {device}" + (
        f" ({', '.join(sorted(set(placed.values())))})" if placed else ""
    )
    print(f"run {run_id}: job {args.job}, {on}, report in {report_dir}")
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(doc, indent=2))
    bind = {w: addresses[i % len(addresses)] for i, w in enumerate(worker_ids)} if addresses else {}
    opts = RunOptions(
        job=args.job,
        workers=worker_ids,
        steps=args.steps,
        spec_path=spec_path,
        run_dir=run_dir,
        global_batch=spec.training.global_batch,
        faults=faults,
        replay=replay,
        policy=args.policy,
        redis_url=args.redis_url,
        bind_addresses=bind,
        timeout_seconds=args.timeout,
        checkpoint_every=args.checkpoint_every,
        worker_command=worker_command,
        devices=placed,
    )
    progress = ProgressView(sys.stdout)
    try:
        result = LocalRun(opts, progress).execute()
    except (KeyboardInterrupt, Interrupted):
        progress.close()
        print("chameleonctl up: interrupted; every process was stopped", file=err)
        return 130
    except ClusterError as e:
        progress.close()
        print(f"chameleonctl up: {e}", file=err)
        return 1
    mon = result.monitor
    report = build_report(
        job=args.job,
        global_batch=spec.training.global_batch,
        injections=result.injections,
        events=mon.events,
        decisions=mon.decisions,
        members=mon.members,
        plan_docs=mon.plans,
        extra={
            "completed": result.completed,
            "ended": result.reason,
            "run_id": run_id,
            "policy_option": args.policy,
            "workers": worker_ids,
            "layout": [list(p) for p in spec.layout],
            "mtbf_prior_seconds": spec.mtbf_prior_seconds,
            "skipped": result.skipped,
            "device": device,
            # A user's script (--example) says what it trained; absent for the built-in model.
            **({"example": args.example, "model": model} if args.example else {}),
            **({"script": str(args.script)} if args.script else {}),
        },
    )
    json_path, png_path = write_report(report, report_dir)
    print()
    print_table(report, sys.stdout)
    for s in result.skipped:
        print(f"not injected: {s}")
    print(f"run ended: {result.reason}")
    print(f"wrote {json_path} and {png_path} (logs in {run_dir / 'logs'})")
    return 0 if result.completed else 1
