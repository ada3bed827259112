"""Report a fault for a worker, as an operator would, or run a worker slowed down.

`chameleonctl inject --worker W` (kind `fault`, the default) sends exactly the event of

    redis-cli -u URL XADD chameleon:JOB:events '*' type fault worker W cause "TEXT" sig SIG

signed with the job's secret (--secret-file, $CHAMELEON_SECRET_FILE or $CHAMELEON_SECRET; without
one the event goes unsigned, and a daemon with a secret refuses it), and prints the stream entry
id; the daemon then decides how training continues. The worker process itself is not touched: if
it is still alive, the daemon fences it (excluded from the plan).

`chameleonctl inject slow --worker W --factor F [--seconds S]` writes a signed request into the
job's hash chameleon:JOB:slow: the worker's chameleon-agent runs its process at F of its speed
(a fail-slow fault: alive, but slow) until `--clear` (or `--factor 1`) deletes it or S seconds
pass (docs/agent.md, Slowed workers).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import redis

from chameleond.auth import SECRET_FILE_ENV, AuthError, Keyring, signed_json
from chameleond.events import Fault
from chameleond.local.slowdown import SLOW_KIND, SlowRequest, check_factor
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
from chameleond.redisurl import connect, xadd_replicated

T = TypeVar("T")
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
            return connect(url, decode_responses=decode, socket_timeout=5)
        except (ValueError, TypeError) as e:  # what parse_url let through
            why = scrub_url(str(e), url)
    print(f"chameleonctl {command}: bad --redis-url {why}", file=sys.stderr)
    return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "kind",
        nargs="?",
        choices=("fault", "slow"),
        default="fault",
        help="fault (the default): report the worker failed; slow: run it slowed down",
    )
    parser.add_argument("--worker", required=True, help="the worker's id, e.g. w3")
    parser.add_argument("--cause", help="fault: why (free text; default: operator)")
    parser.add_argument(
        "--factor", type=float, help="slow: the fraction of full speed, 0.01 to 1 (1: full speed)"
    )
    parser.add_argument(
        "--seconds", type=float, help="slow: for this long (default: until --clear)"
    )
    parser.add_argument("--clear", action="store_true", help="slow: back to full speed")
    add_redis_url(parser)
    add_job(parser)
    parser.add_argument(
        "--print-only",
        action="store_true",
        help="fault: print the equivalent redis-cli line and exit",
    )
    parser.add_argument(
        "--secret-file",
        default="",
        help=f"the job's secret, to sign the event or request (default ${SECRET_FILE_ENV}, else "
        "$CHAMELEON_SECRET; docs/security.md)",
    )


def _keyring(args: argparse.Namespace, unsigned: str) -> tuple[Keyring | None, bool]:
    """The job's keyring (None: none configured, with a warning that says what goes unsigned),
    and whether it could be read at all."""
    try:
        keyring = Keyring.configured(os.environ, args.secret_file)
    except AuthError as e:
        print(f"chameleonctl inject: {e}", file=sys.stderr)
        return None, False
    if keyring is None:
        print(f"chameleonctl inject: warning: no secret, {unsigned}", file=sys.stderr)
    return keyring, True


def run(args: argparse.Namespace) -> int:
    worker = str(args.worker)
    if not worker or len(worker) > MAX_ID_LEN or any(c.isspace() for c in worker):
        print(f"chameleonctl inject: bad worker id {worker!r}", file=sys.stderr)
        return 2
    wrong = _misplaced(args)
    if wrong:
        print(f"chameleonctl inject: {wrong}", file=sys.stderr)
        return 2
    return run_slow(args, worker) if args.kind == "slow" else run_fault(args, worker)


def _misplaced(args: argparse.Namespace) -> str | None:
    """Why flags of the other kind are on this command line, or None."""
    if args.kind == "fault":
        given = [f for f in ("factor", "seconds") if getattr(args, f) is not None]
        given += ["clear"] if args.clear else []
        if given:
            flags = ", ".join(f"--{f}" for f in given)
            return f"{flags}: for a slowed worker, `chameleonctl inject slow`"
        return None
    given = [
        f for f, v in (("cause", args.cause is not None), ("print-only", args.print_only)) if v
    ]
    if given:
        return f"{', '.join('--' + f for f in given)}: for a fault, not `inject slow`"
    if args.clear == (args.factor is not None):
        return "inject slow takes --factor F or --clear"
    return None


def run_fault(args: argparse.Namespace, worker: str) -> int:
    cause = "operator" if args.cause is None else str(args.cause)
    if len(cause) > MAX_TEXT_LEN:
        print(f"chameleonctl inject: --cause is longer than {MAX_TEXT_LEN}", file=sys.stderr)
        return 2
    keyring, ok = _keyring(args, "the event goes unsigned (a daemon with a secret refuses it)")
    if not ok:
        return 2
    event = Fault(worker, cause).to_fields()
    if keyring is not None:
        event = keyring.sign_event(args.job, event)

    def line(url: str) -> str:
        argv = redis_cli_args(url, args.job, worker, cause, keyring)
        return shlex.join(["redis-cli", *argv[1:]])

    if args.print_only:
        client = redis_client(args.redis_url, "inject")  # the URL checked
        if client is None:
            return 2
        client.close()
        print(line(args.redis_url))  # asked for: the line to run, credentials included
        return 0
    rc, ids = _send(args, lambda c: xadd_replicated(c, Keys(args.job).events, [event])[0])
    if rc or not ids:
        return rc or 1
    print(f"fault for {worker} sent as {Keys(args.job).events} entry {ids[0]!s}")
    print(f"(the same as: {line(redact_url(args.redis_url))})")
    return 0


def _send(args: argparse.Namespace, write: Callable[[redis.Redis], T]) -> tuple[int, T | None]:
    """`write` on a client of --redis-url: (0, what it returned); (2, None) for a URL that is not
    one, (1, None) when Redis cannot be reached (said on stderr)."""
    client = redis_client(args.redis_url, "inject")
    if client is None:
        return 2, None
    try:
        return 0, write(client)
    except redis.RedisError as e:
        where = redact_url(args.redis_url)
        print(f"chameleonctl inject: cannot reach Redis at {where}: {e}", file=sys.stderr)
        return 1, None
    finally:
        client.close()


def run_slow(args: argparse.Namespace, worker: str) -> int:
    """Write (or, with --clear or --factor 1, delete) the worker's field of the job's slow hash."""
    factor = 1.0 if args.clear else float(args.factor)
    try:
        check_factor(factor)
    except ValueError as e:
        print(f"chameleonctl inject slow: --{e}", file=sys.stderr)
        return 2
    seconds = args.seconds
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        print(f"chameleonctl inject slow: --seconds must be > 0, got {seconds}", file=sys.stderr)
        return 2
    keyring = None  # a deletion needs no signature
    if factor < 1.0:
        keyring, ok = _keyring(
            args, "the request goes unsigned (an agent with a secret refuses it)"
        )
        if not ok:
            return 2
    until = None if seconds is None else round(time.time() + seconds, 3)
    request = SlowRequest(worker, factor, until)
    key = Keys(args.job).slow

    def write(client: redis.Redis) -> int:
        if factor == 1.0:
            return int(cast(Any, client.hdel(key, worker)))
        doc = signed_json(keyring, SLOW_KIND, args.job, request.document())
        return int(cast(Any, client.hset(key, worker, doc)))

    rc, had = _send(args, write)
    if rc:
        return rc
    if factor == 1.0:
        was = "deleted" if had else "was not set"
        print(f"{worker} back to full speed ({key} field {worker} {was})")
        return 0
    ends = "until cleared"
    if until is not None:
        local = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(until))
        ends = f"until {local} (unix {until:.0f})"
    print(f"{worker} slowed to {factor:g} of its speed {ends}: {key} field {worker}")
    print("(its chameleon-agent applies it within a second)")
    return 0
