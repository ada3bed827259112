"""`chameleon-worker`: one training process on one device, following the job's plans. `run` is
the worker library's entry point: the same flags for any user's training; `main` launches the
built-in one (chameleond.worker._builtin).

Exit codes (docs/worker.md):
  0  finished --max-steps (acked `stopped`), or stopped by SIGTERM/SIGINT
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
  9  fenced by a plan (acked `stopped`): the job went on without this process; a supervisor
     starts it again, and the new process rejoins (systemd's unit, chameleon-agent)
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import cast

import torch

from chameleond import version_text
from chameleond.auth import SECRET_ENV, SECRET_FILE_ENV, AuthError, Keyring
from chameleond.exits import WorkerExit
from chameleond.protocol import REDIS_URL_ENV, url_error
from chameleond.sdnotify import Notifier
from chameleond.usage import Parser
from chameleond.worker import _builtin as builtin
from chameleond.worker._backend import check_device, parse_device
from chameleond.worker._config import (
    WorkerConfig,
    bind_error,
    checkpoint_dir_error,
    timeout_of,
    valid_id,
)
from chameleond.worker._gate import StepGate
from chameleond.worker._hooks import WorkerHooks, fault_hook_error
from chameleond.worker._identity import from_env
from chameleond.worker._library import train_with
from chameleond.worker._saver import MODES, CheckpointMode
from chameleond.worker.api import (
    BackendUnavailable,
    ConfigError,
    DataError,
    DeviceFailed,
    Ending,
    JobSpecError,
    ModelError,
    RedisUnavailable,
    Training,
    TrainingOf,
    WorkerError,
)

EXIT_OK = WorkerExit.OK
EXIT_USAGE = WorkerExit.USAGE
EXIT_REDIS = WorkerExit.REDIS
EXIT_SPEC = WorkerExit.SPEC
EXIT_BACKEND = WorkerExit.BACKEND
EXIT_CORPUS = WorkerExit.DATA
EXIT_DEVICE = WorkerExit.DEVICE
EXIT_MODEL = WorkerExit.MODEL
EXIT_FENCED = WorkerExit.FENCED

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _Stop(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT."""


def build_parser(prog: str = "chameleon-worker") -> argparse.ArgumentParser:
    ident = from_env(os.environ, torch.cuda.is_available())
    p = Parser(
        prog=prog,
        description="Train one slot of a chameleond job: profile, register, follow the plans.",
        epilog="exit codes: 0 finished or stopped by a signal; 2 bad command line; "
        "3 Redis unreachable at start, a write refused, or away too long to keep the events; "
        "4 bad or missing job spec; 5 the device is not there or its backend is unavailable; "
        "6 no training "
        "data, or other data than the job's; 7 this worker's own computation failed (it "
        "reported itself first); 8 a malformed model; 9 fenced by a plan (start it again to "
        "rejoin). "
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
        default=ident.bind_address,
        help="address the collective backend listens on and advertises; default "
        "$CHAMELEON_BIND_ADDRESS, else 127.0.0.1",
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
        help="stop (ack stopped, exit 0) once step N-1 is committed; 0: until fenced (exit 9) "
        "(default)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=ident.checkpoint_dir,
        help="checkpoint directory shared by the job's workers ({worker}-{step}.safetensors), "
        "read at start; default $CHAMELEON_CHECKPOINT_DIR",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="write a checkpoint after every N-th committed step (with --checkpoint-dir; 0: never)",
    )
    p.add_argument(
        "--checkpoint-mode",
        type=CheckpointMode,
        choices=MODES,
        default=CheckpointMode.BUBBLE,
        help="bubble: write the checkpoint piece by piece where the next step waits (its "
        "pipeline bubbles); sync: stop training to write it (default %(default)s)",
    )
    p.add_argument(
        "--checkpoint-keep",
        type=int,
        default=2,
        metavar="N",
        help="keep this worker's N newest checkpoint files, deleting older ones (default 2)",
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


def main(argv: list[str] | None = None) -> int:
    """`chameleon-worker`: the built-in training (chameleond.worker._builtin)."""
    return launch(builtin.training_of, argv)


def launch(training: Training | TrainingOf, argv: Sequence[str] | None = None) -> int:
    """Run `training` as the worker the command line (default sys.argv) and the environment
    name (chameleond.worker._identity); the exit code. The flags are checked here, each error
    naming its flag; the training is `train`'s (chameleond.worker._library), its WorkerErrors
    mapped to exit codes."""
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
        if not valid_id(value):
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
    if args.checkpoint_keep < 1:
        log.error("--checkpoint-keep must be >= 1, got %d", args.checkpoint_keep)
        return EXIT_USAGE
    group_timeout = timeout_of(args.group_timeout)
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
    if (why := bind_error(args.bind_address, device)) is not None:
        log.error("--bind-address %r: %s", args.bind_address, why)
        return EXIT_USAGE
    if args.checkpoint_dir is not None and (why := checkpoint_dir_error(args.checkpoint_dir)):
        log.error("--checkpoint-dir %s: %s", args.checkpoint_dir, why)
        return EXIT_USAGE
    cfg = WorkerConfig(
        redis_url=args.redis_url,
        job=args.job,
        worker_id=args.worker_id,
        device=device,
        bind_address=args.bind_address,
        group_timeout=group_timeout,
        max_steps=args.max_steps,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        checkpoint_mode=args.checkpoint_mode,
        checkpoint_keep=args.checkpoint_keep,
        keyring=keyring,
    )
    gate = StepGate.from_env(args.worker_id)  # `chameleonctl bench worker` only
    hooks = WorkerHooks(kill_at=hook, before_step=None if gate is None else gate.before)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()
        raise _Stop(signal.Signals(signum).name)

    def on_connected() -> None:
        notifier = Notifier()  # under systemd (Type=notify): ready, and the watchdog pings
        notifier.ready(f"worker {args.worker_id} of job {args.job}: Redis reached")
        notifier.watchdog_thread()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        result = train_with(training, cfg, hooks, stop, on_connected)
    except _Stop as e:
        log.info("stopped by %s", e)
        return EXIT_OK
    except WorkerError as e:
        code, form = _exit_of(e)
        log.error(form, e)
        return code
    return EXIT_FENCED if result.ending is Ending.FENCED else EXIT_OK


def _exit_of(error: WorkerError) -> tuple[int, str]:
    """The exit code of `error` and the form of its log line."""
    for kind, exit_form in _EXITS.items():
        if isinstance(error, kind):
            return exit_form
    return EXIT_USAGE, "%s"


# Each kind of WorkerError: its exit code (docs/worker.md), and how it is logged.
_EXITS: dict[type[WorkerError], tuple[int, str]] = {
    ConfigError: (EXIT_USAGE, "%s"),
    RedisUnavailable: (EXIT_REDIS, "%s"),
    JobSpecError: (EXIT_SPEC, "job spec: %s"),
    BackendUnavailable: (EXIT_BACKEND, "%s"),
    DataError: (EXIT_CORPUS, "data: %s"),
    DeviceFailed: (EXIT_DEVICE, "leaving: this worker's device failed (%s); it reported itself"),
    ModelError: (EXIT_MODEL, "model: %s"),
}


if __name__ == "__main__":
    sys.exit(main())
