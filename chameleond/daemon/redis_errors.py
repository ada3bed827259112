"""Redis error replies told apart by their code, never by the wording of their message.

Redis starts an error reply with a code (`-NOGROUP No such key ...`); the daemon's Lua scripts
answer the same way with codes of their own (`lua_error`). redis-py raises a reply whose code it
does not map as a `ResponseError` whose text starts with that code, so `error_code` reads it back.
"""

from __future__ import annotations

from enum import StrEnum

from redis.exceptions import ResponseError


class ErrorCode(StrEnum):
    NOGROUP = "NOGROUP"  # the consumer group (or its stream) is gone: Redis came back empty
    BUSYGROUP = "BUSYGROUP"  # the consumer group exists already
    LEASE_LOST = "LEASELOST"  # another daemon holds the job's lease (lease.hold_lua)
    STATE_LOST = "STATELOST"  # Redis holds an older generation than this daemon published
    GENERATION_CONFLICT = "GENCONFLICT"  # Redis holds a newer one: a second daemon on the job


def error_code(error: BaseException) -> str | None:
    """The code an error reply starts with; None for anything but an error reply with a code."""
    if not isinstance(error, ResponseError):
        return None
    code = str(error).partition(" ")[0]
    return code if code.isupper() else None


def has_code(error: BaseException, code: ErrorCode) -> bool:
    return error_code(error) == code


def error_message(error: BaseException) -> str:
    """The reply's text without its code."""
    text = str(error)
    return text.partition(" ")[2] if error_code(error) is not None else text


def lua_error(code: ErrorCode, message: str) -> str:
    """A Lua statement returning an error reply with `code`; `message` is a Lua expression."""
    return f"return redis.error_reply('{code} ' .. {message})"
