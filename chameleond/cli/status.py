"""Show a job as the daemon persisted it in Redis: state, the current plan as pipelines x stages
(worker and layers of each slot, rerouted slots marked), the workers, and the last decisions with
both candidates' scores and the D used. Reads Redis only, so it works while the daemon is down."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any, cast

import redis

from chameleond.cli.inject import add_job, add_redis_url, redis_client
from chameleond.core.plan import Plan, PlanError, plan_from_dict
from chameleond.protocol import Keys, redact_url
from chameleond.records import DecisionRecord, read_record

LAST_DECISIONS = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_redis_url(parser)
    add_job(parser)
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _maybe_json(v: str) -> Any:
    try:
        return json.loads(v)
    except (json.JSONDecodeError, TypeError):
        return v


def collect(client: redis.Redis, job: str) -> dict[str, Any]:
    """Everything `status` shows, as plain data (the --json output)."""
    keys = Keys(job)
    state: dict[str, Any] = {
        str(k): _maybe_json(str(v)) for k, v in client.hgetall(keys.state).items()
    }
    plan_raw = client.get(keys.plan)
    plan: dict[str, Any] | None = None
    plan_error = None
    if plan_raw:
        try:
            plan = json.loads(plan_raw)
            plan_from_dict(plan or {})
        except (json.JSONDecodeError, PlanError) as e:
            plan_error = str(e)
    decisions = []
    # decode_responses=True: every id and field is a str (redis-py's stubs cannot say so).
    entries: list[tuple[str, dict[str, str]]] = cast(
        Any, client.xrevrange(keys.decisions, count=50 * LAST_DECISIONS)
    )
    for entry_id, fields in entries:
        d = read_record(entry_id, fields)
        if not isinstance(d, DecisionRecord):
            continue
        decisions.append(
            {
                "id": entry_id,
                "at": d.stored_at,
                "generation": d.generation,
                "selected": d.selected or None,
                "cause": d.cause,
                "failed": list(d.failed),
                "joined": list(d.joined),
                "mtbf_seconds": d.mtbf_seconds,
                "unrecoverable": d.unrecoverable or None,
                # worker -> the raw error behind a shortened cause (the record's `detail`)
                "detail": dict(d.detail),
                "candidates": [
                    {
                        k: c.get(k)
                        for k in (
                            "policy",
                            "feasible",
                            "reason",
                            "step_seconds",
                            "transition_seconds",
                            "score",
                        )
                    }
                    for c in d.candidates
                ],
            }
        )
    decisions = decisions[:LAST_DECISIONS]
    return {
        "job": job,
        "phase": phase(state),
        "state": state,
        "plan": plan,
        "plan_error": plan_error,
        "workers": _workers(state, plan),
        "waiting_faults": _waiting_faults(state),
        "decisions": decisions,
        "events_pending": client.xlen(keys.events) if client.exists(keys.events) else 0,
        "dead_letters": client.xlen(keys.dead) if client.exists(keys.dead) else 0,
    }


def _snapshot(state: Mapping[str, Any]) -> Mapping[str, Any]:
    snap = state.get("snapshot")
    return snap if isinstance(snap, dict) else {}


def _waiting_faults(state: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Faults received that no decision has answered yet (one sent before the workers registered
    waits for the initial plan), as the daemon last persisted them."""
    waiting = _snapshot(state).get("waiting_faults")
    return [f for f in waiting if isinstance(f, dict)] if isinstance(waiting, list) else []


def phase(state: Mapping[str, Any]) -> str:
    """The policy machine's phase as the daemon last persisted it."""
    machine = _snapshot(state).get("machine", {})
    return str(machine.get("phase", "unknown")) if isinstance(machine, dict) else "unknown"


def _workers(state: Mapping[str, Any], plan: Mapping[str, Any] | None) -> dict[str, str]:
    """Worker -> state: in the plan, excluded (failed or fenced), or registered and waiting."""
    snap = _snapshot(state)
    known = snap.get("workers", {}) if isinstance(snap.get("workers"), dict) else {}
    out = {
        str(w): "registered" if isinstance(d, dict) and d.get("registered") else "not registered"
        for w, d in known.items()
    }
    try:
        p = plan_from_dict(plan) if plan else None
    except PlanError:
        p = None
    if p is not None:
        out.update({w: "in plan" for w in p.workers})
        out.update({w: "excluded" for w in p.excluded})
    # A process that stopped cleanly says how (finished its steps, or left), as /api/v1/status.
    out.update(
        {str(w): d["ended"] for w, d in known.items() if isinstance(d, dict) and d.get("ended")}
    )
    return out


