#!/usr/bin/env bash
# The one-graph round on a lent GPU (issue 41), as one prepared run that keeps to a time budget.
# Stages run in priority order; a stage that no longer fits the budget is skipped and said so, and
# every stage's log and files are packed into $OUT/results.tgz as soon as it ends (the device tool
# brings back at most 8 files), so a run cut short still returns what it measured.
#   bash scripts/gpu_round_check.sh                       # all stages, BUDGET=540 s
#   STAGES=targets-b1,trace BUDGET=300 bash scripts/gpu_round_check.sh
#   DEVICE=cpu COMPILE=off QUICK=1 bash scripts/gpu_round_check.sh   # a dry run of the plumbing here
# Stages run in the order below whatever STAGES lists. Still to measure after 2026-11-27's H200 run
# (benchmarks/RESULTS.md): STAGES=env,decodes,gpt-xl-b1,invariance-det,greedy,invariance-layers,sizes,windows,
# chameleon-7b,chameleon-7b-released.
# The GPU machines carry their own torch: lantern runs from the checkout (PYTHONPATH), and what the
# server needs beyond their image (FastAPI, uvicorn, pydantic) travels as wheels in .whl/ (name
# .whl in the device tool's carry; keep it out of git with .git/info/exclude), fetched here by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl fastapi==0.165.0 \
#     starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 \
#     annotated-types==0.8.0 sniffio==1.3.1 typing_extensions==4.16.0 opentelemetry-api==1.45.2
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-round}
WORK=${WORK:-/tmp/gpu-work}
BUDGET=${BUDGET:-540}
STAGES=${STAGES:-env,targets-b1,trace,decodes,gpt-xl-b1,serve,invariance-det,greedy,invariance-layers,sizes,windows,targets-b1-more,targets-b8,invariance,chameleon-7b,chameleon-7b-released}
DEVICE=${DEVICE:-cuda}
COMPILE=${COMPILE:-auto}
QUICK=${QUICK:-0}
PY=${PY:-python3}
START=$(date +%s)
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
export LANTERN_COMPILE_CACHE=${LANTERN_COMPILE_CACHE:-/tmp/lantern-compile-cache}  # outlives $OUT on a warm machine
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$WORK/wheels.log" 2>&1 || echo "wheel install failed (see wheels.log)"
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# sizes: QUICK=1 shrinks every stage to check the plumbing, not to measure
if [[ $QUICK == 1 ]]; then IMGS=2; REPS=1; IMGS8=2; ROUNDS=2; XL=GPT-B; CH=Chameleon-B; B8=2; INV=2; SERVE_REQ=1; CALLS=3
else IMGS=4; REPS=2; IMGS8=16; ROUNDS=20; XL=GPT-XL; CH=Chameleon-7B; B8=8; INV=16; SERVE_REQ=4; CALLS=24; fi

left() { echo $((BUDGET - ($(date +%s) - START))); }
pack() { tar czf "$OUT/results.tgz.part" -C "$WORK" --exclude='*.pt' . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }
want() { [[ ",$STAGES," == *",$1,"* ]]; }
# stage NAME MIN LIMIT CMD...: runs CMD if at least MIN seconds are left, for at most LIMIT (or what is left)
stage() {
  local name=$1 min=$2 limit=$3 rest; shift 3
  want "$name" || return 0
  rest=$(left)
  if (( rest < min )); then echo "== $name skipped: $rest s left, needs $min"; return 0; fi
  (( limit > rest - 3 )) && limit=$((rest - 3))
  echo "== $name $(date +%T) (limit $limit s)"
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 )) s"
  tr '\r' '\n' < "$WORK/$name.log" | grep -v -E '^\s*$|%\|' | tail -n 14 | cut -c1-300
  pack
}

stage env 5 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
  $PY -c 'import torch, lantern, sys; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name()); import fastapi, uvicorn; print(\"fastapi\", fastapi.__version__); import transformers; print(\"transformers\", transformers.__version__)'; nproc"
