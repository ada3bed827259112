"""The --faults grammar of `chameleonctl up`, and a fault event sent through redis-cli itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from chameleond.local.faults import (
    Fault,
    FaultSpecError,
    check_workers,
    corrupt_newest_checkpoint,
    parse_faults,
    send_fault_event,
)
from chameleond.protocol import Keys, parse_event
from chameleond.redis_server import RedisServer


def test_parses_kills_and_events() -> None:
    got = parse_faults("kill:w4@step=4, event:w1@t=2.5s:ECC error on HBM,kill:w0@t=800ms")
    assert got == (
        Fault("kill", "w4", at_step=4),
        Fault("event", "w1", at_seconds=2.5, cause="ECC error on HBM"),
        Fault("kill", "w0", at_seconds=0.8),
    )
    assert got[0].default_cause() == "kill -9 (injected)"
    assert got[1].default_cause() == "ECC error on HBM"


def test_corrupt_cuts_the_workers_newest_checkpoint_file(tmp_path: Path) -> None:
    [fault] = parse_faults("corrupt:w1@step=12")
    assert fault == Fault("corrupt", "w1", at_step=12)
    assert corrupt_newest_checkpoint(tmp_path, "w1") is None  # nothing written yet
    for name in ("w1-000000004", "w1-000000009", "w10-000000014", "w0-000000014"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"x" * 100)
    assert corrupt_newest_checkpoint(tmp_path, "w1") == tmp_path / "w1-000000009.safetensors"
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert sizes.pop("w1-000000009.safetensors") == 50
    assert set(sizes.values()) == {100}


def test_empty_spec_is_no_faults() -> None:
    assert parse_faults("") == ()
    assert parse_faults("  ") == ()


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("kill w4 at 5", "expected ACTION:WORKER@WHEN"),
        ("boom:w4@step=4", "action 'boom'"),
        ("kill:w4@step=x", "step must be"),
        ("kill:w4@t=soon", "t must be seconds"),
        ("kill:w4@when=3", "WHEN must be"),
        ("kill:w4@step=1,,kill:w2@step=3", "empty fault"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec: str, fragment: str) -> None:
    with pytest.raises(FaultSpecError, match=fragment):
        parse_faults(spec)


def test_unknown_worker_is_rejected() -> None:
    with pytest.raises(FaultSpecError, match="no worker 'w9'"):
        check_workers(parse_faults("kill:w9@step=1"), ["w0", "w1"])


def test_due_by_step_and_time() -> None:
    by_step, by_time = parse_faults("kill:w1@step=3,kill:w2@t=2")
    assert not by_step.due(None, None) and not by_step.due(2, 100.0)
    assert by_step.due(3, 0.0)
    assert not by_time.due(50, 1.9) and by_time.due(0, 2.0)


def test_fault_event_is_what_redis_cli_sends(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    entry = send_fault_event(redis_server.url, "default", "w3", "ECC error")
    [(eid, fields)] = redis_client.xrange(Keys("default").events)
    assert eid == entry
    event = parse_event(fields)
    assert (event.type, event.worker, event.cause) == ("fault", "w3", "ECC error")
