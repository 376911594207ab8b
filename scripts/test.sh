#!/usr/bin/env bash
# Set up a fresh machine (CPU only, package registries only), run the whole test suite on the pinned Transformers
# release, then the compatibility subset under the other releases of the matrix (scripts/compat_matrix.py: the
# oldest supported, 5.19 for vLLM, and the newest on the registry), and print one line per release.
# torch comes from the local CPU wheel (pinned); an unpinned torch would pull a multi-GB CUDA build.
# Arguments go to pytest in every run (e.g. -ra). SWITCHHEAD_COMPAT_RELEASES=none skips the matrix.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" "triton==3.7.1"
python -m pip install -q "transformers==5.23.0" -e ".[test]"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

results="$(mktemp -d)"
started=$SECONDS
status=0
python -m pytest -q -p no:cacheprovider tests "$@" 2>&1 | tee "$results/main.log" || status=$?
main_seconds=$((SECONDS - started))

if [[ "${SWITCHHEAD_COMPAT_RELEASES:-}" == "none" ]]; then
    exit $status
fi
# the matrix builds its environments from the registry; its pytest runs are offline like this one
python scripts/compat_matrix.py --main-log "$results/main.log" \
    --main-seconds "$main_seconds" ${SWITCHHEAD_COMPAT_RELEASES:+--releases "$SWITCHHEAD_COMPAT_RELEASES"} "$@" \
    || status=1
exit $status