# the headline: photos, batch 1, every fast method against compiled AR in the same run
stage targets-b1 60 260 "$PY" -m lantern.cli bench --model photos --device "$DEVICE" --no-quality --no-ar-spread \
  --methods ar,lantern,lantern++,sjd-coupled --speed-images "$IMGS" --num-images "$IMGS" --repeats "$REPS" \
  --curve-images 0 --compile "$COMPILE" --out "$WORK/targets-b1" --no-progress
# the round trace: regions, syncs and ops per round; recompiles and skipped CUDA graphs in the log
stage trace 40 150 env TORCH_LOGS=recompiles,perf_hints "$PY" -m lantern.cli profile --model photos \
  --device "$DEVICE" --trace ar,lantern,lantern++,sjd-coupled --trace-images 1 --compile --out "$WORK/trace" \
  --no-progress
# decode after decode on one compiled pipeline: per-call seconds, memory and CUDA graphs recorded (0 from the
# third call on: lantern.decoding.resident keeps the round's state at fixed addresses since 2026-11-30, when a
# review found most of it new every decode), and three images from tiny Chameleon and Emu3 folders, eager and
# compiled (never run on a GPU before; their pending code index was a new tensor every round)
stage decodes 60 200 env TORCH_LOGS=recompiles,perf_hints "$PY" benchmarks/repeat_decodes.py --model photos \
  --device "$DEVICE" --compile "$COMPILE" --calls "$CALLS" --families --out "$WORK/repeat-decodes.json"
# GPT-XL: the AR step compiles in ~80 s on an H200, then the chain:6 round for longer than the 120 s
# that were left on 2026-11-27 (RESULTS.md): this stage needs about 300 s
stage gpt-xl-b1 120 320 "$PY" benchmarks/round_cost.py --configs "$XL" --batch-sizes 1 --trees chain:6 \
  --device "$DEVICE" --compile "$COMPILE" --rounds "$ROUNDS" --repeats "$REPS" --out "$WORK/round-cost-xl-b1"
# the server: speculative against AR at 8 clients, and lantern++ without --deterministic (what the
# server's default costs); the servers compile side by side, then are measured one at a time
stage serve 150 330 env TORCH_LOGS=recompiles "$PY" benchmarks/serve_load.py --model photos --parallel-start \
  --methods "ar,lantern++,lantern++ --no-deterministic" --clients 8 \
  --requests-per-client "$SERVE_REQ" --modes continuous --compile "$COMPILE" --device "$DEVICE" --out "$WORK/serve"
# the deterministic mode's batch invariance alone (the default mode was measured on 2026-11-27)
stage invariance-det 40 150 "$PY" benchmarks/batch_invariance.py --model photos --device "$DEVICE" --dtype auto \
  --compile "$COMPILE" --deterministic --images "$INV" --methods ar,lantern++,sjd-coupled --batch-sizes "$B8" \
  --out "$WORK/invariance-deterministic.json"
# greedy lossless methods against greedy AR, row by row, default and deterministic (whose attention
# calls the kernel at probed query counts and cache lengths): bf16 on the CPU parted 7 of 8 sd rows
stage greedy 40 150 "$PY" benchmarks/greedy_equality.py --model photos --device "$DEVICE" --dtype auto \
  --compile off --images "$B8" --methods sd,sjd,sjd-coupled --out "$WORK/greedy.json"
# where the deterministic mode's AR still depends on the batch on CUDA (7/16 images on 2026-11-27):
# the first module whose input or output differs for one image alone and in a batch (eager, bf16),
# then the same images eager, end to end (compiled was measured above: eager against compiled
# separates the kernels from inductor's generated reductions)
stage invariance-layers 40 150 bash -c "$PY benchmarks/invariance_layers.py --model photos --device $DEVICE \
  --dtype auto --deterministic --batch-size $B8 --calls 4 --out $WORK/invariance-layers-det.json && \
  $PY benchmarks/invariance_layers.py --model photos --device $DEVICE --dtype auto --batch-size $B8 --calls 4 \
  --out $WORK/invariance-layers-default.json && \
  $PY benchmarks/batch_invariance.py --model photos --device $DEVICE --dtype auto --compile off --deterministic \
  --images $INV --methods ar --batch-sizes $B8 --out $WORK/invariance-deterministic-eager.json"
