"""A minimal Redis connection for the simulated workers (chameleond/bench/simworkers.py): commands
written in RESP, replies parsed by hiredis and handed, in order, to the commands that wait for
them.

Thousands of simulated workers in one process each hold two connections, as real workers do. With
redis-py's asyncio client every command cost a simulated worker's process several hundred
microseconds of CPU, so at 8,192 workers the load generator alone took most of a 2-core machine
and starved the daemon and Redis it measures. Here a connection is an asyncio protocol: a command
is written at once and waits on a future; each reply read completes the oldest waiting command
(Redis answers a connection's commands in order), so a worker's loops share its connection
without a lock and without a stream reader's buffers. Only what the simulated workers send is
here: a named connection (AUTH and SELECT from the URL), a command and its reply, and SUBSCRIBE
with the messages that follow.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any, cast

import hiredis
from redis.connection import parse_url


class RespError(Exception):
    """An error reply, or the connection closed."""


def pack(args: tuple[Any, ...]) -> bytes:
    """A command as RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self._parser = hiredis.Reader()
        self._transport: asyncio.Transport | None = None
        self._waiting: deque[asyncio.Future[Any]] = deque()  # commands sent, oldest first
        self._messages: asyncio.Queue[tuple[bytes, bytes] | None] | None = None  # subscribed
        self._closed = False

    @classmethod
    async def open(cls, url: str, name: str) -> Connection:
        """A connection to the Redis at `url`, authenticated and named `name` (CLIENT SETNAME)."""
        opts = parse_url(url)
        loop = asyncio.get_running_loop()
        transport, conn = await loop.create_connection(cls, opts.get("host", "127.0.0.1"),
                                                       opts.get("port", 6379))  # fmt: skip
        # uvloop calls connection_made soon after, not before, create_connection returns.
        conn._transport = cast(asyncio.Transport, transport)
        try:
            if opts.get("password"):
                user = opts.get("username")
                await conn.call("AUTH", *([user] if user else []), opts["password"])
            if opts.get("db"):
                await conn.call("SELECT", opts["db"])
            await conn.call("CLIENT", "SETNAME", name)
        except BaseException:
            conn.close()
            raise
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._parser.feed(data)
        while (reply := self._parser.gets()) is not False:
            if self._messages is not None:
                if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                    self._messages.put_nowait((reply[1], reply[2]))
                continue
            waiting = self._waiting.popleft()
            if waiting.done():  # its caller was cancelled
                continue
            if isinstance(reply, hiredis.ReplyError):
                waiting.set_exception(RespError(str(reply)))
            else:
                waiting.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.done():
                waiting.set_exception(RespError("connection closed"))
        if self._messages is not None:
            self._messages.put_nowait(None)

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply (bytes, int, list or None)."""
        if self._closed or self._transport is None:
            raise RespError("connection closed")
        reply = asyncio.get_running_loop().create_future()
        self._waiting.append(reply)
        self._transport.write(pack(args))
        return await reply

    async def subscribe(self, *channels: str) -> AsyncGenerator[tuple[bytes, bytes], None]:
        """SUBSCRIBE to `channels`, then each message as (channel, data), for ever. The
        connection is the subscriber's alone from then on."""
        if self._closed or self._transport is None:
            raise RespError("connection closed")
        messages = self._messages = asyncio.Queue()
        self._transport.write(pack(("SUBSCRIBE", *channels)))
        while (message := await messages.get()) is not None:
            yield message
        raise RespError("connection closed")

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
