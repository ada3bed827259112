"""`chameleonctl`: the operator's command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("chameleond.cli.up", "run a whole fault-tolerant training job locally and report"),
    "status": ("chameleond.cli.status", "show the job's state, plan, workers and last decisions"),
    "inject": ("chameleond.cli.inject", "send a fault event for a worker"),
    "plan": ("chameleond.cli.plan_cmd", "compare the reroute and dynamic candidates for a fault"),
    "bench": ("chameleond.cli.bench", "benchmarks: planner, ingest, recovery, checkpoint"),
    "simulate": ("chameleond.cli.simulate", "simulate fault-tolerance policies over a trace"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chameleonctl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=mod.__doc__)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
