"""The daemon's configuration: defaults < TOML file < CHAMELEON_* environment variables < flags.

Every setting is one field of `Config`, one top-level key of the TOML file (same name), one
environment variable (`CHAMELEON_` + the name in capitals) and one flag (`--` + the name with
dashes). `chameleond run --help` lists them all from `FIELDS`, so they cannot drift apart.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from chameleond.core.policy import Selection
from chameleond.protocol import url_error

POLICIES = tuple(s.value for s in Selection)


class ConfigError(ValueError):
    """A setting is invalid; the message names it and where it came from."""


@dataclass(frozen=True)
class Config:
    job: str = "default"
    redis_url: str = ""  # empty: start an embedded redis-server
    embedded_redis_port: int = 6380
    state_dir: str = ""  # empty: $STATE_DIRECTORY (systemd) or ./state
    http: str = "127.0.0.1:9464"
    spec: str = ""  # empty: the packaged default job (chameleond/jobs/cpu-small.toml)
    policy: str = Selection.ADAPTIVE.value  # a Selection; validate() checks it
    min_workers: int = 0  # 0: every worker of the spec must register before the initial plan
    heartbeat_timeout_seconds: float = 3.0
    peer_watch_seconds: float = 0.1  # one CLIENT LIST per this long finds dead workers; 0: off
    ready_timeout_seconds: float = 30.0
    registration_ttl_seconds: float = 60.0  # a register from outside the spec awaits its profile
    block_ms: int = 1000
    socket_timeout_seconds: float = 5.0
    batch_count: int = 512
    max_deliveries: int = 5
    claim_idle_seconds: float = 30.0
    stream_maxlen: int = 100_000
    persist_interval_seconds: float = 1.0
    lease_seconds: float = 10.0  # the leader lease lapses this long after its last renewal
    consumer: str = ""  # empty: the host name (stable, so a restart re-reads its own pending)
    decision_delay_seconds: float = 0.0  # fault injection: hold each decision before committing
    # Fail-slow (docs/daemon.md, "Slow workers"): decide on a worker that became slow or
    # recovered (off: detected and measured only), and an episode's duration before any ended.
    slow_mitigation: bool = False
    slow_episode_prior_seconds: float = 600.0
    log_level: str = "info"
    # The job's secret (docs/security.md): a file, else $CHAMELEON_SECRET; with neither, an
    # embedded Redis gets a fresh secret in the state directory and an external one needs insecure.
    secret_file: str = ""
    insecure: bool = False  # run without signatures (no secret): anybody who can write Redis rules

    @property
    def http_host(self) -> str:
        return self.http.rsplit(":", 1)[0]

    @property
    def http_port(self) -> int:
        return int(self.http.rsplit(":", 1)[1])

    @property
    def state_path(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir)
        # systemd's StateDirectory= exports the path; it may list several, separated by ':'.
        env = os.environ.get("STATE_DIRECTORY", "")
        return Path(env.split(":")[0]) if env else Path("state")

    @property
    def consumer_name(self) -> str:
        return self.consumer or os.uname().nodename or "chameleond"


HELP: dict[str, str] = {
    "job": "job name: every Redis key lives under chameleon:{job}:",
    "redis_url": "Redis to use (redis://, rediss:// for TLS, user:password@ for ACL); "
    "empty starts an embedded redis-server",
    "embedded_redis_port": "port of the embedded redis-server on 127.0.0.1",
    "state_dir": "directory of the embedded Redis data (append-only file); "
    "default $STATE_DIRECTORY under systemd, else ./state",
    "http": "HOST:PORT of the HTTP endpoint (/metrics, /healthz, /readyz, /api/v1/...)",
    "spec": "job description file (TOML/JSON); default: the packaged cpu-small job",
    "policy": "adaptive (the selector decides), or force reroute / dynamic / drop",
    "min_workers": "registered workers needed for the initial plan; 0 = every worker of the spec",
    "heartbeat_timeout_seconds": "a worker of the plan silent this long is declared failed (a job "
    "of more than 2,048 workers: longer in proportion, as its workers beat less often)",
    "ready_timeout_seconds": "a worker not acknowledging a plan this long, while others of it "
    "have, is declared failed",
    "registration_ttl_seconds": "a registration from a worker the spec does not list is dropped "
    "if its profile does not follow within this long",
    "block_ms": "XREADGROUP BLOCK in milliseconds (keep well under the socket timeout)",
    "socket_timeout_seconds": "Redis client socket timeout",
    "peer_watch_seconds": "how often the daemon lists the workers' Redis connections to announce "
    "the processes gone (one CLIENT LIST, at most once per 20 of its round trips; a worker "
    "learns of a dead peer within two of these and a publish); 0 turns it off (dead workers "
    "are then found by the heartbeat timeout)",
    "batch_count": "stream entries read per XREADGROUP (COUNT)",
    "max_deliveries": "an entry delivered this many times without success goes to dead letters",
    "claim_idle_seconds": "pending entries idle this long are claimed again (XAUTOCLAIM)",
    "stream_maxlen": "approximate length the event stream is trimmed to",
    "persist_interval_seconds": "how often heartbeat/step progress is written to Redis",
    "lease_seconds": "the leader lease lapses this long after its holder last renewed it; a "
    "standby daemon takes over at most this long after the leader died",
    "consumer": "consumer name in the group; default: the host name",
    "decision_delay_seconds": "fault injection for tests: hold each decision this long before "
    "committing it",
    "slow_mitigation": "answer a worker that became slow or recovered with a decision (a plan "
    "that moves work off it, or back); off, slow workers are still detected and measured",
    "slow_episode_prior_seconds": "how long a slow worker is expected to stay slow before the job "
    "has seen an episode end (then: the mean of its ended episodes)",
    "log_level": "debug, info, warning or error",
    "secret_file": "file holding the job's secret (current, then optionally the previous one) "
    "that signs plans and specs and verifies the workers' events; or the secret itself in "
    "$CHAMELEON_SECRET",
    "insecure": "run without a secret (no signatures): anybody who can write to the job's Redis "
    "keys can publish plans the workers obey",
}

FIELDS = {f.name: f for f in fields(Config)}


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = type(getattr(Config(), name))
    if kind is bool:
        return str(value).lower() in ("1", "true", "yes", "on")
    if kind is str:
        return str(value)
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        number = float(value)
        # NaN compares False against every bound, so a NaN timeout would pass validation and
        # never expire; inf would never expire either.
        if not math.isfinite(number):
            raise ValueError(value)
        if kind is int:
            if not number.is_integer():
                raise ValueError(value)
            return int(value) if isinstance(value, int | str) else int(number)
        return number
    except (TypeError, ValueError, OverflowError):
        what = "a whole number" if kind is int else "a finite number"
        raise ConfigError(f"{origin}: {name} must be {what}, got {value!r}") from None


def from_mapping(base: Config, values: Mapping[str, Any], origin: str) -> Config:
    changes: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"{origin}: unknown setting {key!r}")
        changes[name] = _coerce(name, value, origin)
    return replace(base, **changes)


def from_env(base: Config, environ: Mapping[str, str]) -> Config:
    values = {
        name: environ[f"CHAMELEON_{name.upper()}"]
        for name in FIELDS
        if f"CHAMELEON_{name.upper()}" in environ
    }
    return from_mapping(base, values, "environment")


def _file(path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None


def load(path: str | None, environ: Mapping[str, str], flags: Mapping[str, Any]) -> Config:
    """Defaults, then the file (--config or CHAMELEON_CONFIG), then the environment, then flags."""
    cfg = Config()
    path = path or environ.get("CHAMELEON_CONFIG") or None
    if path:
        cfg = from_mapping(cfg, _file(path), path)
    cfg = from_env(cfg, environ)
    cfg = from_mapping(cfg, {k: v for k, v in flags.items() if v is not None}, "flags")
    return validate(cfg)


def given(
    name: str, path: str | None, environ: Mapping[str, str], flags: Mapping[str, Any]
) -> str | None:
    """Where a setting was given (the winning source, as a user would name it), or None when it
    is the default: `load` merges the same sources in the same order."""
    if flags.get(name) is not None:
        negated = flags[name] is False
        return ("--no-" if negated else "--") + name.replace("_", "-")
    if f"CHAMELEON_{name.upper()}" in environ:
        return f"${'CHAMELEON_' + name.upper()}"
    path = path or environ.get("CHAMELEON_CONFIG") or None
    if path and (name in (data := _file(path)) or name.replace("_", "-") in data):
        return path
    return None


def validate(cfg: Config) -> Config:
    if not cfg.job or any(c.isspace() or c in ":{}" for c in cfg.job):
        raise ConfigError(f"job: {cfg.job!r} must be a name without spaces, ':' or braces")
    if cfg.policy not in POLICIES:
        raise ConfigError(f"policy: {cfg.policy!r} is not one of {', '.join(POLICIES)}")
    host, sep, port = cfg.http.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"http: {cfg.http!r} must be HOST:PORT")
    if cfg.redis_url and (why := url_error(cfg.redis_url)) is not None:
        raise ConfigError(f"redis_url: {why}")
    if cfg.block_ms <= 0 or cfg.block_ms >= cfg.socket_timeout_seconds * 1000 / 2:
        raise ConfigError(
            f"block_ms: {cfg.block_ms} must be > 0 and well under the socket timeout "
            f"({cfg.socket_timeout_seconds} s): at most half of it"
        )
    positive = (
        "heartbeat_timeout_seconds",
        "ready_timeout_seconds",
        "registration_ttl_seconds",
        "batch_count",
        "max_deliveries",
        "claim_idle_seconds",
        "stream_maxlen",
        "persist_interval_seconds",
        "embedded_redis_port",
        "slow_episode_prior_seconds",
    )
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name}: must be > 0, got {getattr(cfg, name)!r}")
    # The holder renews every third of the lease and a renewal may take up to the socket timeout,
    # so the rest of the lease must outlast one renewal or the leader loses it while healthy.
    if cfg.lease_seconds * 2 / 3 <= cfg.socket_timeout_seconds:
        raise ConfigError(
            f"lease_seconds: {cfg.lease_seconds} must be more than 1.5 x socket_timeout_seconds "
            f"({cfg.socket_timeout_seconds} s): the holder renews every third of the lease, and "
            f"a renewal that takes the whole socket timeout must finish before the lease lapses"
        )
    if cfg.min_workers < 0 or cfg.decision_delay_seconds < 0 or cfg.peer_watch_seconds < 0:
        raise ConfigError("min_workers, decision_delay_seconds and peer_watch_seconds must be >= 0")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log_level: {cfg.log_level!r} is not debug, info, warning or error")
    return cfg
