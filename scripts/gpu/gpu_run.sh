#!/usr/bin/env bash
# The GPU benchmarks and their correctness checks in one run, on a CUDA machine, from the repository root
# (scripts/gpu/GPU.md is the guide):
#   bash scripts/gpu/gpu_run.sh all [--time-budget SECONDS] [--stages LIST] [--cvmm-only TEXT]   # default 540 s
#   bash scripts/gpu/gpu_run.sh smoke [--time-budget SECONDS]   # the same sequence on the CPU, Triton interpreted
#   bash scripts/gpu/gpu_run.sh check|cvmm|e2e [args]           # one script alone, its arguments passed on
# `all` runs the stages of --stages (comma separated, in that order, each at most once), each as its own process
# with its own share of the budget, and starts no stage that the time left cannot hold, so that a run with a fixed
# time still ends with the stages before it complete. The default, check,e2e,e2e_compiled,e2e_262m,e2e_eager,compile:
#   check: correctness (gpu_check.py: paper shapes, >= 100 random problems, whole models, cached decoding);
#   e2e: end to end (bench_e2e.py: the 47M RoPE and XL pairs, training step, memory, decode after 1024 tokens);
#   e2e_compiled: the 47M RoPE pair decoding through generate's compiled step with a static cache (CUDA graphs);
#   e2e_262m: the 262M RoPE pair; e2e_eager: the 47M pairs with SwitchHead's experts on the PyTorch path;
#   compile: the inductor-compiled training step and static-cache generate against eager (correctness).
# e2e_moeut (not in the default): MoEUT 44M against the dense 44M baseline of its paper (bench_e2e.py --only moeut):
# a training step at MoEUT's batch 64 x 1024, peak memory, prefill and greedy decoding at batch 1 and 32.
# cvmm (kernel speed alone, bench_cvmm.py --full: paper shapes, bf16, against dense mm, grouped_mm, a loop, the
# authors' kernel; --cvmm-only "c4-262m,switchall" times only the problems and layers whose names contain one of the
# texts) is not in the default, which measures whole models: `--stages check,cvmm,...` adds it.
# Each stage writes its JSON as it goes (a stage stopped at its limit keeps what it finished); the JSON files, the
# log and summary.json (every stage's status, seconds and budget) are copied to $OUT (default ./gpu_out) after
# each stage. scripts/gpu/gpu_report.py renders them, on any machine.
# The run imports this checkout, not an installed copy: a throw-away folder of links makes `import switchhead`
# resolve to it (modeling_switchhead/ -> switchhead, kernels/ -> switchhead.kernels, ...), as setup.py maps it, so
# nothing needs installing and the figures are of the code checked out. The authors' CVMM kernel is timed when
# .authors/cvmm.py exists (scripts/gpu/GPU.md says where it comes from; it is never committed).
set -euo pipefail
stage=${1:?usage: bash scripts/gpu/gpu_run.sh all|smoke|check|cvmm|e2e [args]}
shift || true
root=$(pwd)
out=${OUT:-$root/gpu_out}
mkdir -p "$out"
shim=$(mktemp -d)
work=$(mktemp -d)  # every file the scripts write; only the JSONs go on to $OUT
trap 'rm -rf "$shim" "$work"' EXIT
# the package as setup.py installs it, as links (scripts/package_tree.py reads setup.py's table, so none is missed)
subpackages=$(python3 "$root/scripts/package_tree.py" "$shim")
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
log="$out/log.txt"
# the package and each subpackage resolve inside the shim (an installed copy, e.g. an editable install's finder,
# would otherwise fill in a subpackage the shim lacks here and hide the gap until the machine without it)
python3 - "$shim" $subpackages <<'PY'
import importlib.util, sys
import switchhead
shim = sys.argv[1]
assert switchhead.__file__.startswith(shim), switchhead.__file__
for pair in sys.argv[2:]:
    name = "switchhead." + pair.split("=")[0]
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin.startswith(shim), (name, spec and spec.origin)
PY
python3 - <<'PY' | tee -a "$log"
import platform, subprocess, torch, transformers
import triton
print("python", platform.python_version(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| transformers", transformers.__version__)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "| CUDA", torch.version.cuda)
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip())
PY
authors=()
[ -f "$root/.authors/cvmm.py" ] && authors=(--authors-cvmm .authors/cvmm.py)
# the log names no folder of this run's machine: the temporary folders, the checkout and site-packages are rewritten
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
portable() { sed -u -e "s#$work#WORK#g" -e "s#$shim#SHIM#g" -e "s#$site/#site-packages/#g" -e "s#$root/##g" -e "s#$root#.#g"; }
run() { echo "+ $*" | portable | tee -a "$log"; "$@" 2>&1 | portable | tee -a "$log"; }

# ------------------------------------------------------------------------------------------ one script alone
single() {
    local status=0
    case "$stage" in
        check) run python3 scripts/gpu/gpu_check.py --out-dir "$out" "$@" || status=$? ;;
        cvmm) run python3 benchmarks/bench_cvmm.py --full "${authors[@]}" --out "$out/cvmm_full.json" "$@" || status=$? ;;
        e2e) run python3 benchmarks/bench_e2e.py --out-dir "$out" "$@" || status=$? ;;
    esac
    return $status
}

