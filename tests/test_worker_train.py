"""`train`, the worker library's call: a program catches why a worker could not train as a typed
`WorkerError`, each kind being one exit code of `run` (docs/worker-api.md)."""

from __future__ import annotations

import pytest

from chameleond.redis_server import free_port
from chameleond.worker import (
    ConfigError,
    Job,
    RedisUnavailable,
    Training,
    WorkerConfig,
    WorkerError,
    train,
)


def never_built(job: Job) -> Training:
    raise AssertionError("the training is built only once the job's spec is read")


def test_a_bad_worker_id_is_a_config_error_naming_the_field() -> None:
    config = WorkerConfig(redis_url="redis://127.0.0.1:1/0", job="j", worker_id="w 0")
    with pytest.raises(ConfigError, match=r"worker_id 'w 0': expected a printable id"):
        train(never_built, config)


def test_an_unreachable_redis_is_caught_as_a_worker_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(WorkerError) as caught:
        train(never_built, WorkerConfig(redis_url=url, job="j", worker_id="w0"))
    assert isinstance(caught.value, RedisUnavailable)
    assert str(caught.value).startswith(f"redis at {url}: ")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("redis_url", "http://x", "redis_url"),
        ("max_steps", -1, "max_steps must be >= 0"),
        ("checkpoint_every", 3, "checkpoint_every must be >= 0 and needs checkpoint_dir"),
        ("bind_address", "10.9.9.9", "bind_address '10.9.9.9': not an address of this host"),
    ],
)
def test_each_unusable_field_is_named(field: str, value: object, message: str) -> None:
    fields: dict[str, object] = {"redis_url": "redis://127.0.0.1:1/0", "job": "j"}
    config = WorkerConfig(**{**fields, "worker_id": "w0", field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        train(never_built, config)
