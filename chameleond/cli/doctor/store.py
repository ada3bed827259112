"""With a Redis URL: that it answers, its version, and that the ACL lets the job's daemon and
workers run what they run on the job's keys. With a secret: that it loads, and that the job's
spec in Redis carries its signature."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import time
from collections.abc import Callable
from functools import partial

import redis

from chameleond.auth import SECRET_ENV, SECRET_FILE_ENV, AuthError, Keyring
from chameleond.cli.doctor.check import Check, first_line, timed
from chameleond.cli.doctor.versions import release
from chameleond.protocol import REDIS_URL_ENV, Keys, redact_url, scrub_url, url_error
from chameleond.redisurl import connect


def store_checks(args: argparse.Namespace) -> list[Check]:
    """The Redis checks (with a URL), then the secret's (against the job's spec in Redis, if
    reached)."""
    out, reached = [], None
    if not args.redis_url:
        out.append(Check("redis", "skip", f"no --redis-url or ${REDIS_URL_ENV}"))
    elif (why := url_error(args.redis_url)) is not None:
        out.append(Check("redis", "fail", f"--redis-url {why}"))
    else:
        client = connect(args.redis_url, socket_timeout=5, socket_connect_timeout=5)
        out.append(timed("redis", partial(_reach, client, args.redis_url)))
        if out[-1].verdict == "fail":
            client.close()
        else:
            out.append(timed("redis ACL", partial(_rights, client, Keys(args.job))))
            reached = client
    out.append(timed("secret", partial(_secret, args, reached)))
    if reached is not None:
        reached.close()
    return out


def _reach(client: redis.Redis, url: str, check: Check) -> None:
    times = []
    try:
        for _ in range(5):
            t0 = time.perf_counter()
            client.ping()
            times.append(time.perf_counter() - t0)
        version = _version(client)
    except redis.RedisError as e:
        check.verdict = "fail"
        check.detail = f"{redact_url(url)}: {scrub_url(first_line(str(e)), url)}"
        return
    ping = statistics.median(times)
    check.figures.update(version=version, ping_seconds=round(ping, 6))
    check.detail = f"{redact_url(url)}: Redis {version}, ping {ping * 1e3:.2f} ms"
    if version != "?" and release(version) < (6, 2):
        check.verdict = "fail"
        check.detail += "; chameleond needs Redis 6.2 or later (XAUTOCLAIM)"


def _version(client: redis.Redis) -> str:
    """The server's version: INFO, else HELLO (a job's ACL user may not run INFO, @dangerous)."""
    try:
        return str(client.info("server").get("redis_version", "?"))
    except redis.ResponseError:
        pass
    try:
        reply = client.execute_command("HELLO")
    except redis.ResponseError:
        return "?"
    if isinstance(reply, dict):  # redis-py's reply
        pairs = reply
    elif isinstance(reply, list):  # the server's flat one
        pairs = dict(zip(reply[::2], reply[1::2], strict=False))
    else:
        pairs = {}
    found = pairs.get(b"version", pairs.get("version", "?"))
    return found.decode() if isinstance(found, bytes) else str(found)


def _rights(client: redis.Redis, keys: Keys, check: Check) -> None:
    """Run, on scratch keys under the job's prefix, each kind of command the daemon and the
    workers run; name what the ACL denies (CLIENT LIST, which only the daemon runs, is a
    warning)."""
    scratch = f"{keys.prefix}doctor:{secrets.token_hex(4)}:"
    stream, key, table = scratch + "events", scratch + "key", scratch + "state"

    def stream_ops() -> None:
        client.xadd(stream, {"type": "doctor"})
        client.xgroup_create(stream, "doctor", id="0")
        client.xreadgroup("doctor", "doctor", {stream: ">"}, count=1)
        client.xautoclaim(stream, "doctor", "doctor", min_idle_time=0)
        client.xack(stream, "doctor", "0-1")
        client.xtrim(stream, maxlen=10, approximate=True)

    def pubsub_ops() -> None:
        sub = client.pubsub()
        try:
            sub.subscribe(scratch + "plans")
            sub.get_message(timeout=1.0)
        finally:
            sub.close()
        client.publish(scratch + "plans", "doctor")

    def transaction() -> None:
        with client.pipeline(transaction=True) as pipe:
            pipe.watch(key)
            pipe.multi()
            pipe.set(key, "1")
            pipe.execute()

    ops: list[tuple[str, Callable[[], object]]] = [
        ("SET/GET/EXPIRE", lambda: (client.set(key, "1", ex=60), client.get(key))),
        ("HSET/HGETALL", lambda: (client.hset(table, "k", "v"), client.hgetall(table))),
        ("streams (XADD, XREADGROUP, XAUTOCLAIM, XACK, XTRIM)", stream_ops),
        ("EVAL (the daemon's commits and lease, the workers' rendezvous)",
         lambda: client.eval("return redis.call('SET', KEYS[1], ARGV[1])", 1, key, "1")),
        ("WATCH/MULTI", transaction),
        ("SUBSCRIBE/PUBLISH", pubsub_ops),
        ("CLIENT SETNAME (workers name their connections)",
         lambda: client.client_setname("chameleon-doctor")),
    ]  # fmt: skip
    denied = []
    try:
        for what, op in ops:
            try:
                op()
            except redis.ResponseError as e:
                denied.append(f"{what}: {first_line(str(e))}")
    finally:
        with contextlib.suppress(redis.RedisError):
            client.delete(stream, key, table)
    check.figures["commands_checked"] = len(ops) + 1
    if denied:
        check.verdict = "fail"
        check.detail = (
            f"job {keys.job}: denied {'; '.join(denied)}. The job's user needs: ACL SETUSER "
            f"USER on >PASSWORD {' '.join(keys.acl_rules())} (docs/daemon.md)"
        )
        return
    check.detail = (
        f"job {keys.job}: the {len(ops)} kinds of command the workers and tools run are allowed"
    )
    try:
        client.client_list(_type="normal")
    except redis.ResponseError as e:
        check.verdict = "warn"
        check.detail += (
            f"; CLIENT LIST is denied ({first_line(str(e))}): a daemon under this user finds "
            "dead workers by the heartbeat timeout only, not by their connections closing. "
            "The daemon's user: ACL SETUSER USER on >PASSWORD "
            f"{' '.join(keys.acl_rules(daemon=True))} (docs/daemon.md)"
        )


def _secret(args: argparse.Namespace, client: redis.Redis | None, check: Check) -> None:
    try:
        ring = Keyring.configured(os.environ, args.secret_file)
    except AuthError as e:
        check.verdict, check.detail = "fail", str(e)
        return
    if ring is None:
        check.verdict = "skip"
        check.detail = f"no --secret-file, ${SECRET_FILE_ENV} or ${SECRET_ENV}"
        return
    source = args.secret_file or os.environ.get(SECRET_FILE_ENV) or f"${SECRET_ENV}"
    check.detail = f"from {source}: key {', '.join(ring.ids)}"
    raw = client.get(Keys(args.job).spec) if client is not None else None
    if raw is None:
        check.detail += f" (no spec of job {args.job} in Redis to verify it against)"
        return
    try:
        doc = json.loads(raw)
        ring.verify_doc("spec", args.job, doc if isinstance(doc, dict) else {})
    except (AuthError, ValueError) as e:
        check.verdict = "fail"
        check.detail += (
            f"; the spec of job {args.job} in Redis does not verify with it ({e}): its workers "
            "would refuse it"
        )
        return
    check.detail += f"; the spec of job {args.job} in Redis carries its signature"
