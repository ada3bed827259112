"""`chameleon-worker`: one training process on one device, following the job's plans. `run` is
the worker library's entry point: the same flags for any user's training; `main` launches the
built-in one (chameleond.worker.builtin).

Exit codes (docs/worker.md):
  0  fenced by a plan or finished --max-steps (acked `stopped`), or stopped by SIGTERM/SIGINT
  2  bad command line (including a --checkpoint-dir that is not a writable directory and a
     --bind-address of no local interface)
  3  Redis unreachable, or lost for good
  4  the job spec is missing, malformed, or its [model.arch] is unusable
  5  the device is not there (cuda:3 on a machine with one GPU, cuda without CUDA), or its
     collective backend is unavailable (npu without torch_npu, a torch without NCCL)
  6  the training data is unavailable, or differs from the other workers' (the built-in corpus:
     the standard library's sources)
  7  this worker's own computation failed
  8  the model is malformed (the message names the layer; docs/worker-api.md)
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import runpy
import signal
import sys
import tempfile
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import cast

import redis
import torch
import torch.distributed as dist

from chameleond import version_text
from chameleond.auth import SECRET_ENV, SECRET_FILE_ENV, AuthError, Keyring
from chameleond.core.spec import SpecError
from chameleond.protocol import MAX_ID_LEN, REDIS_URL_ENV, redact_url, url_error
from chameleond.sdnotify import Notifier
from chameleond.usage import Parser
from chameleond.worker import builtin
from chameleond.worker.api import DataError, ModelError, Training, TrainingOf
from chameleond.worker.backend import (
    BackendUnavailable,
    DeviceChoice,
    DeviceFailed,
    check_device,
    parse_device,
)
from chameleond.worker.events import connection_name, new_incarnation
from chameleond.worker.hooks import fault_hook_error
from chameleond.worker.identity import from_env
from chameleond.worker.runtime import WorkerConfig, WorkerRuntime
from chameleond.worker.saver import BUBBLE, MODES

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_REDIS = 3
EXIT_SPEC = 4
EXIT_BACKEND = 5
EXIT_CORPUS = 6
EXIT_DEVICE = 7
EXIT_MODEL = 8

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT."""


def build_parser(prog: str = "chameleon-worker") -> argparse.ArgumentParser:
    ident = from_env(os.environ, torch.cuda.is_available())
    p = Parser(
        prog=prog,
        description="Train one slot of a chameleond job: profile, register, follow the plans.",
        epilog="exit codes: 0 fenced, finished or stopped by a signal; 2 bad command line; "
        "3 Redis unreachable at start, a write refused, or away too long to keep the events; "
        "4 bad or missing job spec; 5 the device is not there or its backend is unavailable; "
        "6 no training "
        "data, or other data than the job's; 7 this worker's own computation failed (it "
        "reported itself first); 8 a malformed model. "
        "Redis restarts do not stop training (docs/worker.md).",
    )
    p.add_argument("--version", action="version", version=version_text("chameleon-worker"))
    p.add_argument(
        "--redis-url",
        default=ident.redis_url,
        help=f"Redis holding the job (redis:// or rediss://); default ${REDIS_URL_ENV}, which "
        "keeps a password out of the process list",
    )
    p.add_argument(
        "--job", default=ident.job, help="job name (keys chameleon:{job}:*); default $CHAMELEON_JOB"
    )
    p.add_argument(
        "--worker-id",
        default=ident.worker_id,
        help="this worker's id, as in the job spec; default $CHAMELEON_WORKER_ID, else w{RANK} "
        "(torchrun) or w{SLURM_PROCID}",
    )
    p.add_argument(
        "--device",
        default=ident.device,
        help="cpu | cuda:N | npu:N; default $CHAMELEON_DEVICE, else cuda:{LOCAL_RANK} under a "
        "launcher when CUDA is present, else cpu",
    )
    p.add_argument(
        "--bind-address",
        default="127.0.0.1",
        help="address the collective backend listens on and advertises (default 127.0.0.1)",
    )
    p.add_argument(
        "--group-timeout",
        type=float,
        default=10.0,
        help="seconds a collective may wait on a peer before the step is given up (default 10)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop (ack stopped, exit 0) once step N-1 is committed; 0: until fenced (default)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="checkpoint directory shared by the job's workers ({worker}-{step}.safetensors), "
        "read at start",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="write a checkpoint after every N-th committed step (with --checkpoint-dir; 0: never)",
    )
    p.add_argument(
        "--checkpoint-mode",
        choices=MODES,
        default=BUBBLE,
        help="bubble: write the checkpoint piece by piece where the next step waits (its "
        "pipeline bubbles); sync: stop training to write it (default %(default)s)",
    )
    p.add_argument(
        "--secret-file",
        default="",
        help=f"file holding the job's secret (docs/security.md); default ${SECRET_FILE_ENV}, "
        f"else the secret itself in ${SECRET_ENV}",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="run without a secret: events unsigned, plans and spec not verified",
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="DEBUG | INFO | WARNING | ERROR (default INFO)",
    )
    p.add_argument(
        "--script",
        type=Path,
        default=None,
        help="a training script to train instead of the built-in model: its module-level "
        "`training`, a Training or a function of the Job returning one (docs/worker-api.md)",
    )
    return p