stage sizes 90 300 bash -c "$PY benchmarks/round_cost.py --configs GPT-B --batch-sizes 1,$B8,32 --trees chain:6 \
  --device $DEVICE --compile $COMPILE --rounds $ROUNDS --repeats $REPS --out $WORK/round-cost-b && \
  $PY benchmarks/round_cost.py --configs $XL --batch-sizes $B8,32 --trees chain:6 --device $DEVICE \
  --compile $COMPILE --rounds $ROUNDS --repeats $REPS --out $WORK/round-cost-xl"
# the frontier row's Jacobi window against compiled AR: on the 2-core CPU 16 is fastest (τ 7.2; 8.8 at 32
# costs more than it returns); a GPU's verify of 33 tokens may cost about what 17 do (RESULTS.md)
stage windows 60 200 "$PY" -m lantern.cli bench --model photos --device "$DEVICE" --no-quality --no-ar-spread \
  --methods ar,sjd-coupled-lantern-sv,sjd-coupled-lantern-sv/window=24,sjd-coupled-lantern-sv/window=32 \
  --speed-images "$IMGS" --num-images "$IMGS" --repeats "$REPS" --curve-images 0 --compile "$COMPILE" \
  --out "$WORK/windows" --no-progress
stage targets-b1-more 60 200 "$PY" -m lantern.cli bench --model photos --device "$DEVICE" --no-quality --no-ar-spread \
  --methods ar,pjd,sjd-coupled-lantern --speed-images "$IMGS" --num-images "$IMGS" --repeats "$REPS" \
  --curve-images 0 --compile "$COMPILE" --out "$WORK/targets-b1-more" --no-progress
stage targets-b8 60 240 "$PY" -m lantern.cli bench --model photos --device "$DEVICE" --no-quality --no-ar-spread \
  --methods ar,lantern,lantern++,sjd-coupled --speed-batch-size "$B8" --speed-images "$IMGS8" \
  --num-images "$IMGS8" --repeats 1 --curve-images 0 --compile "$COMPILE" --out "$WORK/targets-b8" --no-progress
# batch 1 against batch 8 in bf16 (compiled): images whose codes the batch changes, default and deterministic
stage invariance 40 150 bash -c "$PY benchmarks/batch_invariance.py --model photos --device $DEVICE --dtype auto --compile $COMPILE \
  --images $INV --methods ar,lantern++,sjd-coupled --batch-sizes $B8 --out $WORK/invariance-default.json && \
  $PY benchmarks/batch_invariance.py --model photos --device $DEVICE --dtype auto --compile $COMPILE --deterministic \
  --images $INV --methods ar,lantern++,sjd-coupled --batch-sizes $B8 --out $WORK/invariance-deterministic.json"
# the Chameleon adapter (transformers' Chameleon layers, Lumina-mGPT's new-line tokens) at Lumina-mGPT-7B's
# width, 768 x 768, 2 and 4 layers scaled to 32: compiled AR against a chain:6 round (needs transformers)
stage chameleon-7b 120 300 "$PY" benchmarks/round_cost.py --configs "$CH" --batch-sizes 1 --trees chain:6 \
  --device "$DEVICE" --compile "$COMPILE" --rounds "$ROUNDS" --repeats "$REPS" --out "$WORK/round-cost-chameleon"
# the same with a drafter in the format of LANTERN's released Lumina-mGPT drafter (a full Chameleon layer over
# the whole token sequence; a compiled round drafts a row-end step at every depth)
stage chameleon-7b-released 120 300 "$PY" benchmarks/round_cost.py --configs "$CH" --chameleon-drafter released \
  --batch-sizes 1 --trees chain:6 --device "$DEVICE" --compile "$COMPILE" --rounds "$ROUNDS" --repeats "$REPS" \
  --out "$WORK/round-cost-chameleon-released"
echo "== done $(date +%T), $(left) s of the budget left"