# ------------------------------------------------------------------------------------------ the whole run
budget=540
cvmm_only=""
ALL_STAGES="check check_model long_train decode_floor profiles prefill generate_host e2e e2e_compiled e2e_262m e2e_eager e2e_moeut cvmm compile"
# the default: whole models checked, then timed; the kernel timings alone only when asked for (--stages)
stages_arg=check,e2e,e2e_compiled,e2e_262m,e2e_eager,compile
smoke=()
if [[ "$stage" == "all" || "$stage" == "smoke" ]]; then
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --time-budget) budget=${2:?--time-budget needs seconds}; shift 2 ;;
            --cvmm-only) cvmm_only=${2:?--cvmm-only needs a text}; shift 2 ;;
            --stages) stages_arg=${2:?--stages needs a comma separated list}; shift 2 ;;
            *) echo "gpu_run.sh: error: $stage takes only --time-budget SECONDS, --cvmm-only TEXT and --stages LIST" \
                    "(got $1)" >&2
               exit 2 ;;
        esac
    done
    IFS=, read -r -a stage_list <<< "$stages_arg"
    for name in "${stage_list[@]}"; do
        [[ " $ALL_STAGES " == *" $name "* ]] || {
            echo "gpu_run.sh: error: unknown stage '$name' in --stages (stages: $ALL_STAGES)" >&2; exit 2; }
    done
    ((${#stage_list[@]} >= 1)) || { echo "gpu_run.sh: error: --stages names no stage" >&2; exit 2; }
    # each stage writes one JSON under its own name: a second run of a stage would replace the first one's
    duplicate=$(printf '%s\n' "${stage_list[@]}" | sort | uniq -d | head -n 1)
    [[ -z "$duplicate" ]] || {
        echo "gpu_run.sh: error: stage '$duplicate' is named twice in --stages (its JSON would be replaced)" >&2
        exit 2; }
    [[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_run.sh: error: --time-budget must be whole seconds" >&2; exit 2; }
    [[ "$stage" == "smoke" ]] && smoke=(--cpu-smoke)
fi
deadline=$((SECONDS + budget))
stages=()  # summary.json entries

# run_stage NAME SHARE GRACE MINIMUM -- COMMAND...: runs COMMAND with STAGE_BUDGET (its share, or the time left if
# less) exported for it to pass on, under a hard limit of that plus GRACE seconds, unless less than MINIMUM seconds
# are left; records its status; then copies the JSONs to $OUT.
run_stage() {
    local name=$1 share=$2 grace=$3 minimum=$4
    shift 5
    local left=$((deadline - SECONDS - 5)) status=0 begun=$SECONDS
    if ((left < minimum)); then
        echo "== $name: not started ($left s left, it needs $minimum)" | tee -a "$log"
        stages+=("{\"stage\": \"$name\", \"status\": \"not run\", \"left_s\": $left}")
        return 0
    fi
    export STAGE_BUDGET=$((share < left - grace ? share : left - grace))
    ((STAGE_BUDGET < 1)) && STAGE_BUDGET=1
    local limit=$((STAGE_BUDGET + grace < left ? STAGE_BUDGET + grace : left))
    echo "== $name: budget $STAGE_BUDGET s, hard limit $limit s" | tee -a "$log"
    run timeout --signal=TERM --kill-after=10 "$limit" "$@" || status=$?
    local state=ok
    ((status == 124 || status == 137)) && state="stopped at its limit"
    ((status != 0 && status != 124 && status != 137)) && state="failed (exit $status)"
    stages+=("{\"stage\": \"$name\", \"status\": \"$state\", \"exit\": $status, \"seconds\": $((SECONDS - begun)), \"budget_s\": $STAGE_BUDGET, \"limit_s\": $limit}")
    publish
    return 0
}

publish() {  # the JSONs and the summary to $OUT (a copy, then a rename: a reader never sees half a file)
    local f
    for f in "$work"/*.json; do
        [ -e "$f" ] || continue
        cp "$f" "$out/.$(basename "$f").part" && mv "$out/.$(basename "$f").part" "$out/$(basename "$f")"
    done
    local IFS=,
    printf '{"budget_s": %s, "elapsed_s": %s, "smoke": %s, "stages": [%s]}\n' "$budget" "$SECONDS" \
        "$([[ ${#smoke[@]} -gt 0 ]] && echo true || echo false)" "${stages[*]:-}" > "$out/.summary.part"
    mv "$out/.summary.part" "$out/summary.json"
}

whole_run() {
    local cases=120 tokens=8192 e2e_only=47m check_sections=paper,sweep,model cvmm_only=$cvmm_only
    local contenders=("${authors[@]}") jobs=$(( $(nproc) > 16 ? 16 : $(nproc) )) full=(--full)
    local compiled_batches=32,1
    if [[ ${#smoke[@]} -gt 0 ]]; then  # tiny; the authors' kernel needs a GPU driver even interpreted
        cases=4; tokens=48; e2e_only=47m-rope; contenders=(); jobs=2; full=()
        cvmm_only=wt103-47m-switchhead-xl/v  # interpreted: one problem is minutes
        compiled_batches=1
    fi
    local name
    for name in "${stage_list[@]}"; do
        case "$name" in
            # a. correctness: the op sections (Triton compiles in a pool, one process per core: compiling is most
            # of a fresh machine's time) get the budget less 90 s for the whole-model checks after them; each
            # random problem in fp32 and one other precision in turn (--sweep-precisions rotate), so that 100 or
            # more fit
            check) run_stage check 220 90 60 -- bash -c 'exec python3 scripts/gpu/gpu_check.py "$@" --time-budget $((STAGE_BUDGET > 120 ? STAGE_BUDGET - 90 : 30))' _ \
                "${smoke[@]}" --sections "$check_sections" --cases "$cases" --max-tokens "$tokens" --jobs "$jobs" \
                --sweep-precisions rotate --name gpu_check --no-markdown --out-dir "$work" ;;
            # the whole-model checks alone (fp32 with ReLU decisions held, bf16 against fp32, cached decoding): what
            # the matrices below rest on, without the op sweep that has passed in earlier runs
            check_model) run_stage check_model 120 30 45 -- bash -c 'exec python3 scripts/gpu/gpu_check.py "$@"' _ \
                "${smoke[@]}" --sections model --jobs "$jobs" --name gpu_check_model --no-markdown --out-dir "$work" ;;
            # the long-context training matrix (65,536 tokens a step; bench_long_context.py)
            long_train) run_stage long_train 230 40 60 -- bash -c 'exec python3 benchmarks/bench_long_context.py train "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --out "$work/long_train.json" ;;
            # decoding against its HBM floor, the step captured in a CUDA graph (bench_decode_floor.py)
            decode_floor) run_stage decode_floor 110 30 45 -- bash -c 'exec python3 benchmarks/bench_decode_floor.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --out "$work/decode_floor.json" ;;
            # kernel tables of one training and one decoding step per model (profile_steps.py)
            profiles) run_stage profiles 60 20 30 -- python3 benchmarks/profile_steps.py "${smoke[@]}" \
                --out "$work/profiles.json" ;;
            # prefill at batch 1, 1k and 16k tokens, graph-captured (bench_long_context.py prefill)
            prefill) run_stage prefill 45 20 30 -- python3 benchmarks/bench_long_context.py prefill "${smoke[@]}" \
                --out "$work/prefill.json" ;;
            # what a step of compiled generate (static cache, CUDA graphs) costs on the host: tiny models, Transformers'
            # Llama as the control (bench_generate_host.py)
            generate_host) run_stage generate_host 90 30 60 -- bash -c 'exec python3 benchmarks/bench_generate_host.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --reps 3 --out "$work/generate_host.json" ;;
            # c. end to end, the 47M pairs: the figures the package exists for
            e2e) run_stage e2e 160 60 60 -- bash -c 'exec python3 benchmarks/bench_e2e.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --only "$e2e_only" --name e2e --no-markdown --out-dir "$work" ;;
            # ... decoding through generate's compiled step with a static cache (CUDA graphs): the eager loop is
            # bound by kernel launches, not by the KV cache's bytes that SwitchHead saves
            e2e_compiled) run_stage e2e_compiled 150 60 90 -- bash -c 'exec python3 benchmarks/bench_e2e.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --only 47m-rope --compiled-decode --decode-batches "$compiled_batches" --reps 3 \
                --name e2e_compiled --no-markdown --out-dir "$work" ;;
            # ... and again with SwitchHead's experts on the PyTorch path ("eager"), which beat the kernel on an H100
            e2e_eager) run_stage e2e_eager 110 45 60 -- bash -c 'exec python3 benchmarks/bench_e2e.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --only "$e2e_only" --reps 2 --experts-implementation eager --name e2e_eager --no-markdown \
                --out-dir "$work" ;;
            # MoEUT 44M against its paper's dense 44M baseline: one pair, two repetitions of two steps each (the
            # pair's JSON is written only when it ends, so its limit leaves room for the whole pair)
            e2e_moeut) run_stage e2e_moeut 90 30 60 -- bash -c 'exec python3 benchmarks/bench_e2e.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --only moeut-44m --reps 2 --train-steps 2 --name e2e_moeut --no-markdown --out-dir "$work" ;;
            # b. kernel speed (paper shapes on CUDA; the interpreter's small shapes in the smoke)
            cvmm) run_stage cvmm 120 45 45 -- bash -c 'exec python3 benchmarks/bench_cvmm.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" "${full[@]}" ${cvmm_only:+--only "$cvmm_only"} "${contenders[@]}" --no-markdown \
                --out "$work/cvmm.json" ;;
            # d. the 262M RoPE pair, then the compiled training step and generate (correctness)
            e2e_262m) run_stage e2e_262m 170 60 120 -- bash -c 'exec python3 benchmarks/bench_e2e.py "$@" --time-budget $STAGE_BUDGET' _ \
                "${smoke[@]}" --only 262m-rope --reps 2 --name e2e_262m --no-markdown --out-dir "$work" ;;
            compile) run_stage compile 600 0 90 -- python3 scripts/gpu/gpu_check.py "${smoke[@]}" --sections compile \
                --name gpu_check_compile --no-markdown --out-dir "$work" ;;
        esac
    done
    publish
}

status=0
case "$stage" in
    check|cvmm|e2e) single "$@" || status=$? ;;
    all|smoke) whole_run ;;
    *) echo "gpu_run.sh: error: unknown stage $stage (all, smoke, check, cvmm or e2e)" >&2; exit 2 ;;
esac
exit $status
