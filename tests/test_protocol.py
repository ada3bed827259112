"""The wire protocol: key names, parse_event's contract (typed event or EventError(reason)), and
each event's fields as the worker writes them."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleond.auth import AuthError, Keyring
from chameleond.events import (
    EVENT_CLASSES,
    Ack,
    AckPhase,
    Checkpoint,
    Event,
    Fault,
    Heartbeat,
    Profile,
    Register,
    Rejoin,
    Step,
)
from chameleond.protocol import (
    EVENT_TYPES,
    MAX_EVENT_BYTES,
    EventError,
    Keys,
    parse_event,
    read_event,
    redact_url,
    url_error,
)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://job:pw@redis.internal:6380/0", "redis://***@redis.internal:6380/0"),
        ("rediss://:p%40ss@h/1?ssl_cert_reqs=none", "rediss://***@h/1?ssl_cert_reqs=none"),
        ("redis://h/0?password=pw&socket_timeout=5", "redis://h/0?password=***&socket_timeout=5"),
        ("unix:///run/redis.sock?password=pw", "unix:///run/redis.sock?password=***"),
    ],
)
def test_redis_urls_are_logged_without_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    "url",
    [
        "http://job:pw-123456@h:6379/0",
        "redis://job:pw-123456@h:port/0",
        "redis://job:pw-123456@h:99999/0",
        "redis://h:6379/0?password=pw-123456&socket_timeout=soon",
    ],
)
def test_unusable_redis_urls_are_named_without_their_password(url: str) -> None:
    why = url_error(url)
    assert why is not None and "pw-123456" not in why and "***" in why
    assert url_error("rediss://job:pw@h:6379/0?ssl_cert_reqs=none") is None


def test_keys_live_under_the_job_prefix() -> None:
    k = Keys("job7")
    names = [k.events, k.dead, k.plan, k.plans_channel, k.state, k.spec, k.decisions, k.store(3)]
    assert all(n.startswith("chameleon:job7:") for n in names)
    assert k.events == "chameleon:job7:events" and k.plans_channel == "chameleon:job7:plans"


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "fault", "worker": "w3", "cause": "ECC error"},
        {"type": "fault", "node": "w3"},
        {"type": "rejoin", "worker": "w3"},
        {"type": "register", "worker": "w3", "host": "h1", "device": "cpu", "memory_bytes": "1"},
        {"type": "heartbeat", "worker": "w3"},
        {"type": "profile", "worker": "w3", "data": json.dumps({"layers": []})},
        {"type": "step", "worker": "w3", "generation": "2", "step": "0", "samples": "12",
         "seconds": "0.5", "loss": "5.5"},
        {"type": "step", "worker": "w3", "generation": "2", "step": "0", "samples": "8",
         "seconds": "0.5", "loss": "5.5", "grad_norm": "0.75", "lr": "0.0003", "tokens": "1024",
         "skipped": "4", "overflow": "0", "loss_scale": "65536.0", "eval_loss": "5.9"},
        {"type": "ack", "worker": "w3", "generation": "2", "phase": "ready"},
        {"type": "ack", "worker": "w3", "generation": "2", "phase": "stopped"},
        {"type": "checkpoint", "worker": "w3", "step": "19", "generation": "2", "layers": "0,1,2"},
        {"type": "checkpoint", "worker": "w3", "step": "19", "generation": "2", "layers": "0",
         "bytes": "4096", "bubble_seconds": "0.001", "stall_seconds": "0"},
    ],
)  # fmt: skip
def test_valid_events_parse(fields: dict[str, str]) -> None:
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    event = parse_event(raw)
    assert event.type == fields["type"] and event.worker == "w3"
    assert isinstance(event, EVENT_CLASSES) and type(event).type == fields["type"]


def test_events_arrive_typed_with_their_defaults() -> None:
    """Each type parses once into its own dataclass: numbers as numbers, options filled in."""
    step = parse_event(
        {"type": "step", "worker": "w1", "generation": "2", "step": "7", "samples": "12",
         "seconds": "0.5", "loss": "5.5"}
    )  # fmt: skip
    assert step == Step("w1", generation=2, step=7, samples=12, seconds=0.5, loss=5.5)
    assert (step.grad_norm, step.learning_rate, step.tokens, step.eval_loss) == (None,) * 4
    assert (step.skipped_samples, step.overflow, step.loss_scale) == (0, False, None)
    assert parse_event({"type": "fault", "node": "n3"}) == Fault("n3", cause="", generation=None)
    assert parse_event({"type": "fault", "worker": "w3", "generation": "4", "cause": "ECC"}) == (
        Fault("w3", cause="ECC", generation=4)
    )
    ack = parse_event({"type": "ack", "worker": "w1", "generation": "3", "phase": "ready"})
    assert ack == Ack("w1", 3, AckPhase.READY, attempt=1)
    gone = parse_event(
        {"type": "ack", "worker": "w1", "generation": "3", "phase": "unrestorable", "step": "9"}
    )
    assert isinstance(gone, Ack) and (gone.phase, gone.step, gone.cause) == (
        AckPhase.UNRESTORABLE, 9, ""
    )  # fmt: skip
    full = parse_event(
        {"type": "step", "worker": "w1", "generation": "2", "step": "7", "samples": "8",
         "seconds": "0.5", "loss": "5.5", "vote_seconds": "0.1", "grad_norm": "0.75",
         "lr": "3e-4", "tokens": "1024", "skipped": "4", "overflow": "1", "loss_scale": "2048",
         "eval_loss": "5.9", "at": "1700000000.5"}
    )  # fmt: skip
    assert full == Step(
        "w1", generation=2, step=7, samples=8, seconds=0.5, loss=5.5, vote_seconds=0.1,
        grad_norm=0.75, learning_rate=3e-4, tokens=1024, skipped_samples=4, overflow=True,
        loss_scale=2048.0, eval_loss=5.9,
    )  # fmt: skip
    reg = parse_event({"type": "register", "worker": "w1", "host": "h", "memory_bytes": "8"})
    assert reg == Register("w1", "h", 8, device="cpu")
    cp = parse_event(
        {"type": "checkpoint", "worker": "w1", "step": "4", "generation": "2", "layers": "2,0",
         "bytes": "4096"}
    )  # fmt: skip
    assert cp == Checkpoint("w1", 2, 4, (2, 0), size_bytes=4096.0)


STEP = {"type": "step", "worker": "w3", "generation": "1", "step": "1", "samples": "2",
        "seconds": "0.1", "loss": "1.0"}  # fmt: skip


def test_a_step_whose_fp16_gradients_overflowed_has_no_gradient_norm() -> None:
    """Its gradients held inf or nan, so their norm is one too: the committed step is still a
    step (not dead-lettered), with no norm. Without the overflow flag, such a norm is refused."""
    for norm in ("inf", "nan", "-inf", "Infinity"):
        step = parse_event({**STEP, "overflow": "1", "grad_norm": norm, "loss_scale": "1024"})
        assert isinstance(step, Step)
        assert (step.overflow, step.grad_norm, step.loss_scale) == (True, None, 1024.0)
    step = parse_event({**STEP, "overflow": "1", "grad_norm": "3.5"})
    assert isinstance(step, Step) and step.grad_norm == 3.5
    with pytest.raises(EventError, match="'grad_norm' must be a number"):
        parse_event({**STEP, "overflow": "1", "grad_norm": "huge"})


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({}, "missing field 'type'"),
        ({"type": "explode"}, "unknown type"),
        ({"type": "fault"}, "needs 'worker' or 'node'"),
        ({"type": "fault", "worker": "w 3"}, "printable id without spaces"),
        ({"type": "register", "worker": "w3", "host": "h"}, "missing field 'memory_bytes'"),
        ({"type": "step", "worker": "w3", "generation": "1", "step": "x"}, "must be an integer"),
        ({"type": "step", "worker": "w3", "generation": "1", "step": "1", "samples": "2",
          "seconds": "nan", "loss": "1"}, "finite number"),
        ({"type": "ack", "worker": "w3", "generation": "1", "phase": "done"}, "'phase' must be"),
        ({"type": "ack", "worker": "w3", "generation": "1", "phase": "ready", "attempt": "0"},
         "'attempt' must be in 1..1000000"),
        ({"type": "ack", "worker": "w3", "generation": "1", "phase": "ready", "attempt": "two"},
         "'attempt' must be an integer"),
        ({"type": "profile", "worker": "w3", "data": "{"}, "not JSON"),
        ({"type": "checkpoint", "worker": "w3", "step": "4", "generation": "1"},
         "comma-separated ids"),
        ({"type": "checkpoint", "worker": "w3", "step": "4", "generation": "1", "layers": "0-3"},
         "comma-separated ids"),
        ({"type": "checkpoint", "worker": "w3", "step": "4", "generation": "1", "layers": "1,-1"},
         "comma-separated ids"),
        ({"type": "checkpoint", "worker": "w3", "step": "4", "layers": "1"},
         "missing field 'generation'"),
        ({"type": "checkpoint", "worker": "w3", "step": "4", "generation": "1", "layers": "1",
          "stall_seconds": "-1"}, "'stall_seconds' must be a finite number in 0.0.."),
        ({"type": b"\xff\xfe"}, "not UTF-8"),
        ({**STEP, "grad_norm": "-0.5"}, "'grad_norm' must be a finite number in 0.0.."),
        ({**STEP, "grad_norm": "inf"}, "'grad_norm' must be a finite number"),
        ({**STEP, "lr": "fast"}, "'lr' must be a number, got 'fast'"),
        ({**STEP, "lr": "1e31"}, "'lr' must be a finite number in 0.0.."),
        ({**STEP, "tokens": "1.5"}, "'tokens' must be an integer"),
        ({**STEP, "tokens": "-1"}, "'tokens' must be in 0..9007199254740991"),
        ({**STEP, "skipped": "2000000000000"}, "'skipped' must be in 0..1099511627776"),
        ({**STEP, "overflow": "yes"}, "'overflow' must be 1 or 0, got 'yes'"),
        ({**STEP, "overflow": ""}, "'overflow' must be 1 or 0"),
        ({**STEP, "loss_scale": "0"}, "'loss_scale' must be above 0"),
        ({**STEP, "loss_scale": "-inf"}, "'loss_scale' must be a finite number"),
        ({**STEP, "eval_loss": "nan"}, "'eval_loss' must be a finite number in 0.0.."),
    ],
)  # fmt: skip
def test_malformed_events_say_why(fields: dict[object, object], reason: str) -> None:
    with pytest.raises(EventError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_event(fields)


_text = st.one_of(st.text(max_size=20), st.binary(max_size=20))


_names = st.sampled_from(["type", "worker", "generation", "phase", "data", "memory_bytes", "step"])


@settings(max_examples=500, deadline=None)
@given(
    st.dictionaries(
        st.one_of(_names, _text), st.one_of(st.sampled_from(list(EVENT_TYPES)), _text), max_size=8
    )
)
def test_any_fields_give_an_event_or_an_event_error(fields: dict[object, object]) -> None:
    try:
        event = parse_event(fields)
    except EventError as e:
        assert str(e)
    else:
        assert event.type in EVENT_TYPES and event.worker


# ---- the wire in the other direction: typed events written as fields -----------------------------

AT = 1700000000.125  # a clock the worker's `at` (3 decimals) writes exactly
LAYERS = {"layers": [{"forward_seconds": 0.001, "param_bytes": 12}], "generation": 2}
ROUND_TRIP: list[Event] = [
    Fault("w2", "RuntimeError: boom", generation=3, reporter="w1", at=AT),
    Fault("w2"),
    Rejoin("w2"),
    Register("w1", "h1", 2**33, "cuda:0", pid=4242, address="10.0.0.1:0", corpus="ab12"),
    Register("w1", "h1", 8),
    Heartbeat("w1", at=AT, refused=2),
    Profile("w1", LAYERS),
    Step("w1", 2, 7, 8, 0.125, 5.5, vote_seconds=0.25, learning_rate=0.0003, tokens=1024,
         skipped_samples=4, at=AT, grad_norm=0.75, eval_loss=5.9, overflow=True, loss_scale=1024.0),
    Step("w1", 2, 7, 12, 0.5, 5.5),
    Ack("w1", 4, AckPhase.READY, 2, build_seconds=1.5, migration_seconds=0.25, world_seconds=1.0,
        moves=3),
    Ack("w1", 4, AckPhase.STOPPED, reason="left"),
    Ack("w1", 4, AckPhase.UNRESTORABLE, step=17, cause="no file holds layer 3"),
    Checkpoint("w1", 2, 9, (3, 1, 2), size_bytes=4096, bubble_seconds=0.5, stall_seconds=0.0),
]  # fmt: skip


def test_every_event_type_is_written_as_fields_that_parse_back_to_it() -> None:
    assert {type(e) for e in ROUND_TRIP} == set(EVENT_CLASSES)
    for event in ROUND_TRIP:
        fields = event.to_fields()
        assert all(isinstance(v, str) for v in fields.values())
        again = parse_event({k.encode(): v.encode() for k, v in fields.items()})
        assert type(again) is type(event) and again.to_fields() == fields
        if not isinstance(event, Profile):  # compared by identity; its fields say it all
            assert again == event


# What the worker sent before its events were typed: the dicts chameleond/worker/_runtime.py,
# startup.py, saver.py and events.py built, field for field and in order (the stream keeps it).
T = 1700000000.123456
WORKER_SENT: list[tuple[Event, dict[str, str]]] = [
    (Fault("w2", "RuntimeError: boom", 3, reporter="w1", at=T),
     {"type": "fault", "worker": "w2", "cause": "RuntimeError: boom", "reporter": "w1",
      "generation": "3", "at": "1700000000.123"}),
    (Heartbeat("w1", at=T), {"type": "heartbeat", "worker": "w1", "at": "1700000000.123"}),
    (Heartbeat("w1", at=T, refused=3),
     {"type": "heartbeat", "worker": "w1", "at": "1700000000.123", "refused": "3"}),
    (Register("w1", "h1", 2**33, "cpu", 4242, "", "ab12"),
     {"type": "register", "worker": "w1", "host": "h1", "device": "cpu",
      "memory_bytes": "8589934592", "pid": "4242", "address": "", "corpus": "ab12"}),
    (Profile("w1", LAYERS),
     {"type": "profile", "worker": "w1",
      "data": '{"layers": [{"forward_seconds": 0.001, "param_bytes": 12}], "generation": 2}'}),
    (Ack("w1", 4, AckPhase.READY, 1, build_seconds=1.23456, migration_seconds=0.56789,
         world_seconds=0.234567, moves=3),
     {"type": "ack", "worker": "w1", "generation": "4", "phase": "ready", "attempt": "1",
      "build_seconds": "1.2346", "world_seconds": "0.2346", "migration_seconds": "0.5679",
      "moves": "3"}),
    (Ack("w1", 4, AckPhase.STOPPED), {"type": "ack", "worker": "w1", "generation": "4",
                                      "phase": "stopped"}),
    (Ack("w1", 4, AckPhase.STOPPED, reason="finished"),
     {"type": "ack", "worker": "w1", "generation": "4", "phase": "stopped", "reason": "finished"}),
    (Ack("w1", 4, AckPhase.UNRESTORABLE, step=17, cause="gone"),
     {"type": "ack", "worker": "w1", "generation": "4", "phase": "unrestorable", "step": "17",
      "cause": "gone"}),
    (Step("w1", 2, 7, 8, 0.123456789, 5.123456789, vote_seconds=0.01234567,
          learning_rate=float("nan"), tokens=1024, skipped_samples=4, at=T, grad_norm=2.5),
     {"type": "step", "worker": "w1", "generation": "2", "step": "7", "samples": "8",
      "seconds": "0.123457", "vote_seconds": "0.012346", "loss": "5.123456789", "lr": "nan",
      "tokens": "1024", "skipped": "4", "at": "1700000000.123",
      "grad_norm": "2.5"}),
    (Step("w1", 2, 7, 8, 0.5, 5.5, vote_seconds=0.0, learning_rate=0.001, tokens=0,
          skipped_samples=0, at=T, eval_loss=5.9, overflow=False, loss_scale=65536.0),
     {"type": "step", "worker": "w1", "generation": "2", "step": "7", "samples": "8",
      "seconds": "0.500000", "vote_seconds": "0.000000", "loss": "5.5", "lr": "0.001",
      "tokens": "0", "skipped": "0", "at": "1700000000.123", "eval_loss": "5.9",
      "overflow": "0", "loss_scale": "65536.0"}),
    (Checkpoint("w1", 2, 9, (3, 1, 2), size_bytes=123456, bubble_seconds=0.1234567,
                stall_seconds=0.0),
     {"type": "checkpoint", "worker": "w1", "step": "9", "generation": "2", "layers": "3,1,2",
      "bytes": "123456", "bubble_seconds": "0.123457", "stall_seconds": "0.000000"}),
]  # fmt: skip


@pytest.mark.parametrize(("event", "sent"), WORKER_SENT)
def test_a_typed_event_is_written_as_the_worker_always_wrote_it(
    event: Event, sent: dict[str, str]
) -> None:
    assert list(event.to_fields().items()) == list(sent.items())


def test_an_entry_is_read_in_one_call_size_then_signature_then_fields() -> None:
    ring, other = Keyring((b"s" * 32,)), Keyring((b"t" * 32,))
    beat = Heartbeat("w1", at=AT)
    signed = {k.encode(): v.encode() for k, v in ring.sign_event("j", beat.to_fields()).items()}
    assert read_event(signed, "j", ring) == beat
    assert read_event(beat.to_fields(), "j", None) == beat  # no keyring: nothing to verify
    with pytest.raises(AuthError, match="unsigned"):
        read_event(beat.to_fields(), "j", ring)
    with pytest.raises(AuthError, match="unknown key"):
        read_event(signed, "j", other)
    with pytest.raises(AuthError, match="bad signature"):
        read_event(signed, "another-job", ring)
    huge = {**beat.to_fields(), "pad": "x" * MAX_EVENT_BYTES}
    with pytest.raises(EventError, match="bytes: a 'heartbeat' event has at most"):
        read_event(huge, "j", ring)  # refused before its signature is even looked at
    bad = ring.sign_event("j", {**beat.to_fields(), "worker": "a b"})
    with pytest.raises(EventError, match="'worker' must be a printable id"):
        read_event(bad, "j", ring)
