"""Print a job's committed steps as its workers reported them: one line per step (every worker of
the plan reports each step; it is printed once), with its loss, gradient norm, learning rate,
samples and tokens per second, and the held-out loss after an evaluation.

Reads the job's events stream (chameleon:JOB:events) with XREVRANGE and XREAD, never through the
daemon's consumer group: it takes nothing from the daemon and works beside it or without it, for
any job on any Redis. The stream holds what the daemon has not trimmed yet (`stream_maxlen`, about
100,000 entries). Each step event is checked with the job's secret (--secret-file,
$CHAMELEON_SECRET_FILE or $CHAMELEON_SECRET) and parsed as the daemon parses it; an unsigned,
forged or malformed one is left out and named on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from chameleond.auth import SECRET_FILE_ENV, AuthError, Keyring
from chameleond.cli.inject import add_job, add_redis_url, redis_client
from chameleond.cli.status import phase
from chameleond.core.plan import PlanError, plan_from_dict
from chameleond.events import Step
from chameleond.protocol import JOB_ENV, EventError, Keys, read_event, redact_url
from chameleond.records import entry_seconds

PAGE = 2000  # stream entries per read
BLOCK_MS = 1000  # --follow: how long one XREAD waits
SHOWN_REFUSALS = 5  # refused entries named one by one on stderr; the rest are counted
COLUMNS = ("step", "generation", "loss", "grad_norm", "lr", "samples/s", "tokens/s", "eval_loss")
WIDTH = 10

Key = tuple[int, int]  # (generation, step): the order steps commit in, across restores
Members = Callable[[int], frozenset[str] | None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_redis_url(parser)
    add_job(parser)
    parser.add_argument(
        "--last",
        type=_count,
        default=20,
        metavar="N",
        help="the newest N steps (default: %(default)s; 0: every step still in the stream)",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="then print each step as it commits, until the job is finished (or Ctrl-C or "
        "SIGTERM: the step still open is printed)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--secret-file",
        default="",
        help=f"the job's secret, to check the events' signatures (default ${SECRET_FILE_ENV}, "
        "else $CHAMELEON_SECRET; docs/security.md)",
    )


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 or more")
    return n


# ---- the steps, from step reports (no I/O) -------------------------------------------------------


@dataclass
class CommittedStep:
    """One step as its workers reported it: the figures of its first report (the same in every
    report), its time the slowest reporter's (as the daemon's throughput meter measures it)."""

    first: Step
    at: float  # when Redis stored the first report
    seconds: float = 0.0
    workers: set[str] = field(default_factory=set)

    @property
    def key(self) -> Key:
        return (self.first.generation, self.first.step)

    def add(self, report: Step) -> None:
        self.seconds = max(self.seconds, report.seconds)
        self.workers.add(report.worker)

    def _rate(self, amount: int | None) -> float | None:
        return amount / self.seconds if amount is not None and self.seconds > 0 else None

    @property
    def samples_per_second(self) -> float | None:
        return self._rate(self.first.samples)

    @property
    def tokens_per_second(self) -> float | None:
        return self._rate(self.first.tokens)

    def to_json(self) -> dict[str, Any]:
        s = self.first
        return {
            "generation": s.generation,
            "step": s.step,
            "at": self.at,
            "loss": s.loss,
            "grad_norm": s.grad_norm,
            "learning_rate": s.learning_rate,
            "samples": s.samples,
            "skipped_samples": s.skipped_samples,
            "tokens": s.tokens,
            "seconds": self.seconds,
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
            "overflow": s.overflow,
            "loss_scale": s.loss_scale,
            "eval_loss": s.eval_loss,
            "workers": len(self.workers),
        }

    def row(self) -> str:
        s = self.first
        cells = (
            str(s.step),
            str(s.generation),
            _fmt(s.loss, ".4f"),
            _fmt(s.grad_norm, ".4g"),
            _fmt(s.learning_rate, ".3g"),
            _fmt(self.samples_per_second, ".1f"),
            _fmt(self.tokens_per_second, ".0f"),
            _fmt(s.eval_loss, ".4f"),
        )
        return _line(cells)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _line(cells: Iterable[str]) -> str:
    return "  ".join(c.rjust(max(WIDTH, len(h))) for c, h in zip(cells, COLUMNS, strict=True))


HEADER = _line(COLUMNS)


class StepFold:
    """Step reports, in stream order, into committed steps, each once and in order. A step is
    complete when every worker of its generation's plan has reported it (when that plan is
    known: `members`), or once a later step is reported; `flush` completes the rest. A report
    of a step already complete is a late copy, and changes nothing."""

    def __init__(self, members: Members) -> None:
        self.members = members
        self.open: dict[Key, CommittedStep] = {}
        self.done: Key = (0, -1)  # the newest step completed

    def add(self, entry_id: str, report: Step) -> list[CommittedStep]:
        key = (report.generation, report.step)
        if key <= self.done:
            return []
        step = self.open.get(key)
        if step is None:
            step = self.open[key] = CommittedStep(report, entry_seconds(entry_id))
        step.add(report)
        out = [self.open.pop(k) for k in sorted(self.open) if k < key]  # a later step came
        members = self.members(report.generation)
        if members and members <= step.workers:
            out.append(self.open.pop(key))
        if out:
            self.done = out[-1].key
        return out

    def flush(self) -> list[CommittedStep]:
        out = [self.open.pop(k) for k in sorted(self.open)]
        if out:
            self.done = out[-1].key
        return out


# ---- reading the stream ------------------------------------------------------------------------


class StepReader:
    """The job's step reports from its events stream, checked and parsed; refusals counted."""

    def __init__(self, client: redis.Redis, job: str, keyring: Keyring | None) -> None:
        self.client = client  # decode_responses=False: entries as written, any bytes
        self.job = job
        self.keys = Keys(job)
        self.keyring = keyring
        self.refused = 0
        self._plan: tuple[int, frozenset[str]] | None = None  # the newest plan read
        self._asked = 0  # the newest generation the plan key was read for

    def report(self, entry_id: str, fields: dict[bytes, bytes]) -> Step | None:
        """The entry's step event, or None (another type, or refused)."""
        if fields.get(b"type") != b"step":
            return None
        try:
            event = read_event(fields, self.job, self.keyring)
        except AuthError as e:
            self._refuse(entry_id, f"refused: {e}")
            return None
        except EventError as e:
            self._refuse(entry_id, str(e))
            return None
        return event if isinstance(event, Step) else None

    def _refuse(self, entry_id: str, why: str) -> None:
        self.refused += 1
        if self.refused <= SHOWN_REFUSALS:
            print(f"chameleonctl steps: entry {entry_id} left out: {why}", file=sys.stderr)
        if self.refused == SHOWN_REFUSALS + 1:
            print("chameleonctl steps: more entries left out are only counted", file=sys.stderr)

    def newest(self, steps: int) -> tuple[list[tuple[str, Step]], str]:
        """Step reports of the newest `steps` steps (0: all the stream holds), oldest first, and
        the id of the newest entry read ("0-0": none). Read backwards a page at a time, until
        more steps than asked for are in hand: the oldest of them may lie partly further back."""
        found: list[tuple[str, Step]] = []
        keys: set[Key] = set()
        newest = "0-0"
        high: str | None = "+"
        while high is not None:
            page = cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                self.client.xrevrange(self.keys.events, high, "-", count=PAGE),
            )
            for entry_id, fields in page:
                eid = entry_id.decode()
                newest = eid if newest == "0-0" else newest
                report = self.report(eid, fields)
                if report is not None:
                    found.append((eid, report))
                    keys.add((report.generation, report.step))
            if len(page) < PAGE or (steps and len(keys) > steps + 1):
                break
            high = _before(page[-1][0].decode())
        found.reverse()
        return found, newest

    def after(self, entry_id: str) -> tuple[list[tuple[str, Step]], str]:
        """Step reports written after `entry_id`, waiting up to BLOCK_MS for the first."""
        got = cast(
            list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]],
            self.client.xread({self.keys.events: entry_id}, count=PAGE, block=BLOCK_MS),
        )
        found = []
        last = entry_id
        for _, entries in got or []:
            for raw_id, fields in entries:
                last = raw_id.decode()
                report = self.report(last, fields)
                if report is not None:
                    found.append((last, report))
        return found, last

    def members(self, generation: int) -> frozenset[str] | None:
        """The workers of `generation`'s plan, when it is the job's current (signed) plan."""
        if generation > self._asked:  # once per generation: a job may have no plan at all
            self._asked = generation
            self._plan = self._read_plan() or self._plan
        if self._plan is not None and self._plan[0] == generation:
            return self._plan[1]
        return None

    def _read_plan(self) -> tuple[int, frozenset[str]] | None:
        raw = self.client.get(self.keys.plan)
        if not raw:
            return None
        try:
            doc = json.loads(cast(bytes, raw))
            if self.keyring is not None:
                self.keyring.verify_doc("plan", self.job, doc)
            plan = plan_from_dict(doc)
        except (ValueError, AuthError, PlanError, AttributeError, TypeError):
            return None  # unreadable or unsigned: the steps complete by their successors
        return plan.generation, frozenset(plan.workers)


