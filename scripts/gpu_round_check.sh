#!/usr/bin/env bash
# The one-graph round on a lent GPU, in one short run (about 8 minutes, compilation included):
# compiled AR, lantern, lantern++ and sjd-coupled on photos (4 images, 2 passes), the compiled round
# trace, and the GPT-XL round at batch 1 and 16. Results under ${OUT:-gpu-round}/ (the device tool's
# $OUT when run there). The GPU machines carry their own torch: install lantern with --no-deps.
#   bash scripts/gpu_round_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-round}
PY=${PY:-python3}
mkdir -p "$OUT"
export LANTERN_COMPILE_CACHE=${LANTERN_COMPILE_CACHE:-$OUT/compile-cache}
"$PY" -m pip install -q --no-deps -e . > "$OUT/install.log" 2>&1 || echo "pip install failed (see install.log)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
run() { local name=$1 limit=$2; shift 2; echo "== $name $(date +%T)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "   rc=$?"; tail -12 "$OUT/$name.log"; }
run targets 240 "$PY" -m lantern.cli bench --model photos --device cuda --no-quality \
  --methods ar,lantern,lantern++,sjd-coupled --speed-images 4 --num-images 4 --repeats 2 --curve-images 0 \
  --compile auto --out "$OUT/targets" --no-progress
run trace 120 "$PY" -m lantern.cli profile --model photos --device cuda --trace ar,lantern,lantern++ \
  --trace-images 1 --compile --out "$OUT/trace" --no-progress
run gpt-xl 180 "$PY" benchmarks/round_cost.py --configs GPT-XL --batch-sizes 1,16 --trees chain:6 --device cuda \
  --rounds 20 --repeats 2 --out "$OUT/round-cost"
echo "== done $(date +%T)"
