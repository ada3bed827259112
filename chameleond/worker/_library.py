"""`train`: one worker's whole training as a library call, its end a `TrainingResult` or a
`WorkerError` (chameleond.worker.api). `run` (chameleond.worker._main) is the command line around
it: flags, logging, signals, exit codes.

The call checks the config, makes the device current, connects to the job's Redis and follows the
plans until fenced, finished or stopped. It installs no signal handlers: a program stops it by
setting the `stop` event (from a signal handler of its own, or another thread), after which the
worker leaves the job at the end of the step under way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace

import redis
import torch

from chameleond.core.spec import SpecError
from chameleond.protocol import redact_url
from chameleond.redisurl import connect
from chameleond.worker._backend import check_device
from chameleond.worker._config import WorkerConfig, config_error
from chameleond.worker._hooks import WorkerHooks
from chameleond.worker._link import connection_name, new_incarnation
from chameleond.worker._runtime import WorkerRuntime
from chameleond.worker.api import (
    ConfigError,
    JobSpecError,
    RedisUnavailable,
    Training,
    TrainingOf,
    TrainingResult,
)


def train(
    training: Training | TrainingOf, config: WorkerConfig, stop: threading.Event | None = None
) -> TrainingResult:
    """Train `training` as the worker `config` names until fenced, finished (`max_steps`) or
    stopped (`stop` set); how it ended. Raises a WorkerError subclass saying why it could not:
    ConfigError, RedisUnavailable, JobSpecError, BackendUnavailable, DataError, DeviceFailed,
    ModelError."""
    return train_with(training, config, WorkerHooks(), stop or threading.Event())


def train_with(
    training: Training | TrainingOf,
    config: WorkerConfig,
    hooks: WorkerHooks,
    stop: threading.Event,
    on_connected: Callable[[], None] | None = None,
) -> TrainingResult:
    """`train`, with test hooks, and `on_connected` called once Redis answered."""
    if (why := config_error(config)) is not None:
        raise ConfigError(why)
    check_device(config.device)
    # One thread per worker: shared hosts stay responsive, and every worker computes a micro-batch
    # with the same kernels, so a rerouted micro-batch gives the same numbers as on its owner.
    torch.set_num_threads(1)
    cfg = replace(config, incarnation=config.incarnation or new_incarnation())
    client = connect(
        cfg.redis_url,
        client_name=connection_name(cfg.job, cfg.worker_id, cfg.incarnation),
        socket_timeout=30,
        health_check_interval=10,
    )
    try:
        runtime = WorkerRuntime(cfg, client, training, hooks, stop)
        client.ping()
        if on_connected is not None:
            on_connected()
        return runtime.run()
    except redis.RedisError as e:
        raise RedisUnavailable(f"redis at {redact_url(cfg.redis_url)}: {e}") from e
    except (SpecError, TimeoutError) as e:
        raise JobSpecError(str(e)) from e
    finally:
        client.close()