def load_script(path: Path) -> Training | TrainingOf:
    """The `training` a script defines (run as a module, not as __main__); ValueError saying
    why there is none."""
    try:
        names = runpy.run_path(str(path), run_name="chameleon_script")
    except OSError as e:
        raise ValueError(f"--script {path}: {e.strerror or e}") from e
    except SyntaxError as e:
        raise ValueError(f"--script {path}: {e}") from e
    training = names.get("training")
    if not isinstance(training, Training) and not callable(training):
        raise ValueError(
            f"--script {path}: defines no `training` (a Training, or a function of the Job)"
        )
    return cast(Training | TrainingOf, training)


def _valid_id(text: str) -> bool:
    return 0 < len(text) <= MAX_ID_LEN and text.isprintable() and not any(c.isspace() for c in text)


def _timeout(seconds: float) -> timedelta | None:
    """`--group-timeout` as a timedelta; None for nan, inf, <= 0 or more than a timedelta holds."""
    if not (math.isfinite(seconds) and seconds > 0):
        return None
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        return None


def _checkpoint_dir_error(directory: Path) -> str | None:
    """Why checkpoints cannot be written to `directory` (created if missing), or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a regular file there, or in its path; no permission
        return f"--checkpoint-dir {directory}: not a usable directory ({e.strerror or e})"
    try:
        # Writing is the only reliable test (os.access ignores read-only mounts and ACLs).
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        return f"--checkpoint-dir {directory}: not writable ({e.strerror or e})"
    return None


def _bind_error(address: str, device: DeviceChoice) -> str | None:
    """Why the collective backend cannot listen on `address`, or None. gloo binds it for every
    group of every generation: an address of no local interface would fail each generation's
    build, and the worker would rebuild it forever."""
    if device.backend != "gloo":
        return None  # NCCL and HCCL pick their own interfaces
    try:
        dist.ProcessGroupGloo.create_device(hostname=address)
    except (RuntimeError, ValueError) as e:
        return f"--bind-address {address!r}: not an address of this host ({e})"
    return None


def main(argv: list[str] | None = None) -> int:
    """`chameleon-worker`: the built-in training (chameleond.worker.builtin)."""
    return launch(builtin.training_of, argv)


def launch(training: Training | TrainingOf, argv: Sequence[str] | None = None) -> int:
    """Run `training` as the worker the command line (default sys.argv) and the environment
    name (chameleond.worker.identity); the exit code."""
    prog = "chameleon-worker" if training is builtin.training_of else Path(sys.argv[0]).name
    args = build_parser(prog).parse_args(None if argv is None else list(argv))
    if args.script is not None:
        try:
            training = load_script(args.script)
        except ValueError as e:
            print(f"{prog}: {e}", file=sys.stderr)
            return EXIT_USAGE
    if args.worker_id is None:
        print(
            f"{prog}: no worker id: pass --worker-id, set CHAMELEON_WORKER_ID, or start under "
            "torchrun or SLURM (RANK, SLURM_PROCID)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format=f"%(asctime)s %(levelname)s job={args.job} worker={args.worker_id} %(message)s",
        stream=sys.stderr,
    )
    log = logging.getLogger("chameleon.worker")
    for name, value in (("--worker-id", args.worker_id), ("--job", args.job)):
        if not _valid_id(value):
            log.error("%s %r: expected a printable id without spaces", name, value)
            return EXIT_USAGE
    hook = os.environ.get("CHAMELEON_WORKER_KILL_AT", "")
    if (why := fault_hook_error(hook)) is not None:
        log.error("%s", why)
        return EXIT_USAGE
    if not args.redis_url:
        log.error("no Redis: pass --redis-url or set %s", REDIS_URL_ENV)
        return EXIT_USAGE
    if args.checkpoint_every < 0 or (args.checkpoint_every and args.checkpoint_dir is None):
        log.error("--checkpoint-every must be >= 0 and needs --checkpoint-dir")
        return EXIT_USAGE
    if args.max_steps < 0:
        log.error("--max-steps must be >= 0")
        return EXIT_USAGE
    group_timeout = _timeout(args.group_timeout)
    if group_timeout is None:
        log.error("--group-timeout %s: expected a finite number of seconds > 0", args.group_timeout)
        return EXIT_USAGE
    try:
        keyring = Keyring.configured(os.environ, args.secret_file)
    except AuthError as e:
        log.error("%s", e)
        return EXIT_USAGE
    if keyring is None and not args.insecure:
        log.error(
            "no secret: pass --secret-file, set %s or %s (docs/security.md), or --insecure",
            SECRET_FILE_ENV, SECRET_ENV,
        )  # fmt: skip
        return EXIT_USAGE
    if (why := url_error(args.redis_url)) is not None:
        log.error("--redis-url %s", why)
        return EXIT_USAGE
    try:
        device = parse_device(args.device)
        check_device(device)
    except ValueError as e:
        log.error("%s", e)
        return EXIT_USAGE
    except BackendUnavailable as e:
        log.error("%s", e)
        return EXIT_BACKEND
    if (why := _bind_error(args.bind_address, device)) is not None:
        log.error("%s", why)
        return EXIT_USAGE
    if args.checkpoint_dir is not None and (why := _checkpoint_dir_error(args.checkpoint_dir)):
        log.error("%s", why)
        return EXIT_USAGE
    # One thread per worker: shared hosts stay responsive, and every worker computes a micro-batch
    # with the same kernels, so a rerouted micro-batch gives the same numbers as on its owner.
    torch.set_num_threads(1)

    incarnation = new_incarnation()
    client = redis.Redis.from_url(
        args.redis_url,
        client_name=connection_name(args.job, args.worker_id, incarnation),
        socket_timeout=30,
        health_check_interval=10,
    )
    cfg = WorkerConfig(
        redis_url=args.redis_url,
        job=args.job,
        worker_id=args.worker_id,
        device=device,
        bind_address=args.bind_address,
        incarnation=incarnation,
        group_timeout=group_timeout,
        kill_at=hook,
        max_steps=args.max_steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_mode=args.checkpoint_mode,
        keyring=keyring,
    )
    runtime = WorkerRuntime(cfg, client, training)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        runtime.stopping = True
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        client.ping()
        notifier = Notifier()  # under systemd (Type=notify): ready, and the watchdog pings
        notifier.ready(f"worker {args.worker_id} of job {args.job}: Redis reached")
        notifier.watchdog_thread()
        return runtime.run()
    except _Stop as e:
        log.info("stopped by %s", e)
        return EXIT_OK
    except redis.RedisError as e:
        log.error("redis at %s: %s", redact_url(args.redis_url), e)
        return EXIT_REDIS
    except DeviceFailed as e:
        log.error("leaving: this worker's device failed (%s); it reported itself", e)
        return EXIT_DEVICE
    except (SpecError, TimeoutError) as e:
        log.error("job spec: %s", e)
        return EXIT_SPEC
    except DataError as e:
        log.error("data: %s", e)
        return EXIT_CORPUS
    except ModelError as e:
        log.error("model: %s", e)
        return EXIT_MODEL
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
