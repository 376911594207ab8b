#!/usr/bin/env bash
# Start, or resume, the experts-vs-gate grid in the background (see run_grid.sh: nice 19, one thread, pausable with
# kill -STOP -$(cat OUT/grid.pgid)).
#
#   experiments/run_experts_vs_gate.sh OUT [ARGS]     # ARGS go to experts_vs_gate.py
set -euo pipefail
exec "$(dirname "$0")/run_grid.sh" experts_vs_gate.py "$@"
