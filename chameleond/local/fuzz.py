"""Fuzzed event-stream entries for chaos trials: random types, worker ids and field values that a
buggy or hostile client could write (huge, negative, non-finite and non-numeric numbers,
non-UTF-8 bytes, megabyte values, thousands of fields, broken JSON).

They never name one of the job's workers in a `fault`, `register` or `rejoin`, nor stop one: such
an entry, well-formed, is a real fault or join, and the trial counts the job's real faults itself.
Everything else may name a real worker: a step, an ack or a profile with absurd numbers must be
refused without harm."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from chameleond.protocol import EVENT_TYPES

Fields = dict[bytes | str, bytes | str]

NUMBERS = ("-1", "0", "1", "1e300", "-1e300", "nan", "inf", "-inf", "9" * 400, "-" + "9" * 60,
           "1.5", "0x10", "", " 3", "abc", "18446744073709551617", "1e-320")  # fmt: skip
SAFE_FOR_REAL = ("heartbeat", "step", "ack", "checkpoint", "profile")


def _text(rng: random.Random) -> str | bytes:
    pick = rng.random()
    if pick < 0.15:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))  # likely not UTF-8
    if pick < 0.2:
        return "x" * rng.choice((1025, 70_000, 1_100_000))
    if pick < 0.3:
        return rng.choice(("", " ", "w 1", "\u00e9\u4e2d", "w\n0", "-", "*"))
    return "".join(rng.choice("abcdefxyz0123456789_-:.") for _ in range(rng.randrange(1, 24)))


def _number(rng: random.Random) -> str:
    return rng.choice(NUMBERS) if rng.random() < 0.8 else str(rng.randrange(-(10**6), 10**6))


def _profile(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.3:
        return "{not json" if rng.random() < 0.5 else json.dumps([1, 2, 3])
    layer = {
        k: rng.choice((1e300, -1.0, 0.0, 1e-9, 10**30, "x", None, float("nan")))
        for k in ("forward_seconds", "backward_seconds", "param_bytes", "optimizer_bytes",
                  "activation_bytes", "output_bytes")
    }  # fmt: skip
    if rng.random() < 0.5:
        layer["index"] = rng.choice((0, 1, -1, 10**9, "0"))
    return json.dumps({"layers": [layer] * rng.randrange(0, 12)}, allow_nan=True)


def fuzzed_entry(rng: random.Random, workers: Sequence[str]) -> Fields:
    kind = rng.choice((*EVENT_TYPES, *SAFE_FOR_REAL, "", "bogus", "FAULT"))
    real = kind in SAFE_FOR_REAL and rng.random() < 0.6
    worker: str | bytes = rng.choice(list(workers)) if real else "fz-" + str(_text(rng))[:60]
    fields: Fields = {"type": kind}
    if rng.random() < 0.95:
        fields["worker"] = worker
    for name in ("generation", "step", "samples", "seconds", "loss", "memory_bytes", "attempt",
                 "vote_seconds", "bytes", "stall_seconds"):  # fmt: skip
        if rng.random() < 0.4:
            fields[name] = _number(rng)
    if kind == "ack":
        phases = ("ready", "unrestorable", "", "bogus") if real else ("ready", "stopped", "x")
        fields["phase"] = rng.choice(phases)
    if kind in ("register", "profile") or rng.random() < 0.1:
        fields["host"] = _text(rng)
    if kind == "profile" or rng.random() < 0.05:
        fields["data"] = _profile(rng)
    if kind == "checkpoint" or rng.random() < 0.05:
        layers = ("0,1", "", "0,0,0", "999999999999", "a,b", "-1", "0," * 5000)
        fields["layers"] = rng.choice(layers)
    if rng.random() < 0.03:
        for i in range(rng.choice((100, 3000))):
            fields[f"extra{i}"] = "v"
    if rng.random() < 0.1:
        fields[_text(rng)] = _text(rng)
    return fields


def fuzzed_entries(rng: random.Random, n: int, workers: Sequence[str]) -> list[Fields]:
    return [fuzzed_entry(rng, workers) for _ in range(n)]
