"""The status page at `/`: one server-rendered HTML document, no script, refreshed by the browser
(meta refresh). What it shows comes from the same views as /api/v1/status plus the job's streams
(last decisions, recent events, dead letters). Worker ids, causes and event fields are written by
clients into Redis: every value is escaped before it reaches the page.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chameleond.core.plan import Plan
from chameleond.records import DecisionRecord

REFRESH_SECONDS = 2
Entry = tuple[str, Mapping[str, str]]


@dataclass
class PageData:
    status: Mapping[str, Any]
    plan: Plan | None
    decisions: Sequence[DecisionRecord] = ()  # newest first
    events: Sequence[Entry] = ()  # newest first
    dead: Sequence[Entry] = ()  # newest first
    errors: list[str] = field(default_factory=list)  # what could not be read (Redis down)


def e(value: Any) -> str:
    """Escape anything for HTML text and attribute values."""
    return html.escape("" if value is None else str(value), quote=True)


def _num(v: Any, digits: int = 2) -> str:
    return "-" if v is None else f"{float(v):.{digits}f}"


def _figure(v: Any) -> str:
    """A number of any magnitude (a learning rate of 3e-4) with 4 significant digits."""
    return "-" if v is None else f"{float(v):.4g}"


def _eval(progress: Mapping[str, Any]) -> str:
    loss = progress.get("eval_loss")
    if loss is None:
        return "none yet"
    return f"{_num(loss, 4)} (after step {e(progress.get('eval_step'))})"


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .3em} h2{font-size:1.1em;margin:1.4em 0 .4em}
table{border-collapse:collapse;background:#fff} td,th{border:1px solid #ccc;padding:.3em .6em;
text-align:left;vertical-align:top} th{background:#eee}
.state{display:inline-block;padding:.1em .6em;border-radius:.3em;color:#fff;background:#777}
.training{background:#2a7d2a}.transitioning,.planning{background:#c77f00}
.fault_detected,.unrecoverable{background:#b22}.waiting{background:#557}
.slow{color:#b22;font-weight:bold}
.slot{font-family:monospace}.rerouted{background:#fff3d0}
.active{color:#2a7d2a}.failed,.fenced,.lost{color:#b22}.chosen{font-weight:bold}
.muted{color:#777}.err{color:#b22;font-weight:bold}
"""


def render(d: PageData) -> str:
    s = d.status
    job = s.get("job", "")
    if s.get("standby"):
        body = f"<p>This daemon stands by: the job is led by <b>{e(s.get('leader'))}</b>.</p>"
    else:
        body = "".join(
            [
                _summary(s),
                _errors(d.errors),
                _plan(d.plan),
                _workers(s),
                _waiting(s),
                _decisions(d.decisions),
                _entries("Recent events", d.events, "no events in the stream"),
                _entries("Dead letters", d.dead, "none"),
            ]
        )
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'
        f"<title>chameleond: {e(job)}</title><style>{STYLE}</style></head><body>"
        f"<h1>chameleond: job {e(job)}</h1>{body}"
        f"<p class=muted>Rendered {e(now)}; refreshes every {REFRESH_SECONDS} s. "
        '<a href="/api/v1/status">status JSON</a> · <a href="/api/v1/plan">plan JSON</a> · '
        '<a href="/metrics">metrics</a></p></body></html>'
    )


def _summary(s: Mapping[str, Any]) -> str:
    state = str(s.get("state", "unknown"))
    prog = s.get("progress") or {}
    step = prog.get("step")
    rows = [
        ("State", f'<span id=state class="state {e(state)}">{e(state)}</span>'),
        ("Generation", e(s.get("generation"))),
        ("Policy", e(s.get("policy")) + f" (current plan: {e(s.get('plan_policy') or '-')})"),
        ("Step", e(step) if isinstance(step, int) and step >= 0 else "none committed yet"),
        ("Loss", _num(prog.get("loss"), 4)),
        ("Gradient norm", _num(prog.get("grad_norm"), 4)),
        ("Learning rate", _figure(prog.get("learning_rate"))),
        (
            "Throughput (samples/s)",
            f"measured {_num(prog.get('samples_per_second'), 1)}, estimated "
            f"{_num(s.get('estimated_samples_per_second'), 1)}",
        ),
        ("Throughput (tokens/s)", _num(prog.get("tokens_per_second"), 0)),
        ("Eval loss", _eval(prog)),
        ("D (expected s to next fault)", _num(s.get("mtbf_seconds"), 0)),
        ("Window (expected s to next fault or return)", _num(s.get("window_seconds"), 0)),
        ("Workers registered", f"{e(s.get('workers_registered'))} of {e(s.get('workers_needed'))}"),
    ]
    return _table(("", ""), rows, header=False, id_="summary")


def _errors(errors: Iterable[str]) -> str:
    return "".join(f"<p class=err>{e(x)}</p>" for x in errors)


