#!/usr/bin/env bash
# Start, or resume, the routing-vs-projection grid in the background (see run_grid.sh: nice 19, one thread, pausable
# with kill -STOP -$(cat OUT/grid.pgid)).
#
#   experiments/run_routing_vs_projection.sh OUT [ARGS]     # ARGS go to routing_vs_projection.py
set -euo pipefail
exec "$(dirname "$0")/run_grid.sh" routing_vs_projection.py "$@"
