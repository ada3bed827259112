"""The `--faults SPEC` grammar of `chameleonctl up`, and the two ways a fault is injected.

    SPEC   := FAULT ("," FAULT)*
    FAULT  := ACTION ":" WORKER "@" WHEN [":" CAUSE]
    ACTION := "kill"        kill -9 of the worker's process (the daemon must detect it)
            | "event"       a fault event sent exactly as `redis-cli XADD` would send it
            | "corrupt"     the worker's newest checkpoint file cut to half its length (a torn
                            write, a bad disk): no worker is out, but a restore of that step
                            cannot read those layers (needs --checkpoint-every)
    WHEN   := "step=" INT   once step INT has committed
            | "t=" NUMBER ["s" | "ms"]   seconds (or ms) after training's first committed step

Examples: `kill:w4@step=4,kill:w1@step=12`, `event:w2@t=20:ECC error on HBM`,
`corrupt:w0@step=12,kill:w0@step=12`. A CAUSE may hold
spaces but no comma. Parsing is pure; `parse_faults` raises `FaultSpecError` with the offending
part, so a typo is one clear line, never a trace.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from chameleond.auth import Keyring
from chameleond.protocol import MAX_ID_LEN
from chameleond.redis_server import redis_cli_args

DEFAULT_CAUSES = {
    "kill": "kill -9 (injected)",
    "event": "fault event (injected)",
    "corrupt": "checkpoint file cut short (injected)",
}
ACTIONS = tuple(DEFAULT_CAUSES)
_FAULT = re.compile(
    r"^(?P<action>[a-z]+):(?P<worker>[^@:,\s]+)@(?P<when>[a-z]+=[^:]+)(?::(?P<cause>.*))?$"
)
_SECONDS = re.compile(r"^(?P<num>\d+(?:\.\d+)?)(?P<unit>s|ms)?$")


class FaultSpecError(ValueError):
    """The --faults text does not parse; the message quotes the bad part."""


@dataclass(frozen=True)
class Fault:
    action: str  # "kill" | "event"
    worker: str
    at_step: int | None = None  # fire once this step has committed ...
    at_seconds: float | None = None  # ... or this long after the first committed step
    cause: str = ""

    @property
    def when(self) -> str:
        return f"step={self.at_step}" if self.at_step is not None else f"t={self.at_seconds:g}s"

    def default_cause(self) -> str:
        if self.cause:
            return self.cause
        return DEFAULT_CAUSES[self.action]

    def due(self, committed_step: int | None, seconds_since_first_step: float | None) -> bool:
        if self.at_step is not None:
            return committed_step is not None and committed_step >= self.at_step
        assert self.at_seconds is not None
        return seconds_since_first_step is not None and seconds_since_first_step >= self.at_seconds


def _parse_one(text: str) -> Fault:
    m = _FAULT.match(text)
    if not m:
        raise FaultSpecError(
            f"{text!r}: expected ACTION:WORKER@WHEN[:CAUSE], e.g. kill:w3@step=5 or event:w1@t=20s"
        )
    action, worker, when = m["action"], m["worker"], m["when"]
    if action not in ACTIONS:
        raise FaultSpecError(f"{text!r}: action {action!r} is not one of {', '.join(ACTIONS)}")
    if len(worker) > MAX_ID_LEN:
        raise FaultSpecError(f"{text!r}: worker id longer than {MAX_ID_LEN}")
    key, _, value = when.partition("=")
    cause = (m["cause"] or "").strip()
    if key == "step":
        if not value.isdigit():
            raise FaultSpecError(f"{text!r}: step must be a non-negative integer, got {value!r}")
        return Fault(action, worker, at_step=int(value), cause=cause)
    if key == "t":
        sm = _SECONDS.match(value)
        if not sm:
            raise FaultSpecError(f"{text!r}: t must be seconds like 20, 2.5s or 800ms")
        seconds = float(sm["num"]) / (1000.0 if sm["unit"] == "ms" else 1.0)
        return Fault(action, worker, at_seconds=seconds, cause=cause)
    raise FaultSpecError(f"{text!r}: WHEN must be step=N or t=SECONDS, got {when!r}")


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse a --faults SPEC; an empty spec means no faults."""
    parts = [p.strip() for p in spec.split(",")]
    if spec.strip() == "":
        return ()
    if any(not p for p in parts):
        raise FaultSpecError(f"{spec!r}: empty fault between commas")
    return tuple(_parse_one(p) for p in parts)


def check_workers(faults: Sequence[Fault], workers: Sequence[str]) -> None:
    """Every fault must name a worker the local cluster runs."""
    known = set(workers)
    for f in faults:
        if f.worker not in known:
            raise FaultSpecError(
                f"{f.action}:{f.worker}@{f.when}: no worker {f.worker!r} "
                f"(the cluster runs {', '.join(workers)})"
            )


def corrupt_newest_checkpoint(directory: Path, worker: str) -> Path | None:
    """Cut the worker's newest checkpoint file to half its length; the file, or None when the
    worker has written none. Files are named `{worker}-{step:09d}.safetensors`
    (chameleond.worker._checkpoint.checkpoint_path), so the newest sorts last."""
    files = sorted(directory.glob(f"{worker}-[0-9]*.safetensors"))
    if not files:
        return None
    newest = files[-1]
    with newest.open("r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    return newest


# redis-py's TLS settings in a rediss:// URL's query, and the redis-cli flags that say the same.
def send_fault_event(
    redis_url: str, job: str, worker: str, cause: str, keyring: Keyring | None = None
) -> str:
    """XADD a fault event through redis-cli itself; returns the stream entry id."""
    proc = subprocess.run(  # noqa: S603 - argv of redis-cli built here, no shell
        redis_cli_args(redis_url, job, worker, cause, keyring),
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    out = proc.stdout.strip()
    if proc.returncode != 0 or not re.fullmatch(r"\d+-\d+", out):
        raise RuntimeError(f"redis-cli XADD failed: {(proc.stderr or out).strip()}")
    return out