def _plan(plan: Plan | None) -> str:
    if plan is None:
        return "<h2>Plan</h2><p id=plan>No plan yet: waiting for the workers to register.</p>"
    width = max(len(p.stages) for p in plan.pipelines)
    head = ["pipeline", "micro-batches", *(f"stage {i}" for i in range(width))]
    rows = []
    for i, pipe in enumerate(plan.pipelines):
        cells = [str(i), f"{pipe.micro_batches}"]
        for s, st in enumerate(pipe.stages):
            routed = i < len(plan.routing) and s < len(plan.routing[i])
            runners = plan.routing[i][s] if routed else ()
            others = [w for w in runners if w != st.worker]
            extra = f"<br>run by {e(', '.join(others))}" if others else ""
            cls = "slot rerouted" if others else "slot"
            cells.append(
                f'<span class="{cls}">{e(st.worker)}<br>layers {st.first_layer}-'
                f"{st.end_layer - 1}{extra}</span>"
            )
        cells += [""] * (width - len(pipe.stages))
        rows.append(cells)
    est = plan.estimates
    caption = (
        f"<p>Generation {plan.generation}, policy <b>{e(plan.policy)}</b>: "
        f"{len(plan.pipelines)} pipelines, estimated step {est.step_seconds:.3f} s"
        + (f"; excluded: {e(', '.join(plan.excluded))}" if plan.excluded else "")
        + (f"; cause: {e(plan.cause)}" if plan.cause else "")
        + "</p>"
    )
    return "<h2>Plan</h2>" + caption + _table(head, rows, id_="plan")


def _workers(s: Mapping[str, Any]) -> str:
    rows = []
    slow = s.get("slow") or {}
    for wid, w in (s.get("workers") or {}).items():
        state = str(w.get("state"))
        age = w.get("heartbeat_age_seconds")
        speed = (slow.get(wid) or {}).get("speed")
        slowed = speed is not None and speed < 1
        pace = f" <span class=slow>speed {_num(speed)}</span>" if slowed else ""
        rows.append(
            [
                e(wid),
                f'<span class="{e(state)}">{e(state)}</span>{pace}',
                e(w.get("host")),
                e(w.get("device")),
                "-" if age is None else f"{float(age):.1f} s",
            ]
        )
    head = ("worker", "health", "host", "device", "last heartbeat")
    return "<h2>Workers</h2>" + _table(head, rows, id_="workers")


def _waiting(s: Mapping[str, Any]) -> str:
    faults = s.get("waiting_faults") or []
    if not faults:
        return ""
    rows = [
        [e(f.get("worker")), e(f.get("cause")), f"{float(f.get('age_seconds') or 0):.1f} s ago"]
        for f in faults
    ]
    head = ("worker", "cause", "received")
    return "<h2>Faults waiting for a decision</h2>" + _table(head, rows, id_="waiting")


def _decisions(decisions: Sequence[DecisionRecord]) -> str:
    if not decisions:
        return "<h2>Last decisions</h2><p id=decisions>None yet.</p>"
    rows = []
    for d in decisions:
        scores = []
        for c in d.candidates:
            policy = str(c.get("policy"))
            cls = " class=chosen" if policy == d.selected else ""
            if c.get("feasible") is False:
                text = f"{e(policy)}: infeasible ({e(c.get('reason'))})"
            else:
                text = (
                    f"{e(policy)}: score {_num(c.get('score'))}, step "
                    f"{_num(c.get('step_seconds'), 3)} s, transition "
                    f"{_num(c.get('transition_seconds'), 2)} s"
                )
            scores.append(f"<span{cls}>{text}</span>")
        chosen = e(d.selected or "none")
        if d.unrecoverable:
            chosen += f"<br><span class=err>unrecoverable: {e(d.unrecoverable)}</span>"
        rows.append(
            [
                time.strftime("%H:%M:%S", time.gmtime(d.at)),
                e(d.generation),
                e(d.cause),
                f"<b>{chosen}</b>",
                "<br>".join(scores) or "-",
                _num(d.mtbf_seconds, 0),
            ]
        )
    head = ("time (UTC)", "generation", "cause", "chosen policy", "candidates", "D (s)")
    return "<h2>Last decisions</h2>" + _table(head, rows, id_="decisions")


def _entries(title: str, entries: Sequence[Entry], empty: str) -> str:
    slug = title.lower().replace(" ", "-")
    if not entries:
        return f"<h2>{e(title)}</h2><p id={slug} class=muted>{e(empty)}</p>"
    rows = [[e(i), e(" ".join(f"{k}={v}" for k, v in f.items()))] for i, f in entries]
    return f"<h2>{e(title)}</h2>" + _table(("entry", "fields"), rows, id_=slug)


def _table(
    head: Sequence[str], rows: Iterable[Sequence[str]], *, id_: str, header: bool = True
) -> str:
    """Rows are HTML already (their values escaped by the caller); head cells are escaped here."""
    out = [f"<table id={id_}>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>")
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>")
    out.append("</table>")
    return "".join(out)