def render_plan(p: Plan) -> list[str]:
    """A row per pipeline, a column per stage: `worker[first-last]`; `*` marks a rerouted slot."""
    lines = []
    for i, pipe in enumerate(p.pipelines):
        cells = []
        for s, st in enumerate(pipe.stages):
            runners = (
                set(p.routing[i][s]) if i < len(p.routing) and s < len(p.routing[i]) else set()
            )
            mark = "*" if runners - {st.worker} else ""
            cells.append(f"{st.worker}[{st.first_layer}-{st.end_layer - 1}]{mark}")
        lines.append(f"  pipeline {i} ({pipe.micro_batches} micro-batches): " + "  ".join(cells))
    return lines


def _figure(v: Any, fmt: str) -> str:
    return "-" if not isinstance(v, int | float) or isinstance(v, bool) else format(v, fmt)


def training_line(progress: Any) -> str | None:
    """The last committed step and what its workers reported, from the persisted progress; None
    before the first step."""
    if not isinstance(progress, dict) or not isinstance(progress.get("step"), int):
        return None
    if progress["step"] < 0:
        return None
    p = progress
    line = (
        f"last step {p['step']} (generation {p.get('generation', '-')}): "
        f"loss {_figure(p.get('loss'), '.4f')}, grad norm {_figure(p.get('grad_norm'), '.4f')}, "
        f"lr {_figure(p.get('learning_rate'), '.4g')}, "
        f"{_figure(p.get('samples_per_second'), '.1f')} samples/s, "
        f"{_figure(p.get('tokens_per_second'), '.0f')} tokens/s"
    )
    if p.get("eval_loss") is not None:
        line += f"; eval loss {_figure(p.get('eval_loss'), '.4f')} after step {p.get('eval_step')}"
    return line


def _score(v: Any) -> str:
    return "-" if v is None else f"{float(v):.2f}"


def _print(s: Mapping[str, Any]) -> None:
    state = s["state"]
    print(f"job {s['job']}: state {s['phase']}", end="")
    print(f", generation {state.get('generation', '-')}")
    if s["plan_error"]:
        print(f"plan: unreadable ({s['plan_error']})")
    elif s["plan"]:
        p = plan_from_dict(s["plan"])
        est = p.estimates
        print(
            f"plan generation {p.generation} ({p.policy}): {len(p.pipelines)} pipelines, "
            f"estimated step {est.step_seconds:.3f} s, D {est.mtbf_seconds:.0f} s"
        )
        for line in render_plan(p):
            print(line)
        if p.excluded:
            print(f"  excluded: {', '.join(p.excluded)}")
    else:
        print("plan: none published yet")
    trained = training_line(state.get("progress"))
    if trained:
        print(trained)
    if s["workers"]:
        print("workers: " + ", ".join(f"{w} {st}" for w, st in sorted(s["workers"].items())))
    for f in s["waiting_faults"]:
        age = time.time() - float(f.get("received_at") or time.time())
        print(f"fault waiting for a decision: {f.get('worker')} ({f.get('cause')}), "
              f"received {age:.0f} s ago")  # fmt: skip
    print(f"events stream length {s['events_pending']}, dead letters {s['dead_letters']}")
    if s["decisions"]:
        print("last decisions (newest first):")
    for d in s["decisions"]:
        scores = ", ".join(
            f"{c['policy']} {_score(c.get('score'))}"
            + ("" if c.get("feasible", True) else f" (infeasible: {c.get('reason')})")
            for c in d["candidates"]
        )
        what = f"{d['selected'] or 'none'} for {d['cause'] or '-'}"
        if d["selected"] == "initial":
            what = "initial plan"
        shown = [scores] if scores else []
        if d["mtbf_seconds"] is not None:
            shown.append(f"D {d['mtbf_seconds']} s")
        print(
            f"  generation {d['generation']}: {what}"
            + (f" [{'; '.join(shown)}]" if shown else "")
            + (f" UNRECOVERABLE: {d['unrecoverable']}" if d["unrecoverable"] else "")
        )


def run(args: argparse.Namespace) -> int:
    client = redis_client(args.redis_url, "status")
    if client is None:
        return 2
    try:
        s = collect(client, args.job)
    except redis.RedisError as e:
        where = redact_url(args.redis_url)
        print(f"chameleonctl status: cannot read Redis at {where}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        _print(s)
    return 0
