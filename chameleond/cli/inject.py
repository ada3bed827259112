"""Report a fault for a worker, as an operator would. It sends exactly the event of

    redis-cli -u URL XADD chameleon:JOB:events '*' type fault worker W cause "TEXT" sig SIG

signed with the job's secret (--secret-file, $CHAMELEON_SECRET_FILE or $CHAMELEON_SECRET; without
one the event goes unsigned, and a daemon with a secret refuses it), and prints the stream entry
id; the daemon then decides how training continues. The worker process itself is not touched: if
it is still alive, the daemon fences it (excluded from the plan).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any, cast

import redis

from chameleond.auth import SECRET_FILE_ENV, AuthError, Keyring
from chameleond.events import Fault
from chameleond.protocol import (
    JOB_ENV,
    MAX_ID_LEN,
    MAX_TEXT_LEN,
    REDIS_URL_ENV,
    Keys,
    redact_url,
    scrub_url,
    url_error,
)
from chameleond.redis_server import redis_cli_args

DEFAULT_REDIS_URL = "redis://127.0.0.1:6380/0"


def add_redis_url(parser: argparse.ArgumentParser) -> None:
    """--redis-url, defaulting to $CHAMELEON_REDIS_URL (which keeps a password out of `ps`)."""
    parser.add_argument(
        "--redis-url",
        default=os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL),
        help=f"default: ${REDIS_URL_ENV}, else {DEFAULT_REDIS_URL}",
    )


def add_job(parser: argparse.ArgumentParser) -> None:
    """--job, defaulting to $CHAMELEON_JOB as the workers' does, else "default"."""
    parser.add_argument(
        "--job",
        default=os.environ.get(JOB_ENV, "default"),
        help=f"job name (default: ${JOB_ENV}, else default)",
    )


def redis_client(url: str, command: str, *, decode: bool = True) -> redis.Redis | None:
    """A client for --redis-url (not connected yet), or None once the reason the URL cannot be
    used is printed. The URL itself is not echoed: it may hold a password. `decode=False` reads
    bytes (stream entries that anyone may have written, in any encoding)."""
    why = url_error(url)
    if why is None:
        try:
            return redis.Redis.from_url(url, decode_responses=decode, socket_timeout=5)
        except (ValueError, TypeError) as e:  # what parse_url let through
            why = scrub_url(str(e), url)
    print(f"chameleonctl {command}: bad --redis-url {why}", file=sys.stderr)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", required=True, help="the failed worker's id, e.g. w3")
    parser.add_argument("--cause", default="operator", help="why (free text; default: operator)")
    add_redis_url(parser)
    add_job(parser)
    parser.add_argument(
        "--print-only", action="store_true", help="print the equivalent redis-cli line and exit"
    )
    parser.add_argument(
        "--secret-file",
        default="",
        help=f"the job's secret, to sign the event (default ${SECRET_FILE_ENV}, else "
        "$CHAMELEON_SECRET; docs/security.md)",
    )


def run(args: argparse.Namespace) -> int:
    worker = str(args.worker)
    if not worker or len(worker) > MAX_ID_LEN or any(c.isspace() for c in worker):
        print(f"chameleonctl inject: bad worker id {worker!r}", file=sys.stderr)
        return 2

    if len(args.cause) > MAX_TEXT_LEN:
        print(f"chameleonctl inject: --cause is longer than {MAX_TEXT_LEN}", file=sys.stderr)
        return 2
    try:
        keyring = Keyring.configured(os.environ, args.secret_file)
    except AuthError as e:
        print(f"chameleonctl inject: {e}", file=sys.stderr)
        return 2
    if keyring is None:
        print(
            "chameleonctl inject: warning: no secret, the event goes unsigned (a daemon with a "
            "secret refuses it)",
            file=sys.stderr,
        )
    event = Fault(worker, args.cause).to_fields()
    if keyring is not None:
        event = keyring.sign_event(args.job, event)

    def line(url: str) -> str:
        argv = redis_cli_args(url, args.job, worker, args.cause, keyring)
        return shlex.join(["redis-cli", *argv[1:]])

    client = redis_client(args.redis_url, "inject")
    if client is None:
        return 2
    if args.print_only:
        client.close()
        print(line(args.redis_url))  # asked for: the line to run, credentials included
        return 0
    try:
        entry: str = cast(Any, client).xadd(Keys(args.job).events, event)
    except redis.RedisError as e:
        where = redact_url(args.redis_url)
        print(f"chameleonctl inject: cannot reach Redis at {where}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"fault for {worker} sent as {Keys(args.job).events} entry {entry!s}")
    print(f"(the same as: {line(redact_url(args.redis_url))})")
    return 0
