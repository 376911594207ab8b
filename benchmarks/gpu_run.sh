#!/usr/bin/env bash
# One stage of the GPU session of issue #11, run on the device machine from the repository root:
#   bash benchmarks/gpu_run.sh check|cvmm|e2e|smoke [extra arguments for the stage's script]
# The package is not installed there: a throw-away folder of links makes `import switchhead` resolve to this
# checkout (modeling_switchhead/ -> switchhead, kernels/ -> switchhead.kernels, ...), as setup.py maps it.
# Results (JSON + Markdown) and a log go to $OUT (default ./gpu_out). The authors' CVMM kernel is timed when
# .authors/cvmm.py exists (see benchmarks/GPU.md: carry it, it is never committed).
set -euo pipefail
stage=${1:?usage: bash benchmarks/gpu_run.sh check|cvmm|e2e|smoke [args]}
shift || true
root=$(pwd)
out=${OUT:-$root/gpu_out}
mkdir -p "$out"
shim=$(mktemp -d)
mkdir -p "$shim/switchhead"
for f in "$root"/modeling_switchhead/*; do ln -s "$f" "$shim/switchhead/"; done
for sub in kernels training evaluation conversion; do
    [ -d "$root/$sub" ] && ln -s "$root/$sub" "$shim/switchhead/$sub"
done
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 -c "import switchhead, sys; assert switchhead.__file__.startswith('$shim'), switchhead.__file__"
python3 - <<'PY' | tee -a "$out/environment.txt"
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
[ -f "$root/.authors/cvmm.py" ] && authors=(--authors-cvmm "$root/.authors/cvmm.py")
run() { echo "+ $*" | tee -a "$out/log.txt"; "$@" 2>&1 | tee -a "$out/log.txt"; }
status=0
case "$stage" in
    check) run python3 benchmarks/gpu_check.py --out-dir "$out" "$@" || status=$? ;;
    cvmm) run python3 benchmarks/bench_cvmm.py --full "${authors[@]}" --out "$out/cvmm_full.json" "$@" || status=$? ;;
    e2e) run python3 benchmarks/bench_e2e.py --out-dir "$out" "$@" || status=$? ;;
    smoke)  # the CPU rehearsal of all three (no GPU needed)
        run python3 benchmarks/gpu_check.py --cpu-smoke --cases 2 --sections paper,sweep,model --out-dir "$out" || status=$?
        run python3 benchmarks/bench_cvmm.py --cpu-smoke "${authors[@]}" --out "$out/cvmm_smoke.json" || status=$?
        run python3 benchmarks/bench_e2e.py --cpu-smoke --only 47m-rope --out-dir "$out" || status=$? ;;
    *) echo "gpu_run.sh: error: unknown stage $stage (check, cvmm, e2e or smoke)" >&2; exit 2 ;;
esac
rm -rf "$shim"
exit $status
