"""What the daemon's Redis streams carry, as seen from outside the daemon: stream entry times, the
decisions stream's records (written by `chameleond.daemon.decisions`, read by the status page,
`chameleonctl status` and the local tools), and the `redis-cli` line that reports a fault.

A Redis stream entry id is the millisecond at which Redis stored the entry, so times read here
trust no process's clock but Redis's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from chameleond.auth import Keyring
from chameleond.protocol import Keys
from chameleond.redis_server import redis_binary

Entry = tuple[str, Mapping[str, str]]  # (stream entry id, fields)


def entry_seconds(entry_id: str) -> float:
    """Unix seconds of a stream entry id `<ms>-<seq>`."""
    ms, _, _ = entry_id.partition("-")
    return int(ms) / 1000.0


@dataclass(frozen=True)
class DecisionRecord:
    at: float  # when the daemon recorded it (entry id)
    generation: int | None
    selected: str | None
    failed: tuple[str, ...]  # every worker out, this decision's faults and earlier ones
    joined: tuple[str, ...]  # the workers offered back: new joins and those on standby
    cause: str
    mtbf_seconds: float | None
    candidates: tuple[Mapping[str, Any], ...]
    step_seconds_estimate: float | None  # the selected plan's estimate
    received_at: float | None  # when the daemon received the fault that triggered it, if recorded
    unrecoverable: str | None
    raw: Mapping[str, Any] = field(default_factory=dict)
    faults: tuple[str, ...] = ()  # the new faults this decision answers
    unrestorable: tuple[str, ...] = ()  # workers that could not load the restore it replaces


def number(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _json(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def _ids(v: Any) -> tuple[str, ...]:
    v = _json(v)
    if isinstance(v, str):
        return tuple(x for x in v.replace(",", " ").split() if x)
    if isinstance(v, list | tuple):
        return tuple(str(x) for x in v)
    return ()


def is_decision(fields: Mapping[str, str]) -> bool:
    """The decisions stream also records the policy machine's phase transitions; skip those."""
    return fields.get("kind", "decision") == "decision"


def parse_decision(entry_id: str, fields: Mapping[str, str]) -> DecisionRecord:
    """Read one decisions-stream entry: flat fields, optionally with the whole decision as JSON."""
    doc: dict[str, Any] = {}
    for key in ("decision", "data", "record"):
        if key in fields and isinstance(_json(fields[key]), dict):
            doc = dict(_json(fields[key]))
            break
    merged: dict[str, Any] = {**doc, **{k: v for k, v in fields.items() if k not in doc}}
    cands_raw = _json(merged.get("candidates", []))
    candidates = (
        tuple(c for c in cands_raw if isinstance(c, dict)) if isinstance(cands_raw, list) else ()
    )
    plan = _json(merged.get("plan"))
    selected = merged.get("selected") or merged.get("policy") or None
    estimate = None
    if isinstance(plan, dict):
        estimate = number((plan.get("estimates") or {}).get("step_seconds"))
    if estimate is None:
        for c in candidates:
            if c.get("policy") == selected:
                estimate = number(c.get("step_seconds"))
    if estimate is None:  # a plan that is neither candidate (restore): the record says it
        estimate = number(merged.get("step_seconds"))
    generation = merged.get("generation")
    if generation is None and isinstance(plan, dict):
        generation = plan.get("generation")
    # The daemon records when it decided (`at`) and how long since the fault reached it.
    at, took = number(merged.get("at")), number(merged.get("decision_seconds"))
    received = at - took if at is not None and took is not None else None
    return DecisionRecord(
        at=entry_seconds(entry_id),
        generation=int(generation) if generation not in (None, "") else None,
        selected=str(selected) if selected else None,
        failed=_ids(merged.get("failed", ())),
        joined=_ids(merged.get("joined", ())),
        cause=str(merged.get("cause", "")),
        mtbf_seconds=number(merged.get("mtbf_seconds")),
        candidates=candidates,
        step_seconds_estimate=estimate,
        received_at=received,
        unrecoverable=str(merged["unrecoverable"]) if merged.get("unrecoverable") else None,
        raw=merged,
        faults=_ids(merged.get("faults", merged.get("failed", ()))),
        unrestorable=_ids(merged.get("unrestorable", ())),
    )


_TLS_FLAGS = {
    "ssl_ca_certs": "--cacert",
    "ssl_ca_path": "--cacertdir",
    "ssl_certfile": "--cert",
    "ssl_keyfile": "--key",
}


def redis_cli_args(
    redis_url: str, job: str, worker: str, cause: str, keyring: Keyring | None = None
) -> list[str]:
    """The argv of the redis-cli line an operator would type to report a fault; with the job's
    keyring it carries the event's signature (`sig`, docs/security.md).

    redis-cli reads neither a URL's query nor TLS settings in it: a rediss:// URL's certificates
    become --tls flags, and the query is dropped.
    """
    url = urlsplit(redis_url)
    cli = [redis_binary("redis-cli", tls=url.scheme == "rediss")]
    if url.scheme == "rediss":
        cli.append("--tls")
        for key, value in parse_qsl(url.query):
            if key in _TLS_FLAGS:
                cli += [_TLS_FLAGS[key], value]
            elif key == "ssl_cert_reqs" and value.lower() == "none":
                cli.append("--insecure")
    cli += ["-u", urlunsplit(url._replace(query="", fragment=""))]
    event = {"type": "fault", "worker": worker, "cause": cause}
    if keyring is not None:
        event = keyring.sign_event(job, event)
    return [*cli, "XADD", Keys(job).events, "*", *(x for kv in event.items() for x in kv)]
