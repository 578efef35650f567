#!/usr/bin/env bash
# Re-measure every number in README.md, docs/results.md and the model card.
#
# Runs every `sv-attention bench ...` and `sv-attention reproduce ...` subcommand listed by
# `sv-attention --help`, each writing results/NAME.json (and a figure for the experiments) with its
# provenance, then re-renders README.md, docs/results.md and the card (hf_artifact/README.md,
# MODEL_CARD.md). Timings are only meaningful on a quiet machine. The training rows
# (results/train_twins.json) come from scripts/build_artifact.sh.
#
# Usage: scripts/reproduce_all.sh [NAME ...]   (default: all; e.g. `bench ceq` -> NAME bench_ceq)
# Environment: SV (default .venv/bin/sv-attention).
set -euo pipefail
cd "$(dirname "$0")/.."
SV=${SV:-.venv/bin/sv-attention}

COMMANDS=(
  "bench deletion" "bench gate" "bench ceq" "bench step" "bench plugin" "bench cache"
  "reproduce secret" "reproduce latency" "reproduce selective-copy" "reproduce recall"
  "reproduce capacity" "reproduce eviction" "reproduce forgetting" "reproduce memory"
  "reproduce edit" "reproduce sign-flip" "reproduce lm" "reproduce robustness"
)

for cmd in "${COMMANDS[@]}"; do
  name=${cmd// /_}
  if [ "$#" -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  echo "== sv-attention $cmd"
  # shellcheck disable=SC2086  # the command is two words on purpose
  "$SV" $cmd
done

"$SV" render-readme
