#!/usr/bin/env bash
# Regenerates docs/assets/eval/*.png (the Evaluation page's attention maps and expert selections): trains a tiny
# SwitchAll model on WikiText-2 for 300 steps on the CPU (a few minutes), then `switchhead eval --plots` on a
# sentence. Run from the repository root: bash docs/_scripts/eval_plots.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
run="$(mktemp -d)/run"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
switchhead train --preset tiny-switchall --data ../shared/data/wikitext-2 --output-dir "$run" --max-steps 300 \
    --seed 0 --no-progress --no-tensorboard
rm -rf docs/assets/eval
switchhead eval "$run" --plots docs/assets/eval --text "The cat sat on the mat because it was tired of standing."
