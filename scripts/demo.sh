#!/usr/bin/env bash
# The README demo: set up a fresh machine (CPU only, package registries only) and run the main job.
# Trains a tiny SwitchHead model and its parameter-matched dense baseline on the Python standard library corpus,
# prints validation perplexity, attention MACs and memory side by side, saves both under runs/demo/, reloads one
# with AutoModelForCausalLM and generates a sample. About 5 minutes on 2 idle CPU cores.
# torch comes from the pinned CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/require_venv.sh
require_venv scripts/demo.sh  # installs only into a virtual environment (or with SWITCHHEAD_ALLOW_SYSTEM_PYTHON=1)
python -m pip install -q "torch==2.13.0" "triton==3.7.1"
python -m pip install -q "transformers==5.23.0" -e ".[train]"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf runs/demo  # the demo's own output folder: every run starts fresh
time switchhead train --demo --output-dir runs/demo "$@"
