"""Library vs plain loop per precision: median step time (steps >= SKIP), ratio, loss match."""

import json
import statistics
import sys
from pathlib import Path

out, work = Path(sys.argv[1]), Path(sys.argv[2])
SKIP = 10
res = {}
# Runs by name: fp32, bf16, fp32ckpt, or one of them again as fp32.2, bf16.2, ...
names = {d.name[3:] for d in work.glob("up_*") if d.is_dir()}
names |= {f.stem[6:] for f in out.glob("plain_*.json") if not f.stem.endswith("_again")}
for prec in sorted(names):
    r: dict = {}
    rep = work / f"up_{prec}" / "report.json"
    pl = out / f"plain_{prec.replace('ckpt', '')}.json"
    if not rep.exists() and not pl.exists():
        continue  # not among this run's RUNS
    try:
        tl = json.loads(rep.read_text())["timeline"]
        at = {s["step"]: s["at"] for s in tl}
        gaps = [at[s] - at[s - 1] for s in sorted(at) if s >= SKIP and s - 1 in at]
        r["lib_commit_period_ms"] = round(1e3 * statistics.median(gaps), 2)
        r["lib_worker_step_ms"] = round(
            1e3
            * statistics.median(
                [s["seconds"] for s in tl if s["step"] >= SKIP and s.get("seconds")]
            ),
            2,
        )
        r["lib_steps"] = len(tl)
        lib_loss = {s["step"]: s["loss"] for s in tl}
    except Exception as e:
        r["lib_error"] = f"{type(e).__name__}: {e}"
        lib_loss = {}
    try:
        p = json.loads(pl.read_text())
        r["plain_step_ms"] = round(1e3 * statistics.median(p["seconds"][SKIP:]), 2)
        r["plain_steps"] = len(p["seconds"])
        if lib_loss:
            d = [abs(lib_loss[i] - v) for i, v in enumerate(p["loss"]) if i in lib_loss]
            rel = [abs(lib_loss[i] - v) / abs(v) for i, v in enumerate(p["loss"]) if i in lib_loss]
            r["loss_max_abs_diff"] = max(d)
            r["loss_max_rel_diff"] = max(rel)
            r["loss_first_last_lib"] = [lib_loss.get(0), lib_loss.get(max(lib_loss))]
    except Exception as e:
        r["plain_error"] = f"{type(e).__name__}: {e}"
    if "lib_commit_period_ms" in r and "plain_step_ms" in r:
        r["ratio_commit_over_plain"] = round(r["lib_commit_period_ms"] / r["plain_step_ms"], 4)
    if lib_loss:
        r["lib_losses"] = [round(lib_loss[k], 5) for k in sorted(lib_loss)]
    res[prec] = r
if (out / "plain_fp32_again.json").exists():
    try:
        a = json.loads((out / "plain_fp32.json").read_text())["loss"]
        b = json.loads((out / "plain_fp32_again.json").read_text())["loss"]
        res["plain_fp32_vs_itself_max_abs"] = max(abs(x - y) for x, y in zip(a, b, strict=False))
        res["plain_fp32_losses"] = [round(v, 5) for v in a]
    except Exception as e:
        res["plain_again_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(res, indent=1))
(out / "summary.json").write_text(json.dumps(res, indent=1))
