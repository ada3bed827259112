"""`chameleond run` starts the daemon; `chameleond check` exits 0 when it is healthy, 1 otherwise.

Settings come from the TOML file (--config), CHAMELEON_* environment variables and flags; flags
win. Without --redis-url an embedded redis-server is started (append-only in the state
directory) and its URL and a ready-to-paste redis-cli line are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis
import uvloop

from chameleond import version_text
from chameleond.auth import SECRET_FILE_ENV, AuthError, Keyring, new_secret_file
from chameleond.core.decide import DecisionError, initial_plan
from chameleond.core.spec import JobSpec, SpecError, load_spec
from chameleond.daemon.config import FIELDS, HELP, Config, ConfigError, given, load, validate
from chameleond.protocol import CONSUMER_GROUP, Keys
from chameleond.redis_server import RedisServer, redis_cli_args
from chameleond.redisurl import connect
from chameleond.usage import Parser

log = logging.getLogger("chameleond")


def _add_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML file of settings (or CHAMELEON_CONFIG)")
    defaults = Config()
    for name, f in FIELDS.items():
        default = getattr(defaults, name)
        kind = type(default)
        if kind is bool and default:  # on by default: --no-NAME turns it off
            p.add_argument(
                "--" + name.replace("_", "-"), dest=name, action=argparse.BooleanOptionalAction,
                default=None, help=f"{HELP[name]} (env CHAMELEON_{name.upper()}=0 turns it off)",
            )  # fmt: skip
            continue
        if kind is bool:
            p.add_argument(
                "--" + name.replace("_", "-"), dest=name, action="store_const", const=True,
                default=None, help=f"{HELP[name]} (env CHAMELEON_{name.upper()}=1)",
            )  # fmt: skip
            continue
        shown = f"default {default!r}" if default != "" else "default: see text"
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=kind,
            default=None,
            metavar=f.name.split("_")[-1].upper() if kind is not str else "VALUE",
            help=f"{HELP[name]} ({shown}; env CHAMELEON_{name.upper()})",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="chameleond", description=__doc__)
    parser.add_argument("--version", action="version", version=version_text("chameleond"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run", help="run the daemon", description="Run the daemon in the foreground. " + __doc__
    )
    _add_settings(run)
    check = sub.add_parser(
        "check",
        help="exit 0 if the running daemon is healthy (or, with --config-only, if the settings "
        "and job spec are valid), 1 otherwise",
    )
    _add_settings(check)
    check.add_argument("--config-only", action="store_true", help="only validate the settings")
    return parser


def settings(args: argparse.Namespace) -> tuple[Config, str | None]:
    """The settings, and where the job's name came from (None: nothing named it)."""
    flags = {name: getattr(args, name) for name in FIELDS}
    return load(args.config, os.environ, flags), given("job", args.config, os.environ, flags)


def job_spec(cfg: Config, named_by: str | None = "--job") -> tuple[Config, JobSpec]:
    """The job's spec, and the settings under the job's name. A spec file's `[job].name` names
    the job: with nothing else naming it the job runs under that name, so workers started with
    `--job NAME` find it; a job name given elsewhere (`named_by`: --job, $CHAMELEON_JOB, the
    config file) that differs is refused, since workers started with either name would wait on
    the other's keys. The packaged spec, and a spec naming no job ("default"), take the job's
    name. Raises SpecError or ConfigError."""
    if not cfg.spec:
        from chameleond.jobs import load_default_spec

        packaged: JobSpec = load_default_spec()
        return cfg, packaged
    spec = load_spec(cfg.spec)
    if spec.name in (Config.job, cfg.job):
        return cfg, spec
    if named_by is not None:
        raise ConfigError(
            f"job {cfg.job!r} (from {named_by}) differs from the spec's name {spec.name!r} "
            f"([job] name in {cfg.spec}): workers started with either name would wait for "
            f"the other; drop {named_by}, or give it the spec's name"
        )
    return validate(replace(cfg, job=spec.name)), spec


def _embedded(cfg: Config) -> RedisServer:
    """The embedded redis-server; an orphan of a previous run on the same state dir is adopted."""
    data = (cfg.state_path / "redis").resolve()
    # Its own session: a Ctrl-C reaches the daemon alone, which drains, then stops the server. A
    # daemon killed outright leaves it serving; the next start on the state dir adopts it.
    server = RedisServer(data, host="127.0.0.1", port=cfg.embedded_redis_port, own_session=True)
    probe = redis.Redis(host="127.0.0.1", port=cfg.embedded_redis_port, socket_timeout=1.0)
    try:
        found = probe.config_get("dir").get("dir")
        if found and Path(found).resolve() == data:
            log.info("reusing the embedded redis-server already serving %s", data)
            return server  # not started by us: stop() leaves it alone
        raise SystemExit(
            f"port {cfg.embedded_redis_port} is taken by a Redis serving {found}; "
            "pass --redis-url or --embedded-redis-port"
        )
    except redis.ConnectionError:
        pass
    finally:
        probe.close()
    return server.start()


