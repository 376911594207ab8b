#!/usr/bin/env bash
# Start, or resume, one of the resumable grids (experts_vs_gate.py, routing_vs_projection.py) in the background:
# one torch thread, nice 19, in a session of its own so that it outlives the shell that started it. Finished runs are
# skipped and an interrupted run resumes from its checkpoint, so running this again after a stop or a reboot
# continues the grid.
#
#   experiments/run_grid.sh SCRIPT OUT [ARGS]          # start / resume experiments/SCRIPT; run folders, log and pgid
#                                                     # file in OUT (ARGS go to SCRIPT)
#   kill -STOP -$(cat OUT/grid.pgid)                  # pause the whole grid (driver and its run)
#   kill -CONT -$(cat OUT/grid.pgid)                  # resume it
#   kill -TERM -$(cat OUT/grid.pgid)                  # stop it (the next start resumes from the last checkpoint)
#   tail -f OUT/grid.log
#   experiments/run_grid.sh SCRIPT OUT --workers 2     # two runs side by side, one per core (each --threads 1); they
#                                                     # start in the grid's order and share the process group
#
# PYTHON (default: python3 on PATH) picks the interpreter that has the switchhead package installed.
set -euo pipefail
if [ $# -lt 2 ] || [ "${2#-}" != "$2" ] || [ ! -f "$(dirname "$0")/$1" ]; then
    echo "usage: $0 SCRIPT OUT [SCRIPT arguments]  (SCRIPT: a grid script in experiments/)" >&2
    exit 2
fi
SCRIPT=$1
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PGID_FILE="$OUT/grid.pgid"
LOG="$OUT/grid.log"
if [ -f "$PGID_FILE" ] && kill -0 -- "-$(cat "$PGID_FILE")" 2>/dev/null; then
    echo "the grid is already running (process group $(cat "$PGID_FILE")); not starting a second one" >&2
    exit 1
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
echo "[run_grid.sh] $(date -u +%FT%TZ) $SCRIPT starting at commit $(git rev-parse --short HEAD)" >> "$LOG"
# setsid: a new session and process group whose id the driver writes to PGID_FILE (kill -STOP -PGID pauses it all)
setsid nohup nice -n 19 "$PY" "experiments/$SCRIPT" --out "$OUT" --threads 1 --pgid-file "$PGID_FILE" "$@" \
    >> "$LOG" 2>&1 < /dev/null &
echo "started: pid $!, log $LOG, process group id in $PGID_FILE"
