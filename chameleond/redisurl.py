"""Redis URLs, and the one way every process of a job turns one into a client (sync and asyncio).

A plain Redis is `redis://`, `rediss://` (TLS) or `unix://`, as redis-py reads them. A Redis
watched by Sentinel, which fails over to a replica when its master dies, is

    redis+sentinel://[user:password@]host1:port1[,host2:port2...]/SERVICE[/DB][?query]

the sentinels' addresses, the name they monitor the master under (`SERVICE`, `sentinel monitor
SERVICE ...` in their configuration) and the database number (default 0). The client asks the
sentinels for the master's address at every new connection, so after a failover it reconnects to
the promoted replica by itself (a command that finds the old master gone, or demoted to a read-only
replica, fails with a ConnectionError and is retried).

Credentials: `user:password@` and the query's `password=` / `username=` are those of the master
(and replicas), the job's ACL user. Sentinels usually take none; when they require them, give
`sentinel_password=` (and `sentinel_username=`). `rediss+sentinel://` speaks TLS to the sentinels
and to the master alike, with the query's `ssl_*` options (for example `ssl_ca_certs=PATH`). Every
other query option is a redis-py connection option (`socket_timeout=`, ...) for the master's
connections, overridden by what the calling process sets itself.

Replication is asynchronous: what the master acknowledged may not have reached a replica when it
dies. `xadd_replicated` makes an event that must survive a failover (a fault) wait for one
replica (WAIT), on a Sentinel client only (docs/redis.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

import redis
import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.retry import Retry

PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SCHEMES = (*PLAIN_SCHEMES, *SENTINEL_SCHEMES)
SENTINEL_PORT = 26379  # a sentinel's port when the URL names only its host
# Query options that are not connection options of the master: the sentinels' own credentials.
SENTINEL_AUTH = ("sentinel_username", "sentinel_password")
# How long a write that must survive a failover waits for one replica (WAIT's timeout).
REPLICATE_TIMEOUT_MS = 1000


@dataclass(frozen=True)
class SentinelTarget:
    """A `redis+sentinel://` URL, read: where the sentinels are and what they watch."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    # The remaining query options, typed as redis-py types them (socket_timeout=1.5 -> 1.5).
    options: Mapping[str, Any] = field(default_factory=dict)

    def master_kwargs(self) -> dict[str, Any]:
        """Connection options of the master's connections (and the replicas')."""
        out: dict[str, Any] = {**self.options, "db": self.db}
        if self.username is not None:
            out["username"] = self.username
        if self.password is not None:
            out["password"] = self.password
        if self.tls:
            out["ssl"] = True
        return out

    def sentinel_kwargs(self, socket: Mapping[str, Any]) -> dict[str, Any]:
        """Connection options of the connections to the sentinels: the caller's socket options,
        the sentinels' own credentials, and TLS with the URL's ssl_* options."""
        out: dict[str, Any] = dict(socket)
        if self.sentinel_username is not None:
            out["username"] = self.sentinel_username
        if self.sentinel_password is not None:
            out["password"] = self.sentinel_password
        if self.tls:
            out["ssl"] = True
            out.update({k: v for k, v in self.options.items() if k.startswith("ssl_")})
        return out


def scheme(url: str) -> str:
    """The URL's scheme, lower case ("" when it has none)."""
    head, sep, _ = url.partition("://")
    return head.lower() if sep else ""


def is_sentinel_url(url: str) -> bool:
    return scheme(url) in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """Read a `redis+sentinel://` / `rediss+sentinel://` URL. Raises ValueError saying what is
    wrong (never quoting the URL: it may carry a password)."""
    kind = scheme(url)
    if kind not in SENTINEL_SCHEMES:
        raise ValueError(f"not a Sentinel URL (expected {' or '.join(SENTINEL_SCHEMES)}://)")
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    path = path.partition("#")[0]
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    sentinels = tuple(_address(h) for h in hosts.split(","))
    parts = [unquote(p) for p in path.split("/") if p]
    if not parts:
        raise ValueError("no service name: the path must be /SERVICE or /SERVICE/DB")
    if len(parts) > 2:
        raise ValueError("the path must be /SERVICE or /SERVICE/DB")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"database {parts[1]!r} is not a number")
        db = int(parts[1])
    options: dict[str, Any] = {}
    auth: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=False):
        if key in SENTINEL_AUTH:
            auth[key] = value
        elif key == "password":
            password = value
        elif key == "username":
            username = value
        elif key == "db":
            if not value.isdigit():
                raise ValueError(f"database {value!r} is not a number")
            db = int(value)
        else:
            options[key] = _option(key, value)
    return SentinelTarget(
        sentinels=sentinels, service=parts[0], db=db, username=username, password=password,
        tls=kind == "rediss+sentinel", sentinel_username=auth.get("sentinel_username"),
        sentinel_password=auth.get("sentinel_password"), options=options,
    )  # fmt: skip


