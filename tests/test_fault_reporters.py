"""Who names a dead member in a fault: its first reporters at once (chameleond.protocol
.fault_reporters: a few survivors spread round the plan), every other survivor only when no newer
plan has come FAULT_FALLBACK_SECONDS later (chameleond/worker/_attribution.py), so that a host lost
from 8,192 workers is named a few times, not once by every survivor."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import given
from hypothesis import strategies as st

from chameleond.core.decide import initial_plan
from chameleond.core.spec import parse_spec
from chameleond.protocol import Keys, fault_reporters
from chameleond.redis_server import RedisServer
from chameleond.worker import _attribution
from chameleond.worker._attribution import Attribution
from chameleond.worker._backend import CollectiveFailed, DeviceChoice
from chameleond.worker._link import Reporter
from chameleond.worker._liveness import PeerNotices
from chameleond.worker._state import WorkerState

WORKERS = tuple(sorted(f"w{i}" for i in range(16)))  # w0 w1 w10 ... w15 w2 ... w9


def test_a_dead_member_is_named_by_live_members_spread_round_the_plan() -> None:
    # 16 workers: its reporters start 1, 1 + 5 and 1 + 10 places after it (16 // 3 = 5).
    assert fault_reporters(WORKERS, {"w3"}) == {"w3": ("w4", "w9", "w12")}
    # A host's workers die together: each is named from far apart, by survivors only.
    assert fault_reporters(WORKERS, {"w4", "w5", "w6"}) == {
        "w4": ("w7", "w0", "w13"), "w5": ("w7", "w1", "w14"), "w6": ("w7", "w10", "w15"),
    }  # fmt: skip
    # Round the end of the order.
    assert fault_reporters(WORKERS, {"w9"}) == {"w9": ("w0", "w13", "w4")}
    # Fewer survivors than reporters: all of them.
    assert fault_reporters(("a", "b", "c"), {"b"}) == {"b": ("c", "a")}
    assert fault_reporters(("a", "b"), {"a", "b"}) == {"a": (), "b": ()}
    # Who is gone but not a worker of the plan is nobody's to name.
    assert fault_reporters(WORKERS, {"w99"}) == {}


@given(
    st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=40, unique=True),
    st.data(),
)
def test_each_dead_member_has_its_reporters_among_the_survivors(
    names: list[str], data: st.DataObject
) -> None:
    workers = tuple(sorted(names))
    gone = set(data.draw(st.lists(st.sampled_from(workers), max_size=len(workers))))
    n = data.draw(st.integers(1, 5))
    named = fault_reporters(workers, gone, n)
    survivors = [w for w in workers if w not in gone]
    assert set(named) == gone
    ring = len(workers)
    for dead, reporters in named.items():
        assert len(reporters) == min(n, len(survivors)) == len(set(reporters))
        assert set(reporters) <= set(survivors)
        # The k-th: the first survivor not chosen yet from k/n of the way round after it.
        i = workers.index(dead)
        for k, reporter in enumerate(reporters):
            start = i + 1 + k * ring // n
            walk = [workers[(start + j) % ring] for j in range(ring)]
            assert reporter == next(w for w in walk if w not in gone and w not in reporters[:k])


def _spec(workers: int) -> dict[str, object]:
    layer = {"forward_seconds": 0.01, "backward_seconds": 0.02, "param_bytes": 8,
             "optimizer_bytes": 16, "activation_bytes": 1, "output_bytes": 1}  # fmt: skip
    hosts = [{"id": w, "host": f"h{i // 4}", "memory_bytes": 1 << 30}
             for i, w in enumerate(WORKERS[:workers])]  # fmt: skip
    return {
        "job": {"name": "fr"},
        "workers": hosts,
        "links": {
            "intra_host": {"bandwidth_bytes_per_second": 1e9, "latency_seconds": 1e-5},
            "inter_host": {"bandwidth_bytes_per_second": 1e8, "latency_seconds": 1e-4},
        },
        "model": {"layers": [layer, layer]},
        "training": {"global_batch": 16, "micro_batch": 1},
        "plan": {"pipelines": [list(WORKERS[i : i + 2]) for i in range(0, workers, 2)]},
    }


def _survivor(url: str, me: str, notices: PeerNotices) -> tuple[Attribution, Reporter]:
    reporter = Reporter(redis.Redis.from_url(url), "fr", me)
    reporter.start()
    return Attribution(notices, me, DeviceChoice("cpu", 0, "gloo"), reporter), reporter


def _named(client: redis.Redis, reporter: str) -> list[str]:
    entries = client.xrange(Keys("fr").events)
    return sorted(f["worker"] for _, f in entries if f.get("reporter") == reporter)


def test_survivors_name_at_once_only_what_they_are_first_reporters_of_and_the_rest_later(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """w11, w12 and w13 die together (a host) in a plan of 8 workers. w14 is a first reporter of
    all three and names them at once; w1 is one of w11's only, names it at once and the other two
    when no newer plan has come in the fallback time; w10, one of w12's, names it at once and
    nobody else: a newer plan came first."""
    monkeypatch.setattr(_attribution, "FAULT_FALLBACK_SECONDS", 0.5)
    plan = initial_plan(parse_spec(_spec(8)))
    assert plan.workers == ("w0", "w1", "w10", "w11", "w12", "w13", "w14", "w15")
    dead = ["w11", "w12", "w13"]
    assert fault_reporters(plan.workers, dead) == {
        "w11": ("w14", "w15", "w1"), "w12": ("w14", "w15", "w10"), "w13": ("w14", "w0", "w15"),
    }  # fmt: skip
    notices = PeerNotices("fr")
    notices.take(json.dumps({"gone": [[w, "1"] for w in dead], "live": [], "at": 0.0}))
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    state = WorkerState(None, torch.device("cpu"))  # type: ignore[arg-type]  # no layer held
    survivors = {w: _survivor(redis_server.url, w, notices) for w in ("w14", "w1", "w10")}
    try:
        for w, (blame, _) in survivors.items():
            assert blame.fault(plan, state, CollectiveFailed("peer reset")), w
        time.sleep(0.3)
        assert _named(client, "w14") == dead
        assert _named(client, "w1") == ["w11"]
        assert _named(client, "w10") == ["w12"]
        blame_w1, blame_w10 = survivors["w1"][0], survivors["w10"][0]
        blame_w1.overdue(plan.generation)  # not due yet
        blame_w10.overdue(plan.generation + 1)  # a newer plan answered the faults
        time.sleep(0.6)
        blame_w1.overdue(plan.generation)
        blame_w10.overdue(plan.generation + 1)
        time.sleep(0.3)
        assert _named(client, "w1") == dead  # the fallback: nobody answered in time
        assert _named(client, "w10") == ["w12"]
        faults = [f for _, f in client.xrange(Keys("fr").events) if f.get("reporter") == "w1"]
        assert {f["generation"] for f in faults} == {str(plan.generation)}
    finally:
        for _, reporter in survivors.values():
            reporter.close(2.0)
        client.close()
