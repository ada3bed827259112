"""`chameleon-agent`: the command line of the per-host supervisor (docs/agent.md).

    chameleon-agent --job JOB [--host NAME] [--spec FILE] ... [-- COMMAND ARGS...]

Every flag defaults from the environment a systemd unit, `srun` or a Kubernetes pod gives it. The
agent exits 0 once every worker finished (or on SIGTERM/SIGINT), 1 once every worker has ended and
some could not go on (device failed, failed), and 2 when it cannot supervise this host at all.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
from collections.abc import Sequence

from chameleond.agent.run import AgentConfig, AgentError, run
from chameleond.auth import SECRET_ENV, SECRET_FILE_ENV, AuthError, Keyring
from chameleond.local.cluster import console_script
from chameleond.protocol import JOB_ENV, REDIS_URL_ENV, redact_url, scrub_url, url_error
from chameleond.redisurl import connect

HOST_ENV = "CHAMELEON_HOST"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6380/0"
log = logging.getLogger("chameleon.agent")


def parser() -> argparse.ArgumentParser:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="chameleon-agent",
        description="Start this host's workers of a job and keep them going: restart one that "
        "dies (never its siblings), report its fault first, leave down one whose device failed.",
    )
    p.add_argument("--job", default=env.get(JOB_ENV, ""), help=f"job name (default ${JOB_ENV})")
    p.add_argument(
        "--host",
        default=env.get(HOST_ENV) or socket.gethostname(),
        help=f"this host's name in the spec (default ${HOST_ENV}, else the hostname)",
    )
    p.add_argument(
        "--bind-address",
        default=env.get("CHAMELEON_BIND_ADDRESS", ""),
        help="the workers' address (default $CHAMELEON_BIND_ADDRESS; passed to them)",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=env.get("CHAMELEON_CHECKPOINT_DIR", ""),
        help="the workers' checkpoint directory (default $CHAMELEON_CHECKPOINT_DIR)",
    )
    p.add_argument(
        "--redis-url",
        default=env.get(REDIS_URL_ENV, DEFAULT_REDIS_URL),
        help=f"the job's Redis (default ${REDIS_URL_ENV}, else {DEFAULT_REDIS_URL})",
    )
    p.add_argument(
        "--secret-file",
        default="",
        help=f"the job's secret (default ${SECRET_FILE_ENV}, else ${SECRET_ENV})",
    )
    p.add_argument("--insecure", action="store_true", help="run without a secret")
    p.add_argument(
        "--spec", default="", help="the job's spec file (default: the daemon's, from Redis)"
    )
    p.add_argument(
        "--backoff-max",
        type=float,
        default=60.0,
        help="longest wait before restarting a worker that keeps dying (default 60 s)",
    )
    p.add_argument(
        "--together-seconds",
        type=float,
        default=0.5,
        help="deaths this close, leaving no worker running, are one host fault (default 0.5)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after --: the worker's command line (default chameleon-worker)",
    )
    return p


def config(args: argparse.Namespace) -> AgentConfig:
    """The agent's settings from its arguments; ValueError says what is wrong."""
    if not args.job:
        raise ValueError(f"no job: pass --job or set ${JOB_ENV}")
    for name in ("backoff_max", "together_seconds"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {value}")
    why = url_error(args.redis_url)
    if why is not None:
        raise ValueError(f"bad --redis-url {why}")
    try:
        keyring = Keyring.configured(os.environ, args.secret_file)
    except AuthError as e:
        raise ValueError(str(e)) from None
    if keyring is None and not args.insecure:
        raise ValueError(
            f"no secret: pass --secret-file, set ${SECRET_FILE_ENV} or ${SECRET_ENV} "
            "(docs/security.md), or --insecure"
        )
    command = list(args.command)
    if command[:1] == ["--"]:  # argparse keeps the separator in a remainder
        command = command[1:]
    if not command:
        command = [*console_script("chameleon-worker"), *(["--insecure"] if args.insecure else [])]
    return AgentConfig(
        job=args.job, host=args.host, redis_url=args.redis_url, keyring=keyring,
        command=tuple(command), bind_address=args.bind_address,
        checkpoint_dir=os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else "",
        secret_file=args.secret_file, spec_file=args.spec, backoff_max=args.backoff_max,
        together_seconds=args.together_seconds,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    level = str(args.log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        print(f"chameleon-agent: unknown --log-level {args.log_level!r}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=level, stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s agent host={args.host} %(message)s",
    )  # fmt: skip
    try:
        cfg = config(args)
    except ValueError as e:
        print(f"chameleon-agent: {e}", file=sys.stderr)
        return 2
    client = connect(cfg.redis_url, decode_responses=True, socket_timeout=5)
    log.info("job %s on Redis %s", cfg.job, redact_url(cfg.redis_url))
    try:
        return run(cfg, client)
    except AgentError as e:
        log.error("%s", scrub_url(str(e), cfg.redis_url))
        return 2
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
