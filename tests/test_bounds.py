"""Bounds: nothing a client writes to the event stream can make the daemon raise after parsing.

Arbitrary field values go through the real parse, the real handlers, the gauges and views the
housekeeping refreshes, and the persisted snapshot (written as the commit writes it, then restored
as a restarted daemon restores it): an input that got through parse_event and raised later would
crash the daemon again after every restart, since the entry (or the state) stays in Redis.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chameleond.core.machine import Phase, PolicyMachine
from chameleond.daemon.config import Config
from chameleond.daemon.dispatch import dispatch
from chameleond.daemon.metrics import Metrics
from chameleond.daemon.views import progress, refresh_gauges, status
from chameleond.jobs import load_default_spec
from chameleond.jobstate.job import Job
from chameleond.jobstate.snapshot import restore, snapshot
from chameleond.protocol import (
    EVENT_TYPES,
    MAX_EVENT_BYTES,
    MAX_REASON_LEN,
    EventError,
    parse_event,
)

SPEC = load_default_spec()
WORKERS = tuple(w.id for w in SPEC.workers)
CFG = Config()
METRICS = Metrics()

# The inputs that crashed the daemon (or would have been persisted) before the bounds.
CRASH_INPUTS: list[dict[str, str]] = [
    {"type": "checkpoint", "worker": "w0", "step": "9" * 300, "generation": "1", "layers": "0"},
    {"type": "ack", "worker": "w0", "generation": "1", "phase": "ready", "attempt": "9" * 40},
    {"type": "profile", "worker": "w0",
     "data": json.dumps({"layers": [{"forward_seconds": 0.1, "backward_seconds": 0.2,
                                     "param_bytes": 1e300, "optimizer_bytes": 1,
                                     "activation_bytes": 1, "output_bytes": 1}]})},
    {"type": "step", "worker": "w0", "generation": "1", "step": "1", "samples": "9" * 30,
     "seconds": "1e-300", "loss": "1"},
    {"type": "heartbeat", "worker": "w0", "pad": "x" * (16 * 1024 * 1024)},
    {"type": "x" * (1024 * 1024)},
]  # fmt: skip


def training_job() -> Job:
    j = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    for w in WORKERS:
        ev = {"type": "register", "worker": w, "host": "localhost", "memory_bytes": str(2**31)}
        dispatch(j, parse_event(ev), "0-1", 1.0)
    j.machine.initial(1, WORKERS, 1.0)
    for w in WORKERS:
        ev = {"type": "ack", "worker": w, "generation": "1", "phase": "ready"}
        dispatch(j, parse_event(ev), "0-2", 1.0)
    assert j.machine.phase is Phase.TRAINING
    return j


def exercise(j: Job, fields: dict[str, Any], now: float = 2.0) -> str | None:
    """What the daemon does with one entry and after it; the dead-letter reason, or None."""
    try:
        event = parse_event(fields)
        dispatch(j, event, "1-0", now)
        reason = None
    except EventError as e:
        reason = str(e)
    # Housekeeping: the gauges, the status and progress views, the committed snapshot ...
    refresh_gauges(j, METRICS, CFG)
    json.dumps(status(j, CFG))
    json.dumps(progress(j))
    snap = json.dumps(snapshot(j), separators=(",", ":"))
    # ... and a restart from it.
    again = Job("t", SPEC, policy="adaptive", machine=PolicyMachine())
    restore(again, json.loads(snap), j.plan, ready_timeout=30.0)
    refresh_gauges(again, METRICS, CFG)
    json.dumps(status(again, CFG))
    return reason


def test_each_known_crash_input_is_refused_with_a_short_reason() -> None:
    for fields in CRASH_INPUTS:
        j = training_job()
        reason = exercise(j, fields)
        assert reason is not None, f"accepted: {str(fields)[:200]}"
        assert len(reason) <= MAX_REASON_LEN


def test_an_oversize_event_is_refused_before_decoding() -> None:
    with pytest.raises(EventError, match="at most 65536"):
        parse_event({b"type": b"heartbeat", b"worker": b"w0", b"pad": b"x" * MAX_EVENT_BYTES})
    # A profile may be larger: it lists every layer.
    layers = [{"forward_seconds": 0.1, "backward_seconds": 0.1, "param_bytes": 1,
               "optimizer_bytes": 1, "activation_bytes": 1, "output_bytes": 1}] * 8  # fmt: skip
    data = json.dumps({"layers": layers, "pad": "x" * MAX_EVENT_BYTES})
    assert parse_event({"type": "profile", "worker": "w0", "data": data}).type == "profile"


_NUMBERS = st.one_of(
    st.integers().map(str),
    st.integers(min_value=10**15, max_value=10**400).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "1", "2", "-1", "1e300", "-1e300", "nan", "inf", "1_000", " 7", "٣"]),
)
_TOKENS = [*WORKERS, "w0,w1", "0,1,2", "0," * 100 + "9" * 30, "ready", "stopped", "unrestorable",
           "cpu", "localhost"]  # fmt: skip
_VALUES = st.one_of(
    _NUMBERS,
    st.text(max_size=40),
    st.sampled_from(_TOKENS),
    st.integers(min_value=1000, max_value=3000).map(lambda n: "y" * n),
)
_JSON_NUMBER = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=5),
)
_LAYER = st.dictionaries(
    st.sampled_from(["index", "name", "forward_seconds", "backward_seconds", "param_bytes",
                     "optimizer_bytes", "activation_bytes", "output_bytes", "update_seconds"]),
    _JSON_NUMBER,
)  # fmt: skip
_HOST = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["localhost", "h9"]), st.text(max_size=3))},
    optional={"cores": _JSON_NUMBER, "busy_cores": _JSON_NUMBER, "step_cpu_seconds": _JSON_NUMBER},
)
_PROFILE = st.fixed_dictionaries(
    {"layers": st.lists(_LAYER, max_size=12)},
    optional={"host": _HOST, "generation": _JSON_NUMBER},
).map(lambda d: json.dumps(d, allow_nan=True))
_FIELD_NAMES = st.sampled_from(
    ["generation", "step", "samples", "seconds", "loss", "vote_seconds", "phase", "attempt",
     "memory_bytes", "host", "device", "cause", "layers", "bytes", "bubble_seconds",
     "stall_seconds", "node", "at", "reporter"]
)  # fmt: skip


@st.composite
def events(draw: st.DrawFn) -> dict[str, str]:
    fields = draw(st.dictionaries(_FIELD_NAMES, _VALUES, max_size=10))
    fields["type"] = draw(st.sampled_from(EVENT_TYPES))
    fields["worker"] = draw(st.one_of(st.sampled_from(WORKERS), st.text(max_size=8)))
    if fields["type"] == "profile":
        fields["data"] = draw(_PROFILE)
    return fields


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(events(), min_size=1, max_size=4))
def test_arbitrary_field_values_never_raise_past_parsing(batch: list[dict[str, str]]) -> None:
    j = training_job()
    for fields in batch:
        reason = exercise(j, fields)
        assert reason is None or len(reason) <= MAX_REASON_LEN