def _before(entry_id: str) -> str | None:
    """The greatest stream id below `entry_id` (an exclusive bound for Redis before 6.2)."""
    ms, _, seq = entry_id.partition("-")
    if int(seq) > 0:
        return f"{ms}-{int(seq) - 1}"
    if int(ms) > 0:
        return f"{int(ms) - 1}-{2**64 - 1}"
    return None


# ---- the command -------------------------------------------------------------------------------


class Printer:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.header = not as_json

    def __call__(self, steps: Iterable[CommittedStep]) -> None:
        for s in steps:
            if self.header:
                print(HEADER)
                self.header = False
            print(json.dumps(s.to_json()) if self.as_json else s.row(), flush=True)


def run(args: argparse.Namespace) -> int:
    client = redis_client(args.redis_url, "steps", decode=False)
    if client is None:
        return 2
    try:
        keyring = Keyring.configured(os.environ, args.secret_file)
    except AuthError as e:
        client.close()
        print(f"chameleonctl steps: {e}", file=sys.stderr)
        return 2
    if keyring is None:
        print(
            "chameleonctl steps: warning: no secret, the events' signatures go unchecked",
            file=sys.stderr,
        )
    reader = StepReader(client, args.job, keyring)
    show = Printer(args.json)
    try:
        return _show(reader, args, show, lambda: job_phase(client, args.job))
    except redis.RedisError as e:
        where = redact_url(args.redis_url)
        print(f"chameleonctl steps: cannot read Redis at {where}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `| head`: the reader has seen enough
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    finally:
        client.close()
        if reader.refused:
            print(
                f"chameleonctl steps: {reader.refused} step entries left out (unsigned, forged "
                "or malformed)",
                file=sys.stderr,
            )


def job_phase(client: redis.Redis, job: str) -> str:
    """The job's phase as its daemon last persisted it (`finished` once every worker has)."""
    raw = client.hget(Keys(job).state, "snapshot")
    try:
        return phase({"snapshot": json.loads(raw)}) if raw else "unknown"
    except json.JSONDecodeError:
        return "unknown"


def _show(
    reader: StepReader, args: argparse.Namespace, show: Printer, current_phase: Callable[[], str]
) -> int:
    fold = StepFold(reader.members)
    reports, last_id = reader.newest(args.last)
    done = [s for entry_id, report in reports for s in fold.add(entry_id, report)]
    if not args.follow:
        done += fold.flush()
    show(done[-args.last :] if args.last else done)
    if not args.follow:
        if not done:
            print(f"no steps in {Keys(args.job).events}", file=sys.stderr)
        return 0
    if not done:
        print(
            f"no steps of job {args.job} yet, waiting (--job or ${JOB_ENV} names the job)",
            file=sys.stderr,
        )
    try:
        with _ended_by_signals():
            return _follow(reader, args, show, current_phase, fold, last_id)
    except KeyboardInterrupt:
        show(fold.flush())
        return 0


def _follow(
    reader: StepReader,
    args: argparse.Namespace,
    show: Printer,
    current_phase: Callable[[], str],
    fold: StepFold,
    last_id: str,
) -> int:
    while True:
        try:
            reports, last_id = reader.after(last_id)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            print(f"chameleonctl steps: Redis: {e}; retrying", file=sys.stderr)
            time.sleep(1.0)
            continue
        for entry_id, report in reports:
            show(fold.add(entry_id, report))
        if not reports and current_phase() == "finished":
            show(fold.flush())
            print(f"job {args.job} finished", file=sys.stderr)
            return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextmanager
def _ended_by_signals() -> Iterator[None]:
    """SIGINT (Ctrl-C) and SIGTERM (a supervisor's stop) end a follow as KeyboardInterrupt, the
    open step printed, also in a process started with SIGINT ignored (what a shell script's
    background command inherits), as the daemon and `chameleonctl up` take them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ended = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _interrupt) for sig in ended}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
