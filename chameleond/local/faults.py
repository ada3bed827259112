"""The `--faults SPEC` grammar of `chameleonctl up`, and the two ways a fault is injected.

    SPEC   := FAULT ("," FAULT)*
    FAULT  := ACTION ":" WORKER "@" WHEN [":" CAUSE]
            | "slow:" WORKER "@" WHEN ":" FACTOR [":" SECONDS]
    ACTION := "kill"        kill -9 of the worker's process (the daemon must detect it)
            | "event"       a fault event sent exactly as `redis-cli XADD` would send it
            | "corrupt"     the worker's newest checkpoint file cut to half its length (a torn
                            write, a bad disk): no worker is out, but a restore of that step
                            cannot read those layers (needs --checkpoint-every)
    slow                    the worker's process run at FACTOR (0.01 to 1) of its speed
                            (chameleond.local.slowdown), for SECONDS or until the run ends
    WHEN   := "step=" INT   once step INT has committed
            | "t=" NUMBER ["s" | "ms"]   seconds (or ms) after training's first committed step

Examples: `kill:w4@step=4,kill:w1@step=12`, `event:w2@t=20:ECC error on HBM`,
`corrupt:w0@step=12,kill:w0@step=12`, `slow:w3@step=5:0.5:20`. A CAUSE may hold
spaces but no comma. Parsing is pure; `parse_faults` raises `FaultSpecError` with the offending
part, so a typo is one clear line, never a trace.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from chameleond.auth import Keyring
from chameleond.local.slowdown import MIN_FACTOR, check_factor
from chameleond.protocol import MAX_ID_LEN
from chameleond.redis_server import redis_cli_args

DEFAULT_CAUSES = {
    "kill": "kill -9 (injected)",
    "event": "fault event (injected)",
    "corrupt": "checkpoint file cut short (injected)",
    "slow": "slowed down (injected)",
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
    action: str  # "kill" | "event" | "corrupt" | "slow"
    worker: str
    at_step: int | None = None  # fire once this step has committed ...
    at_seconds: float | None = None  # ... or this long after the first committed step
    cause: str = ""
    factor: float | None = None  # slow: the fraction of full speed
    seconds: float | None = None  # slow: for this long (None: until the run ends)

    @property
    def when(self) -> str:
        return f"step={self.at_step}" if self.at_step is not None else f"t={self.at_seconds:g}s"

    def default_cause(self) -> str:
        if self.factor is not None:
            lasting = "" if self.seconds is None else f" for {self.seconds:g} s"
            return f"slowed to {self.factor:g} of its speed{lasting} (injected)"
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
            f"{text!r}: expected ACTION:WORKER@WHEN[:CAUSE], e.g. kill:w3@step=5, event:w1@t=20s "
            "or slow:w3@step=5:0.5"
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
        fault = Fault(action, worker, at_step=int(value), cause=cause)
    elif key == "t":
        fault = Fault(action, worker, at_seconds=_seconds(text, "t", value), cause=cause)
    else:
        raise FaultSpecError(f"{text!r}: WHEN must be step=N or t=SECONDS, got {when!r}")
    return _slow(text, fault) if action == "slow" else fault


def _seconds(text: str, name: str, value: str) -> float:
    sm = _SECONDS.match(value)
    if not sm:
        raise FaultSpecError(f"{text!r}: {name} must be seconds like 20, 2.5s or 800ms")
    return float(sm["num"]) / (1000.0 if sm["unit"] == "ms" else 1.0)


def _slow(text: str, fault: Fault) -> Fault:
    """A slow fault's FACTOR[:SECONDS], read from where other faults have their CAUSE."""
    factor_text, _, seconds_text = fault.cause.partition(":")
    if not factor_text:
        raise FaultSpecError(
            f"{text!r}: expected slow:WORKER@WHEN:FACTOR[:SECONDS], e.g. slow:w3@step=5:0.5 "
            "or slow:w3@t=10s:0.25:30"
        )
    try:
        factor = check_factor(float(factor_text))
    except ValueError:
        raise FaultSpecError(
            f"{text!r}: FACTOR must be a number from {MIN_FACTOR} to 1, got {factor_text!r}"
        ) from None
    seconds = _seconds(text, "SECONDS", seconds_text.strip()) if seconds_text else None
    if seconds == 0:
        raise FaultSpecError(f"{text!r}: SECONDS must be above 0")
    return replace(fault, cause="", factor=factor, seconds=seconds)


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
