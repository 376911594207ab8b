#!/usr/bin/env bash
# Start, or resume, the cpu grid (experiments/replicate_cpu.py) in the background through run_grid.sh (one torch
# thread, nice 19, outliving the shell that started it; finished runs skipped, an interrupted one resumed from its
# checkpoint), in runs/replication-cpu of the checkout; after the last run, the zero-shot step.
#
#   experiments/run_cpu_grid.sh [ARGS]                 # start / resume (ARGS go to replicate_cpu.py)
#   kill -STOP -$(cat runs/replication-cpu/grid.pgid) # pause the whole grid (driver and its run)
#   kill -CONT -$(cat runs/replication-cpu/grid.pgid) # resume it
#   kill -TERM -$(cat runs/replication-cpu/grid.pgid) # stop it (the next start resumes from the last checkpoint)
#   tail -f runs/replication-cpu/grid.log
#
# PYTHON (default: python3 on PATH) picks the interpreter that has the switchhead package installed.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# --then-zero-shot: when the last run has finished, BLiMP / LAMBADA of the 3-seed models (same process group)
exec "$HERE/run_grid.sh" replicate_cpu.py "$HERE/../runs/replication-cpu" --then-zero-shot "$@"
