"""User training scripts a local run can start as its workers (`chameleonctl up --example NAME`).

An example is a script of the source tree's `examples/` that embeds the worker library
(`chameleond.worker`), and the job spec it trains under. Each worker is that script, started with
the flags of `chameleon-worker`. The scripts are not installed with the package: they are found
beside it in a source checkout, or under `$CHAMELEON_EXAMPLES`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

EXAMPLES_ENV = "CHAMELEON_EXAMPLES"


@dataclass(frozen=True)
class Example:
    name: str
    script: str  # file name under the examples directory
    spec: str  # its job spec, under the same directory
    about: str
    model: str  # the model class it trains, as reports name it
    needs: tuple[str, ...] = ()  # modules it imports beyond the worker library (an extra)
    extra: str = "hf"  # the extra that brings them


EXAMPLES = {
    "hf": Example(
        "hf",
        "hf_gpt2.py",
        "hf-gpt2.toml",
        "a Hugging Face GPT2LMHeadModel on a BPE of the standard library's sources",
        "GPT2LMHeadModel",
        ("transformers", "tokenizers"),
    ),
    "recipe": Example(
        "recipe",
        "recipe.py",
        "recipe.toml",
        "a Hugging Face GPT2LMHeadModel trained as teams train: named param groups, warm-up + "
        "cosine, global clipping, shuffled data, a precision",
        "GPT2LMHeadModel",
        ("transformers", "datasets"),
    ),
}


class ExampleError(ValueError):
    """The example is unknown, or its files or its extra are missing; the message says which."""


def examples_dir() -> Path:
    return Path(os.environ.get(EXAMPLES_ENV) or Path(__file__).resolve().parents[2] / "examples")


@dataclass(frozen=True)
class FoundExample:
    example: Example
    script: Path
    spec: Path

    def worker_command(self) -> list[str]:
        """argv before the worker's own flags (--job, --worker-id, ...)."""
        return [sys.executable, str(self.script)]


def find_example(name: str) -> FoundExample:
    ex = EXAMPLES.get(name)
    if ex is None:
        raise ExampleError(f"--example {name!r}: not one of {', '.join(sorted(EXAMPLES))}")
    base = examples_dir()
    script, spec = base / ex.script, base / ex.spec
    for path in (script, spec):
        if not path.is_file():
            raise ExampleError(
                f"--example {name}: {path} not found (the examples live in a source checkout; "
                f"set {EXAMPLES_ENV} to its examples/ directory)"
            )
    from importlib.util import find_spec

    missing = [m for m in ex.needs if find_spec(m) is None]
    if missing:
        raise ExampleError(
            f"--example {name} needs {', '.join(missing)}: pip install 'chameleond[{ex.extra}]'"
        )
    return FoundExample(ex, script, spec)
