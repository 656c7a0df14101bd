#!/usr/bin/env bash
# Train one embedded preset from scratch with lantern's own commands, then assemble it.
#
#   scripts/train_preset.sh digits|photos [RUNS_DIR]
#
# Every step checkpoints into RUNS_DIR/NAME/<step>/ and is skipped once its model folder exists,
# so re-running the script after an interruption resumes where it stopped (--resume).
# The final stack is written to lantern/presets/NAME by scripts/assemble_preset.py, with every
# command below recorded in its provenance.json.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:?usage: train_preset.sh digits|photos [RUNS_DIR]}
RUNS=${2:-runs}/$NAME
LANTERN=${LANTERN:-.venv/bin/lantern}
mkdir -p "$RUNS"

case "$NAME" in
  digits)
    DATA=(--data digits)
    TOK=(--ch 32 --z-channels 32 --norm-groups 8 --steps 1500 --batch-size 32 --checkpoint-every 100 --eval-images 500)
    TGT=(--dim 256 --n-layer 8 --n-head 4 --multiple-of 64 --steps 2500 --batch-size 32 --lr 1e-3 --checkpoint-every 250)
    DDATA=()
    DRF=(--steps 1500 --batch-size 32 --lr 1e-3 --checkpoint-every 250)
    ;;
  photos)
    DATA=(--data photos --num-samples 20000 --eval-samples 2000)
    TOK=(--ch 32 --z-channels 32 --norm-groups 8 --steps 1500 --batch-size 32 --checkpoint-every 100 --eval-images 500)
    TGT=(--dim 256 --n-layer 8 --n-head 4 --multiple-of 64 --steps 1500 --batch-size 16 --lr 1e-3 --checkpoint-every 250)
    DDATA=(--max-sequences 8000)
    DRF=(--steps 1000 --batch-size 16 --lr 1e-3 --checkpoint-every 250)
    ;;
  *) echo "unknown preset $NAME (digits|photos)" >&2; exit 2 ;;
esac

step() {  # step OUT_DIR COMMAND...: run (or resume) unless OUT_DIR already holds a finished model
  local out=$1; shift
  if [ -f "$out/model.safetensors" ] || [ -f "$out/train.safetensors" ] || [ -f "$out/test/meta.json" ]; then
    echo "== $out: done, skipping"; return
  fi
  local resume=()
  [ -d "$out/checkpoints" ] && resume=(--resume)
  echo "== $*"
  "$LANTERN" "$@" --out "$out" "${resume[@]}"
}

step "$RUNS/tokenizer" train-tokenizer "${DATA[@]}" "${TOK[@]}"
step "$RUNS/codes" extract-codes --tokenizer "$RUNS/tokenizer" "${DATA[@]}"
step "$RUNS/target" train-target --codes "$RUNS/codes" "${TGT[@]}"
step "$RUNS/drafter-data" make-drafter-data --target "$RUNS/target" --codes "$RUNS/codes" "${DDATA[@]}"
step "$RUNS/drafter" train-drafter --target "$RUNS/target" --data "$RUNS/drafter-data" "${DRF[@]}"
.venv/bin/python scripts/assemble_preset.py "$NAME" "$RUNS" "lantern/presets/$NAME"
