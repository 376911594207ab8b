# Sourced by scripts/demo.sh and scripts/test.sh before they install anything: they pin torch, triton and
# Transformers, which would replace (e.g. downgrade) the packages of whichever Python is first on PATH. They install
# only into a virtual environment, or where SWITCHHEAD_ALLOW_SYSTEM_PYTHON=1 says that Python may be changed.
require_venv() {  # $1: the script's name, for the error line
    if [[ "${SWITCHHEAD_ALLOW_SYSTEM_PYTHON:-0}" == 1 ]]; then
        return 0
    fi
    if ! python -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' 2>/dev/null; then
        echo "$1: error: $(command -v python || echo python) is not in a virtual environment and this script would" \
             "install pinned packages into it; run 'python -m venv .venv && . .venv/bin/activate' first, or set" \
             "SWITCHHEAD_ALLOW_SYSTEM_PYTHON=1 to install into it anyway" >&2
        exit 2
    fi
}
