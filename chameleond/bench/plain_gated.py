"""The plain arm of `chameleonctl bench worker`: an example's plain torch loop (`plain`, as its
`--plain` runs it), each rank taking turns with the library's workers through the step gate
(chameleond.worker._gate) and recording its step times to the gate file's name + `.plain{RANK}`.

    python -m chameleond.bench.plain_gated --example examples/hf_gpt2.py --spec S --steps N --gate G

The example stays a user's script: it knows nothing of the gate, only that its loop may be paced.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example", type=Path, required=True, help="the example script")
    p.add_argument("--spec", type=Path, required=True, help="the job spec: model and batch sizes")
    p.add_argument("--steps", type=int, required=True, help="steps to train")
    p.add_argument("--gate", type=Path, required=True, help="the bench's gate file")
    args = p.parse_args(argv)
    from chameleond.worker._gate import StepGate  # the worker extra: torch

    sys.path.insert(0, str(args.example.resolve().parent))  # the example's own helper modules
    names = runpy.run_path(str(args.example), run_name="chameleon_plain")
    rank = int(os.environ.get("RANK", "0"))
    gate = StepGate(args.gate, "plain", Path(f"{args.gate}.plain{rank}"))
    code: int = names["plain"](args.spec, args.steps, names["default_cache_dir"](), None, gate)
    return code


if __name__ == "__main__":
    sys.exit(main())
