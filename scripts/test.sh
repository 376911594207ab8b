#!/usr/bin/env bash
# Set up a fresh machine (CPU only, package registries only) and run the whole test suite.
# torch comes from the local CPU wheel (pinned); an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" "triton==3.7.1"
python -m pip install -q "transformers==5.23.0" -e ".[test]"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q -p no:cacheprovider tests "$@"
