"""A minimal Redis connection for the simulated workers (chameleond/bench/simworkers.py): commands
written in RESP, replies parsed by hiredis, one command at a time per connection.

Thousands of simulated workers in one process each hold two connections, as real workers do. With
redis-py's asyncio client every command cost a simulated worker's process several hundred
microseconds of CPU, so at 8,192 workers the load generator alone took most of a 2-core machine
and starved the daemon and Redis it measures. The same commands on the same connections, without
the client's layers, cost a fraction of that. Only what the simulated workers send is here:
a named connection (AUTH and SELECT from the URL), a command and its reply, and SUBSCRIBE with the
messages that follow.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import hiredis
from redis.connection import parse_url

READ_BYTES = 65536


class RespError(Exception):
    """An error reply, or the connection closed."""


def pack(args: tuple[Any, ...]) -> bytes:
    """A command as RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._parser = hiredis.Reader()
        self._lock = asyncio.Lock()  # a worker's loops share its connection: one command at a time

    @classmethod
    async def open(cls, url: str, name: str) -> Connection:
        """A connection to the Redis at `url`, authenticated and named `name` (CLIENT SETNAME)."""
        opts = parse_url(url)
        reader, writer = await asyncio.open_connection(opts.get("host", "127.0.0.1"),
                                                       opts.get("port", 6379))  # fmt: skip
        conn = cls(reader, writer)
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

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply (bytes, int, list or None)."""
        async with self._lock:
            self._writer.write(pack(args))
            return await self._reply()

    async def _reply(self) -> Any:
        while True:
            reply = self._parser.gets()
            if reply is not False:
                if isinstance(reply, hiredis.ReplyError):
                    raise RespError(str(reply))
                return reply
            data = await self._reader.read(READ_BYTES)
            if not data:
                raise RespError("connection closed")
            self._parser.feed(data)

    async def subscribe(self, *channels: str) -> AsyncGenerator[tuple[bytes, bytes], None]:
        """SUBSCRIBE to `channels`, then each message as (channel, data), for ever. The
        connection is the subscriber's alone from then on."""
        self._writer.write(pack(("SUBSCRIBE", *channels)))
        while True:
            reply = await self._reply()
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                yield reply[1], reply[2]

    def close(self) -> None:
        self._writer.close()
