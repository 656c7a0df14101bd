#!/usr/bin/env bash
# The one-graph round's measurements (benchmarks/RESULTS.md, "One compiled region per round"):
# round traces before / after, the targets table against compiled AR, eager before / after,
# cold / warm start-up, and the round cost at real model sizes. Run on an otherwise idle machine.
#   bash scripts/bench_round.sh cpu            # all parts (~45 min on the 2-core CPU)
#   bash scripts/bench_round.sh cuda targets   # one part: before | trace | targets | eager | startup | sizes
# "before" is the loop as it was before the one-graph round (commit f4decf3), from a git worktree.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-cpu}
WHAT=${2:-all}
BEFORE_COMMIT=${BEFORE_COMMIT:-f4decf3}
PY=${PY:-.venv/bin/python}
case $PY in /*) ;; *) PY=$PWD/$PY ;; esac
OUT=benchmarks/results/round-graph-$DEVICE
METHODS=ar,sd,lantern,lantern++,sjd-coupled
mkdir -p "$OUT"
lantern() { PYTHONPATH=$PWD "$PY" -m lantern.cli "$@"; }
part() { [[ $WHAT == all || $WHAT == "$1" ]]; }
BEFORE=""
before_tree() {  # a worktree of the loop before this work, made once
  if [[ -z $BEFORE ]]; then
    BEFORE=$(mktemp -d)/before
    git worktree add --detach "$BEFORE" "$BEFORE_COMMIT" >/dev/null
    trap 'git worktree remove --force "$BEFORE"' EXIT
  fi
}

if part before; then  # round trace of the old loop, compiled (several regions per round)
  before_tree
  (cd "$BEFORE" && PYTHONPATH=$PWD "$PY" -m lantern.cli profile --model photos --device "$DEVICE" \
     --trace "$METHODS" --trace-images 2 --compile --out "$OLDPWD/$OUT/trace-before-compiled" --no-progress)
fi

if part trace; then  # round trace after: one region per round
  lantern profile --model photos --device "$DEVICE" --trace "$METHODS" --trace-images 2 --compile \
    --out "$OUT/trace-after-compiled" --no-progress
fi

if part targets; then  # photos, batch 1, speed only, against compiled AR in the same run
  lantern bench --model photos --device "$DEVICE" --no-quality --methods "$METHODS" --speed-images 8 \
    --num-images 8 --repeats 3 --curve-images 0 --compile auto --out "$OUT/targets-compiled" --no-progress
fi

if part eager; then  # eager before / after (the issue: eager paths no slower than today)
  before_tree
  (cd "$BEFORE" && PYTHONPATH=$PWD "$PY" -m lantern.cli bench --model photos --device "$DEVICE" --no-quality \
     --methods "$METHODS" --speed-images 8 --num-images 8 --repeats 3 --curve-images 0 --compile off \
     --out "$OLDPWD/$OUT/eager-before" --no-progress)
  lantern bench --model photos --device "$DEVICE" --no-quality --methods "$METHODS" --speed-images 8 \
    --num-images 8 --repeats 3 --curve-images 0 --compile off --out "$OUT/eager-after" --no-progress
fi

if part startup; then  # cold (empty compile cache) then warm start-up, one method per run
  CACHE=$(mktemp -d)
  for run in cold warm; do
    LANTERN_COMPILE_CACHE=$CACHE lantern bench --model photos --device "$DEVICE" --no-quality \
      --methods ar,lantern++ --speed-images 1 --num-images 2 --repeats 1 --curve-images 0 --compile auto \
      --out "$OUT/startup-$run" --no-progress
  done
  rm -rf "$CACHE"
fi

if part sizes; then  # the compiled round at real sizes (random weights), projected speed-up
  if [[ $DEVICE == cuda ]]; then
    PYTHONPATH=$PWD "$PY" benchmarks/round_cost.py --configs GPT-B,GPT-L,GPT-XL,Lumina-7B --batch-sizes 1,4,16 \
      --device cuda --out "$OUT/round-cost"
  else
    PYTHONPATH=$PWD "$PY" benchmarks/round_cost.py --configs GPT-B --batch-sizes 1,4,16 --trees chain:6 \
      --rounds 10 --repeats 2 --out "$OUT/round-cost"
  fi
fi
