#!/usr/bin/env bash
# Rebuild the committed Hub artifact (hf_artifact/, MODEL_CARD.md) from scratch.
#
#   1. train the SV model and its softmax / matched-window SWA twins at the published shape
#      (d_model 256, 4 layers, 4 heads, block 256; `--preset paper`) side by side on the embedded
#      story corpus, checkpointing every 100 steps (about an hour on two CPU cores);
#   2. draw their training curves (results/train_twins.png) from results/train_twins.json;
#   3. export the SV checkpoint as hf_artifact/ (+ MODEL_CARD.md) and verify it;
#   4. re-render README.md, docs/results.md and the card from results/.
#
# Usage: scripts/build_artifact.sh [--resume]
#   --resume   continue the runs in $RUN_DIR from their newest checkpoints (after an interruption)
# Environment: RUN_DIR (default runs/paper), STEPS (default 1500), SV (default .venv/bin/sv-attention).
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-runs/paper}
STEPS=${STEPS:-1500}
SV=${SV:-.venv/bin/sv-attention}
RESUME=()
case "${1:-}" in
  --resume) RESUME=(--resume) ;;
  "") ;;
  *) echo "usage: $0 [--resume]" >&2; exit 2 ;;
esac

# One BLAS thread per process: the three twins train in parallel processes.
OMP_NUM_THREADS=1 "$SV" train --preset paper --operators sv softmax swa --parallel \
  --steps "$STEPS" --warmup-steps 100 --save-every 100 --eval-every 100 \
  --run-dir "$RUN_DIR" --json results/train_twins.json --no-progress "${RESUME[@]}"

"$SV" plot-twins --json results/train_twins.json

CKPT=$(ls -d "$RUN_DIR"/sv/checkpoints/step_* | sort | tail -n 1)
"$SV" export "$CKPT" --out hf_artifact --card-copy MODEL_CARD.md --overwrite
"$SV" verify hf_artifact
"$SV" render-readme
