"""Compare the reroute and dynamic candidates for a fault, as the daemon would decide it.

The current plan is the spec's layout (generation 1); the fault set goes to `decide()` and both
candidates are printed with the selected policy (with --json: the decision and the selected plan,
docs/plan.md). Exit status: 0 when a plan is selected; 2 on a bad spec, an unknown worker or a bad
--mtbf; 3 when no plan can continue training (some layer lost every copy, or no candidate fits),
the decision still printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from chameleond.core.decide import DecisionError, decide, initial_plan
from chameleond.core.decision import Decision, decision_to_dict
from chameleond.core.plan import plan_to_dict
from chameleond.core.policy import Selection
from chameleond.core.spec import SpecError, load_spec
from chameleond.jobs import default_spec_path

UNRECOVERABLE = 3  # exit status when the decision selects no plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", default=None, help="job spec (TOML/JSON); default: cpu-small")
    parser.add_argument("--fail", required=True, help="failed worker ids, comma-separated")
    parser.add_argument("--mtbf", type=float, default=None, help="D in seconds (default: prior)")
    parser.add_argument(
        "--policy", choices=[s.value for s in Selection], default=Selection.ADAPTIVE.value,
        help="adaptive (the selector decides) or force one policy",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def to_json(d: Decision) -> dict[str, Any]:
    """The decision as the daemon records it (`decision_to_dict`), with the selected plan."""
    out = decision_to_dict(d)
    out["plan"] = plan_to_dict(d.plan) if d.plan is not None else None
    return out


def _text(d: Decision) -> str:
    lines = [
        f"{'policy':<8} {'feasible':<8} {'step_s':>10} {'transition_s':>12} {'score':>12} "
        f"{'batch':>6} {'peak_mem_GiB':>12}  reason"
    ]
    for c in d.candidates:
        step = f"{c.step_seconds:.4f}" if math.isfinite(c.step_seconds) else "-"
        batch = str(c.plan.global_batch) if c.plan is not None else "-"
        lines.append(
            f"{c.policy:<8} {str(c.feasible).lower():<8} {step:>10} "
            f"{c.transition_seconds:>12.4f} {c.score:>12.2f} {batch:>6} "
            f"{c.peak_memory_bytes / 2**30:>12.2f}  {c.reason}"
        )
    lines.append(f"selected: {d.selected or 'none'}")
    if d.unrecoverable:
        lines.append(f"unrecoverable: {d.unrecoverable}")
    if d.follow_up is not None:
        lines.append(
            f"follow-up: switch to the dynamic plan once prepared if more than "
            f"{d.follow_up_after_seconds:.1f} s of the window remain"
        )
    if d.note:
        lines.append(f"note: {d.note}")
    lines.append(f"D (mtbf_seconds): {d.mtbf_seconds:.1f}")
    lines.append(f"search_seconds: {d.search_seconds:.6f} ({d.plans_considered} plans considered)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    path = args.spec or default_spec_path()
    try:
        spec = load_spec(path)
        failed = [w.strip() for w in str(args.fail).split(",") if w.strip()]
        if not failed:
            raise DecisionError("--fail: name at least one worker")
        known = {w.id for w in spec.workers}
        unknown = [w for w in failed if w not in known]
        if unknown:
            raise DecisionError(f"--fail: unknown worker(s) {', '.join(unknown)} in {path}")
        if args.mtbf is not None and not (math.isfinite(args.mtbf) and args.mtbf > 0):
            raise DecisionError(f"--mtbf: must be a finite number > 0, got {args.mtbf}")
        mtbf = spec.mtbf_prior_seconds if args.mtbf is None else float(args.mtbf)
        current = initial_plan(spec, generation=1, mtbf_seconds=mtbf)
        force = Selection(args.policy).force
        d = decide(spec, current, failed, mtbf_seconds=mtbf, generation=2, force=force,
                   cause="chameleonctl plan")  # fmt: skip
    except (SpecError, DecisionError) as e:
        print(f"chameleonctl plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(d), indent=2) if args.json else _text(d))
    return 0 if d.selected is not None else UNRECOVERABLE
