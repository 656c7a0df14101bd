#!/usr/bin/env bash
# Issue 17's measurements: the round-cost tables (before / after, eager / compiled), the targets
# table at batch 1, images/s at batch 1 / 4 / 16, and (on a GPU) the verify-cost curves of GPT-B/L/XL.
# Run on an otherwise idle machine; every table is written under benchmarks/results/engine-<device>/.
#   bash scripts/bench_engine.sh cpu        # ~40 min on the 2-core CPU (compilation included)
#   bash scripts/bench_engine.sh cuda       # on a GPU: the same, with CUDA graphs, plus verify-cost
#   bash scripts/bench_engine.sh cpu trace  # one part only: trace | before | targets | batch | verify
# "before" traces the loop as it was before the engine work (commit 239c21e: the trace tool on the
# old loop) from a temporary git worktree.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-cpu}
WHAT=${2:-all}
PY=${PY:-.venv/bin/python}
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac  # absolute: the "before" run changes directory
OUT=benchmarks/results/engine-$DEVICE
METHODS=ar,sd,lantern,lantern++,sjd
mkdir -p "$OUT"
lantern() { PYTHONPATH=$PWD "$PY" -m lantern.cli "$@"; }

if [[ $WHAT == all || $WHAT == before ]] && ! git cat-file -e 239c21e^{commit} 2>/dev/null; then
  echo "skipping 'before': no git history here (run it in a clone that has commit 239c21e)"
elif [[ $WHAT == all || $WHAT == before ]]; then
  BEFORE=$(mktemp -d)/before
  git worktree add --detach "$BEFORE" 239c21e >/dev/null
  (cd "$BEFORE" && PYTHONPATH=$PWD "$PY" -m lantern.cli profile --model photos --device "$DEVICE" \
     --trace "$METHODS" --trace-images 4 --out "$OLDPWD/$OUT/trace-before" --no-progress)
  git worktree remove --force "$BEFORE"
fi

if [[ $WHAT == all || $WHAT == trace ]]; then
  # Round cost after: time, dispatched ops and host syncs per round by phase, eager and compiled.
  lantern profile --model photos --device "$DEVICE" --trace "$METHODS" --trace-images 4 \
    --out "$OUT/trace-eager" --no-progress
  lantern profile --model photos --device "$DEVICE" --trace "$METHODS" --trace-images 4 --compile \
    --out "$OUT/trace-compiled" --no-progress
fi

if [[ $WHAT == all || $WHAT == targets ]]; then
  # The targets table: photos, batch 1, speed only, against AR (eager AR, then compiled AR).
  for mode in off auto; do
    lantern bench --model photos --device "$DEVICE" --no-quality --methods "$METHODS" --speed-images 8 \
      --num-images 8 --repeats 3 --curve-images 0 --compile "$mode" --out "$OUT/targets-compile-$mode" --no-progress
  done
fi

if [[ $WHAT == all || $WHAT == batch ]]; then
  # Throughput at batch 1, 4 and 16 with --tree auto (chosen per batch size; AR where speculation loses).
  lantern bench --model photos --device "$DEVICE" --no-quality --methods "$METHODS" --tree auto \
    --speed-batch-size 1,4,16 --speed-images 16 --num-images 16 --repeats 1 --curve-images 0 --compile \
    --out "$OUT/batch-auto" --no-progress
fi

if [[ $WHAT == all || $WHAT == verify ]] && [[ $DEVICE == cuda ]]; then
  # Verify-cost curves (1-128 nodes, CFG) and the AR step of GPT-B/L/XL shapes, random weights.
  PYTHONPATH=$PWD "$PY" benchmarks/verify_cost.py --configs GPT-B,GPT-L,GPT-XL --device cuda --dtype bfloat16 \
    --out "$OUT/verify-cost-eager"
  PYTHONPATH=$PWD "$PY" benchmarks/verify_cost.py --configs GPT-B,GPT-L,GPT-XL --device cuda --dtype bfloat16 \
    --points 1,8,32,128 --compile reduce-overhead --out "$OUT/verify-cost-graphs"
fi
echo "tables: $OUT/*/trace.md, $OUT/*/bench.md"