def _address(text: str) -> tuple[str, int]:
    text = text.strip()
    if not text:
        raise ValueError("an empty sentinel address (host:port[,host:port...])")
    if text.startswith("["):  # [IPv6]:port
        host, _, after = text[1:].partition("]")
        port = after[1:] if after.startswith(":") else ""
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise ValueError(f"sentinel address {text!r} has no host")
    if not port:
        return host, SENTINEL_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"sentinel address {text!r}: port {port!r} is not a port number")
    return host, int(port)


def _option(key: str, value: str) -> Any:
    parse: Any = URL_QUERY_ARGUMENT_PARSERS.get(key)
    if parse is None:
        return value
    try:
        return parse(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid value for {key!r}") from None


def url_problem(url: str) -> str | None:
    """Why the URL cannot be used (one line, never quoting it), or None."""
    if scheme(url) not in SCHEMES:
        return f"must start with {', '.join(s + '://' for s in SCHEMES)}"
    try:
        if is_sentinel_url(url):
            parse_sentinel_url(url)
        else:
            from redis.connection import parse_url

            parse_url(url)
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def _split(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The caller's options for the master, and those of them the sentinels take too."""
    master = dict(kwargs)
    # A client made by master_for has no retry of its own (from_url's has): give it redis-py's
    # default, so a command that finds the master gone asks the sentinels again and retries.
    master.setdefault("retry", Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 5))
    socket = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
    return master, socket


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A client for `url`: redis-py's `from_url` for a plain Redis, the master of a Sentinel
    service for a Sentinel URL. `kwargs` are redis-py client options (socket_timeout,
    decode_responses, client_name, ...), applied to the master's connections."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **kwargs)
    from redis.sentinel import Sentinel

    return _master(Sentinel, url, kwargs)


def connect_async(url: str, **kwargs: Any) -> aioredis.Redis:
    """`connect` for asyncio: a `redis.asyncio.Redis`."""
    if not is_sentinel_url(url):
        return aioredis.Redis.from_url(url, **kwargs)
    from redis.asyncio.sentinel import Sentinel

    return _master(Sentinel, url, kwargs)


def _master(sentinel_class: Any, url: str, kwargs: dict[str, Any]) -> Any:
    """The client of the Sentinel service's master, from redis-py's `sentinel_class` (its sync
    or its asyncio Sentinel)."""
    target = parse_sentinel_url(url)
    master, socket = _split(kwargs)
    sentinel = sentinel_class(
        list(target.sentinels),
        sentinel_kwargs=target.sentinel_kwargs(socket),
        **target.master_kwargs(),
    )
    return sentinel.master_for(target.service, **master)


def fails_over(client: redis.Redis | aioredis.Redis) -> bool:
    """Whether `client` is a Sentinel-managed master's (its writes can be lost in a failover)."""
    from redis.asyncio.sentinel import SentinelConnectionPool as AsyncPool
    from redis.sentinel import SentinelConnectionPool

    return isinstance(client.connection_pool, (SentinelConnectionPool, AsyncPool))


def xadd_replicated(
    client: redis.Redis,
    stream: str,
    entries: Sequence[Mapping[str, str]],
    timeout_ms: int = REPLICATE_TIMEOUT_MS,
) -> tuple[list[str], int | None]:
    """XADD `entries` to `stream`, all at once (one script: a reader sees all or none of them);
    on a Sentinel client, then WAIT on the same connection until one replica holds them, so that
    a failover cannot lose them. Their ids, and how many replicas hold them (0: none within
    `timeout_ms`; None: a plain Redis, nothing waited for)."""
    args: list[str] = []
    for fields in entries:
        args += [str(2 * len(fields)), *(x for kv in fields.items() for x in kv)]
    waits = fails_over(client)
    with client.pipeline(transaction=False) as p:
        p.eval(_XADD_ALL_LUA, 1, stream, *args)
        if waits:
            p.wait(1, timeout_ms)
        replies = p.execute()
    ids = [_text(i) for i in replies[0]]
    return ids, int(replies[1]) if waits else None


_XADD_ALL_LUA = """
local ids, i = {}, 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return ids
"""


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
