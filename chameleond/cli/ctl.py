"""`chameleonctl`: the operator's command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from chameleond import version_text
from chameleond.extras import MissingExtra
from chameleond.usage import Parser

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("chameleond.cli.up", "run a whole fault-tolerant training job locally and report"),
    "status": ("chameleond.cli.status", "show the job's state, plan, workers and last decisions"),
    "steps": (
        "chameleond.cli.steps",
        "the job's committed steps: loss, grad norm, lr, samples/s, tokens/s, eval loss",
    ),
    "inject": (
        "chameleond.cli.inject",
        "send a fault event for a worker, or run one slowed down (inject slow)",
    ),
    "plan": ("chameleond.cli.plan_cmd", "compare the reroute and dynamic candidates for a fault"),
    "bench": (
        "chameleond.bench",
        "benchmarks: planner, ingest, recovery, checkpoint, chaos, policies, worker, sim-check, "
        "training, peers, hosts, slow, failover, control-plane",
    ),
    "export": (
        "chameleond.cli.export",
        "write a checkpoint as a Hugging Face model directory (--checkpoint DIR --hf OUT)",
    ),
    "simulate": ("chameleond.cli.simulate", "simulate fault-tolerance policies over a trace"),
    "doctor": (
        "chameleond.cli.doctor",
        "check this machine first: device backends, Redis and its ACL, the secret, versions",
    ),
}


HELP = """Operate chameleond training jobs: see a job's state, plan and decisions, report a
failed worker, compare recovery plans, or run a whole fault-tolerant job on this machine."""
EPILOG = """examples:
  chameleonctl up                                  train locally with two faults, then report
  chameleonctl status --job gpt-32                 state, plan, workers, last decisions
  chameleonctl steps --job gpt-32 --follow         each step's loss, grad norm, lr, throughput
  chameleonctl inject --job gpt-32 --worker w3 --cause "ECC error"
  chameleonctl plan --fail w3                      what reroute and dynamic would do
  chameleonctl doctor                              first, on a new machine: is it ready?

status, steps and inject take the job's Redis from --redis-url or $CHAMELEON_REDIS_URL (which
keeps a password out of ps). The daemon's status page: http://HOST:9464/ (docs/operations.md)."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="chameleonctl",
        description=HELP,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version_text("chameleonctl"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=mod.__doc__)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except MissingExtra as e:  # an optional part the command needs (chameleond.extras)
        print(f"chameleonctl {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
