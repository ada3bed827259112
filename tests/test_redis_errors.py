"""Redis error replies are told apart by their code, read from real replies of a real Redis."""

from __future__ import annotations

import pytest
import redis

from chameleond.daemon.redis_errors import (
    ErrorCode,
    error_code,
    error_message,
    has_code,
    lua_error,
)


def test_redis_own_codes_are_read_from_its_replies(redis_client: redis.Redis) -> None:
    with pytest.raises(redis.ResponseError) as nogroup:
        redis_client.xreadgroup("nobody", "c", {"no-such-stream": ">"})
    assert has_code(nogroup.value, ErrorCode.NOGROUP)
    redis_client.xgroup_create("s", "g", id="0", mkstream=True)
    with pytest.raises(redis.ResponseError) as busy:
        redis_client.xgroup_create("s", "g", id="0")
    assert error_code(busy.value) == ErrorCode.BUSYGROUP
    assert not has_code(busy.value, ErrorCode.NOGROUP)


def test_a_script_answers_with_its_code_and_message(redis_client: redis.Redis) -> None:
    script = redis_client.register_script(
        lua_error(ErrorCode.STATE_LOST, "'state lost: ' .. ARGV[1]")
    )
    with pytest.raises(redis.ResponseError) as e:
        script(args=["Redis holds 3"])
    assert has_code(e.value, ErrorCode.STATE_LOST)
    assert error_message(e.value) == "state lost: Redis holds 3"


def test_errors_without_a_code_have_none() -> None:
    assert error_code(redis.ResponseError("state lost: anything")) is None
    assert error_code(ConnectionError("LEASELOST in a message that is no reply")) is None
    assert error_message(redis.ResponseError("plain words")) == "plain words"
