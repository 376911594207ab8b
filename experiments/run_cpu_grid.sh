#!/usr/bin/env bash
# Start, or resume, the cpu grid (experiments/replicate_cpu.py) in the background: one torch thread, nice 19,
# in a session of its own so that it outlives the shell that started it. Finished runs are skipped and an
# interrupted run resumes from its checkpoint, so running this again after a stop or a reboot continues the grid.
#
#   experiments/run_cpu_grid.sh                        # start / resume (extra arguments go to replicate_cpu.py);
#                                                     # after the last run, the zero-shot step
#   kill -STOP -$(cat runs/replication-cpu/grid.pgid) # pause the whole grid (driver and its run)
#   kill -CONT -$(cat runs/replication-cpu/grid.pgid) # resume it
#   kill -TERM -$(cat runs/replication-cpu/grid.pgid) # stop it (the next start resumes from the last checkpoint)
#   tail -f runs/replication-cpu/grid.log
#
# PYTHON (default: python3 on PATH) and PGID_FILE (default: grid.pgid in the run folder) can be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PGID_FILE=${PGID_FILE:-runs/replication-cpu/grid.pgid}
LOG=runs/replication-cpu/grid.log
mkdir -p runs/replication-cpu
if [ -f "$PGID_FILE" ] && kill -0 -- "-$(cat "$PGID_FILE")" 2>/dev/null; then
    echo "the grid is already running (process group $(cat "$PGID_FILE")); not starting a second one" >&2
    exit 1
fi
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
echo "[run_cpu_grid.sh] $(date -u +%FT%TZ) starting at commit $(git rev-parse --short HEAD)" >> "$LOG"
# setsid: a new session and process group whose id the driver writes to PGID_FILE (kill -STOP -PGID pauses it all)
# --then-zero-shot: when the last run has finished, BLiMP / LAMBADA of the 3-seed models (same process group)
setsid nohup nice -n 19 "$PY" experiments/replicate_cpu.py --threads 1 --pgid-file "$PGID_FILE" --then-zero-shot "$@" \
    >> "$LOG" 2>&1 < /dev/null &
echo "started: pid $!, log $LOG, process group id in $PGID_FILE"
