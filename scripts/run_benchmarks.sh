#!/usr/bin/env bash
# Reproduce benchmarks/RESULTS.md on this machine: device profiles, the tree comparison (speed
# only) and the full speed + quality benchmark of every method, for both embedded presets.
# Run it on an otherwise idle machine: the ratios are measured side by side in one process, but
# another job on the same cores still adds noise. Results go to benchmarks/results/.
#   bash scripts/run_benchmarks.sh            # everything (~45 min on the 2-core CPU)
#   bash scripts/run_benchmarks.sh bench      # only the two `lantern bench` runs
set -euo pipefail
cd "$(dirname "$0")/.."
LANTERN=${LANTERN:-.venv/bin/lantern}
OUT=benchmarks/results
what=${1:-all}
mkdir -p "$OUT"

if [[ $what == all || $what == profile ]]; then
  for m in photos digits; do
    "$LANTERN" profile --model "$m" --out "$OUT/profile-$m" --no-progress
  done
fi

if [[ $what == all || $what == trees ]]; then
  # Every tree for the same method, speed only (6 images at batch 1, median of 3 interleaved passes).
  for m in photos digits; do
    "$LANTERN" bench --model "$m" --no-quality --speed-images 6 --num-images 6 --repeats 3 --curve-images 0 \
      --methods ar,lantern++@chain:3,lantern++@chain:4,lantern++@chain:5,lantern++@chain:6,lantern++@static:cpu_6,lantern++@static:naive_extend_57,lantern++@auto,lantern@chain:3,lantern@chain:5,lantern@chain:7,lantern@dynamic,lantern@auto,sd@chain:3,sd@static:cpu_6,sd@dynamic,sd@auto,sjd,sjd-lantern \
      --out "$OUT/trees-$m" --no-progress
  done
fi

if [[ $what == all || $what == bench ]]; then
  for m in photos digits; do
    /usr/bin/time -f "%e s wall" "$LANTERN" bench --model "$m" --repeats 3 --out "$OUT/bench-$m" --no-progress
  done
fi

if [[ $what == all || $what == sweep ]]; then
  "$LANTERN" bench --model digits --sweep --num-images 100 --speed-images 4 --methods ar,lantern,lantern++ \
    --no-ar-spread --out "$OUT/sweep-digits" --no-progress
  "$LANTERN" bench --model photos --sweep --num-images 60 --sweep-images 60 --speed-images 4 \
    --methods ar,lantern,lantern++ --no-ar-spread --curve-images 0 --out "$OUT/sweep-photos" --no-progress
fi