def keyring(cfg: Config) -> tuple[Keyring | None, Path | None]:
    """The job's secret: --secret-file, $CHAMELEON_SECRET_FILE or $CHAMELEON_SECRET. Without any,
    an embedded Redis (nobody else can reach it without its port, and the job is local) gets a
    fresh secret in the state directory, kept across restarts; an external Redis is refused
    unless --insecure says that anybody who can write to it may steer the job (docs/security.md).
    Returns the keyring and the secret file it made, if it made one; raises AuthError with a
    one-line reason."""
    found = Keyring.configured(os.environ, cfg.secret_file)
    if found is not None or cfg.insecure:
        return found, None
    if cfg.redis_url:
        raise AuthError(
            f"no secret for an external Redis: set --secret-file, ${SECRET_FILE_ENV} or "
            "$CHAMELEON_SECRET (docs/security.md), or pass --insecure to run without signatures"
        )
    path = new_secret_file(cfg.state_path / "secret").resolve()
    return Keyring.from_file(path), path


def run(cfg: Config, named_by: str | None = "--job") -> int:
    logging.basicConfig(
        level=cfg.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        cfg, spec = job_spec(cfg, named_by)
    except SpecError as e:
        print(f"chameleond: job spec: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"chameleond: {e}", file=sys.stderr)
        return 2
    try:
        ring, generated = keyring(cfg)
    except (AuthError, OSError) as e:
        print(f"chameleond: {e}", file=sys.stderr)
        return 2
    if ring is None:
        log.warning(
            "INSECURE: running without a secret; anybody who can write to Redis can publish "
            "plans the workers obey and send events the daemon acts on (docs/security.md)"
        )
    server = None
    url = cfg.redis_url
    if not url:
        try:
            server = _embedded(cfg)
        except (RuntimeError, TimeoutError, OSError) as e:
            hint = "; or pass --redis-url" if isinstance(e, FileNotFoundError) else ""
            print(f"chameleond: embedded Redis: {e}{hint}", file=sys.stderr)
            return 1
        url = server.url
        print(f"chameleond: embedded Redis at {url} (data in {server.data_dir})", flush=True)
        # With the job's secret, the line carries that event's signature (docs/security.md).
        line = shlex.join(redis_cli_args(url, cfg.job, "w3", "ECC error", ring))
        print(f"chameleond: send a fault with:\n  {line}", flush=True)
    if generated:
        print(
            f"chameleond: the job's secret is in {generated}; start its workers with "
            f"{SECRET_FILE_ENV}={generated}",
            flush=True,
        )
    if named_by is not None:
        how = f"from {named_by}"
    else:
        how = "from the spec's [job] name" if cfg.job != Config.job else "the default name"
    print(f"chameleond: job {cfg.job} ({how}): start its workers with --job {cfg.job}", flush=True)
    from chameleond.daemon.service import Service

    async def main() -> int:
        service = Service(cfg, spec, url, keyring=ring)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.shutdown)
        return await service.run()

    try:
        return uvloop.run(main())
    finally:
        if server is not None:
            server.stop()


def check(cfg: Config, config_only: bool, named_by: str | None = "--job") -> tuple[bool, str]:
    try:
        cfg, spec = job_spec(cfg, named_by)
    except SpecError as e:
        return False, f"job spec: {e}"
    except ConfigError as e:
        return False, str(e)
    if config_only:
        # A spec can be well-formed and still describe a layout that cannot be built (a worker
        # too small for its stage): the daemon would only find out at its first plan.
        try:
            initial_plan(spec)
        except DecisionError as e:
            return False, f"job spec: initial layout: {e}"
        return True, f"settings and job spec valid ({len(spec.workers)} workers)"
    try:
        with urllib.request.urlopen(f"http://{cfg.http}/readyz", timeout=3) as r:
            body: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return False, f"not ready: HTTP {e.code} {e.read().decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return False, f"no daemon answering on http://{cfg.http}: {e}"
    served = body.get("job")
    if served is not None and served != cfg.job:
        return False, (
            f"the daemon on http://{cfg.http} runs job {served!r}, not {cfg.job!r}: give check "
            "the same --spec (or --job) as the daemon"
        )
    url = cfg.redis_url or f"redis://127.0.0.1:{cfg.embedded_redis_port}/0"
    try:
        client = connect(url, socket_timeout=3, socket_connect_timeout=3)
        groups = client.xinfo_groups(Keys(cfg.job).events)
        client.close()
    except redis.RedisError as e:
        return False, f"Redis: {e}"
    if not any(g["name"] in (CONSUMER_GROUP, CONSUMER_GROUP.encode()) for g in groups):
        return False, f"consumer group {CONSUMER_GROUP!r} missing on {Keys(cfg.job).events}"
    return True, f"ready: job {cfg.job} {body.get('state')}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg, named_by = settings(args)
    except ConfigError as e:
        print(f"chameleond: {e}", file=sys.stderr)
        return 1 if args.command == "check" else 2
    if args.command == "check":
        ok, why = check(cfg, args.config_only, named_by)
        print(f"chameleond check: {why}")
        return 0 if ok else 1
    return run(cfg, named_by)


if __name__ == "__main__":
    sys.exit(main())
