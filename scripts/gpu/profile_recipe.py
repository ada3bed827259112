"""examples/recipe.py under torch.profiler for a few steps: where the device waits, and for what.

    PROFILE_OUT=DIR python scripts/gpu/profile_recipe.py ARGS...   # the recipe's own arguments

As a worker (`chameleonctl up --script scripts/gpu/profile_recipe.py ...`) the window opens at
the committed step PROFILE_FROM (default 20) and closes PROFILE_STEPS (default 3) steps later,
with Python's calls traced; with `--plain` the recipe's plain loop is profiled over the same
steps (counted by its scheduler's steps), without the Python tracer. DIR gets `<who>.txt`: per
step the wall time, the device's busy time (kernels and copies) and its idle time; the operators
by host and by device time; and, with the Python tracer, the device's idle time laid against
what the host was running then (the innermost chameleond and recipe frames, and the innermost
frame). `<who>` is the worker id or `plain`.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import recipe

OUT = Path(os.environ.get("PROFILE_OUT", "."))
FROM = int(os.environ.get("PROFILE_FROM", "20"))
STEPS = int(os.environ.get("PROFILE_STEPS", "3"))
BUSY = ("kernel", "gpu_memcpy", "gpu_memset")


class Window:
    def __init__(self, who: str, stack: bool) -> None:
        self.who, self.stack = who, stack
        self.prof: Any = None
        self.t0 = 0.0

    def at(self, step: int) -> None:
        """Called once per step, after it: opens the window after step FROM - 1."""
        if step == FROM - 1 and self.prof is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities, with_stack=self.stack)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif step == FROM - 1 + STEPS and self.prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.write(wall)
            self.prof = None

    def write(self, wall: float) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        trace = OUT / f"{self.who}.trace.json"
        self.prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
        trace.unlink()
        lines = [f"{self.who}: {STEPS} steps from {FROM}, wall {1e3 * wall / STEPS:.2f} ms/step"]
        busy = sorted(
            (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in BUSY and "dur" in e
        )
        merged: list[list[float]] = []
        for a, b in busy:
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        busy_us = sum(b - a for a, b in merged)
        lines.append(f"device busy {busy_us / 1e3 / STEPS:.2f} ms/step ({len(busy)} activities)")
        gaps = [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
        idle_ms = sum(b - a for a, b in gaps) / 1e3 / STEPS
        lines.append(f"device idle between its first and last activity {idle_ms:.2f} ms/step")
        avg = self.prof.key_averages()
        lines.append("\n== by host time (self, per step)")
        ops = [e for e in avg if ".py(" not in e.key and "built-in method" not in e.key]
        for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:35]:
            lines.append(row(e.self_cpu_time_total, e.count, e.key))
        lines.append("\n== by device time (self, per step)")
        for e in sorted(avg, key=lambda e: -e.self_device_time_total)[:20]:
            lines.append(row(e.self_device_time_total, e.count, e.key))
        if self.stack:
            lines += idle_by_frame(events, gaps)
        (OUT / f"{self.who}.txt").write_text("\n".join(lines) + "\n")


def row(microseconds: float, count: int, key: str) -> str:
    return f"{microseconds / 1e3 / STEPS:8.3f} ms  x{count / STEPS:7.1f}  {key[:90]}"


def idle_by_frame(events: list[dict[str, Any]], gaps: list[tuple[float, float]]) -> list[str]:
    """The device's idle time (gaps over 20 us) by what the host's busiest thread ran then."""
    py = [e for e in events if e.get("cat") == "python_function" and "dur" in e]
    if not py:
        return ["\n(no Python frames traced)"]
    tid = collections.Counter(e["tid"] for e in py).most_common(1)[0][0]
    frames = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in py if e["tid"] == tid)
    ours: dict[str, float] = collections.defaultdict(float)
    leaf: dict[str, float] = collections.defaultdict(float)
    for a, b in gaps:
        if b - a < 20:
            continue
        mid = (a + b) / 2
        covering = [f for f in frames if f[0] <= mid <= f[1]]  # outermost first
        names = [n for _, _, n in covering]
        mine = [n for n in names if "chameleond" in n or "recipe" in n]
        ours[" < ".join(reversed(mine[-3:])) or "(none)"] += b - a
        leaf[names[-1] if names else "(no frame)"] += b - a
    out = ["\n== device idle by the host's innermost chameleond/recipe frames (ms/step)"]
    out += [f"{v / 1e3 / STEPS:8.3f}  {k[:200]}" for k, v in top(ours, 30)]
    out.append("\n== device idle by the host's innermost frame (ms/step)")
    out += [f"{v / 1e3 / STEPS:8.3f}  {k[:160]}" for k, v in top(leaf, 25)]
    return out


def top(sums: dict[str, float], n: int) -> list[tuple[str, float]]:
    return sorted(sums.items(), key=lambda kv: -kv[1])[:n]


def main() -> int:
    if "--plain" in sys.argv:
        window = Window("plain", stack=False)
        scheduler_step = torch.optim.lr_scheduler.LambdaLR.step
        count = [0]

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = scheduler_step(self, *args, **kwargs)
            if count[0] > 0:  # the first is the scheduler's own, at its construction
                window.at(count[0] - 1)
            count[0] += 1
            return out

        torch.optim.lr_scheduler.LambdaLR.step = step  # type: ignore[method-assign]
        return recipe.main()
    who = sys.argv[sys.argv.index("--worker-id") + 1] if "--worker-id" in sys.argv else "worker"
    window = Window(who, stack=True)
    log_step = recipe.log_step

    def on_step(info: Any) -> None:
        log_step(info)
        window.at(info.step)

    recipe.log_step = on_step
    return recipe.main()


if __name__ == "__main__":
    sys.exit(main())
