"""Benchmarks that print figures: `chameleonctl bench BENCH [--json]`."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "planner": "chameleond.bench.planner",
    "ingest": "chameleond.bench.ingest",
    "recovery": "chameleond.bench.recovery",
    "checkpoint": "chameleond.bench.checkpoint",
    "chaos": "chameleond.bench.chaos",
    "policies": "chameleond.bench.policies",
    "worker": "chameleond.bench.worker",
    "training": "chameleond.bench.training",
    "sim-check": "chameleond.bench.simcheck",
    "peers": "chameleond.bench.peers",
    "hosts": "chameleond.bench.hosts",
    "slow": "chameleond.bench.slow",
    "failover": "chameleond.bench.failover",
    "control-plane": "chameleond.bench.control_plane",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, module in BENCHES.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=(mod.__doc__ or "").splitlines()[0], description=mod.__doc__)
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)


def run(args: argparse.Namespace) -> int:  # pragma: no cover - replaced by the chosen bench
    raise SystemExit("choose a benchmark")
