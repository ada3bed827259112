"""Check this machine before a first job: what each check found, one line each, with a verdict
(ok, warn, fail, skip) and how long it took.

* the collective backend of each kind of local device, in this process, as the workers use it
  (chameleond.worker._backend): gloo on the CPU always, nccl on each CUDA device, hccl on each
  Ascend NPU. Each builds a single-rank group on an in-memory store, all-reduces, aborts the group
  and builds it again; the rebuild time is a lower bound of the job spec's `rebuild_seconds`
  (a real rebuild also waits for every member's rendezvous over Redis);
* with a Redis URL (--redis-url or $CHAMELEON_REDIS_URL): that it answers, its version, and that
  the ACL lets the job's daemon and workers run what they run, on the job's own keys;
* with a secret (--secret-file, $CHAMELEON_SECRET_FILE or $CHAMELEON_SECRET): that it loads, and
  that the job's spec in Redis, if there is one, carries its signature;
* the installed torch, transformers and torch-npu (and the other extras' packages) against what
  chameleond's extras require.

Exit status 1 when a check fails, else 0 (a machine without CUDA skips the CUDA checks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict

from chameleond import __version__
from chameleond.auth import SECRET_ENV, SECRET_FILE_ENV
from chameleond.cli.doctor.backends import backends
from chameleond.cli.doctor.check import VERDICTS
from chameleond.cli.doctor.store import store_checks
from chameleond.cli.doctor.versions import extras
from chameleond.protocol import REDIS_URL_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get(REDIS_URL_ENV, ""),
        help=f"also check this Redis (default ${REDIS_URL_ENV}; none: skipped)",
    )
    parser.add_argument(
        "--secret-file",
        default="",
        help=f"also check this job secret (default ${SECRET_FILE_ENV}, else ${SECRET_ENV})",
    )
    parser.add_argument(
        "--job",
        default=os.environ.get("CHAMELEON_JOB", "default"),
        help="the job whose keys the Redis checks use (default $CHAMELEON_JOB, else default)",
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    checks = [*backends(), *store_checks(args), *extras()]
    failed = any(c.verdict == "fail" for c in checks)
    total = time.perf_counter() - started
    if args.json:
        doc = {"ok": not failed, "seconds": round(total, 3), "checks": [asdict(c) for c in checks]}
        print(json.dumps(doc, indent=2))
    else:
        print(f"chameleond {__version__}, Python {platform.python_version()}, {platform.system()} "
              f"{platform.machine()}")  # fmt: skip
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.verdict:<5} {c.name:<{width}}  {c.detail} ({c.seconds:.2f} s)")
        counts = ", ".join(f"{sum(c.verdict == v for c in checks)} {v}" for v in VERDICTS)
        print(f"{'FAILED' if failed else 'ready'}: {counts} ({total:.1f} s)")
    return 1 if failed else 0
