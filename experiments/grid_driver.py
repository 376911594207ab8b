"""The loop shared by the resumable background grids (`replicate_cpu.py`, `experts_vs_gate.py`,
`routing_vs_projection.py`): run the unfinished runs of the plan in order, each in a child process of the grid's own
script, one at a time or several side by side (`--workers`), until none is left.

A grid hands in its plan and its record reader; everything else (spec files, starts with their git state, CPU and
wall time per attempt, failed attempts, rewriting the results pages in a fresh process after every run) is the same
for every grid, so it lives here once.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import replicate  # noqa: E402  (the default folders; RunSpec, the type of a plan)
import replicate_cpu


def spawn(command: list[str]) -> int:
    """Start one run's child process; its pid (the driver reaps it with `wait_any`). posix_spawn, not a dropped
    Popen: subprocess polls dropped Popens whenever it starts another process (the pages' rewrite) and would reap a
    finished run before wait_any saw it."""
    return os.posix_spawn(command[0], command, os.environ)


def wait_any() -> tuple[int, int, float]:
    """Wait for any child run to end: (pid, exit status, CPU seconds of that child alone). os.wait4 gives each
    child's own usage, which RUSAGE_CHILDREN cannot once runs overlap."""
    pid, status, usage = os.wait4(-1, 0)
    return pid, os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def run_grid(args, script: Path, finished_records: Callable[[], dict[str, dict]],
             plan: Callable[[dict[str, dict]], tuple[list["replicate.RunSpec"], list[str]]]) -> int:
    """Run the unfinished runs of the plan until none is left, up to `args.workers` at once (default 1); every
    decision is re-read from the run folders before each start.

    Runs start in plan order; with several workers a run may finish before one started earlier. A plan that depends
    on finished runs (a sweep that picks an lr) is re-read after every run, so what is started never depends on a
    run still in flight beyond what the plan itself lists as decided.

    `args`: the grid's parsed arguments (out, data, threads, results_dir, only, no_report, tiny, workers); `script`:
    the grid's script, started as `script --run NAME` for one run and `script --report-only` for the pages;
    `finished_records()`: the finished runs by name; `plan(records)`: (the runs decided so far in order, what is
    not yet decided)."""
    specs_dir = args.out / "specs"
    specs_dir.mkdir(exist_ok=True)
    attempts_file = args.out / "attempts.json"
    passed = ["--tiny"] if args.tiny else []
    workers = args.workers
    if workers < 1:
        raise SystemExit(f"--workers {workers}: give 1 or more runs at once")
    running: dict[int, tuple["replicate.RunSpec", float]] = {}  # pid -> (spec, start time)
    while True:
        records = finished_records()
        runs, undecided = plan(records)
        failed = set(replicate_cpu.failures(args.out))
        in_flight = {spec.name for spec, _ in running.values()}
        todo = [s for s in runs if s.name not in records and s.name not in failed and s.name not in in_flight]
        if args.only:
            todo = [s for s in todo if re.search(args.only, s.name)]
        if not todo and not running:
            print(f"[grid] nothing left to run ({len(records)} finished; undecided: {undecided or 'none'}; "
                  f"failed: {sorted(failed) or 'none'})", flush=True)
            return 0 if not failed else 1
        if todo and len(running) < workers:
            spec = todo[0]
            spec_file = specs_dir / f"{spec.name}.json"
            if spec_file.is_file() and json.loads(spec_file.read_text()) != dataclasses.asdict(spec):
                raise SystemExit(f"{spec_file} differs from the grid's spec of {spec.name}: the grid changed under "
                                 "a started run; move its folder away or restore the grid")
            replicate_cpu.write_json(spec_file, dataclasses.asdict(spec))
            starts_file = specs_dir / f"{spec.name}.starts.json"
            starts = json.loads(starts_file.read_text()) if starts_file.is_file() else []
            replicate_cpu.write_json(starts_file, starts + [replicate_cpu.git_state()])
            print(f"[grid] {datetime.datetime.now(datetime.timezone.utc):%FT%TZ} {spec.name}: "
                  f"{'resuming' if starts else 'starting'} ({spec.label})", flush=True)
            pid = spawn([sys.executable, str(script), "--out", str(args.out), "--data", args.data,
                         "--threads", str(args.threads), "--run", spec.name] + passed)
            running[pid] = (spec, time.time())
            continue
        pid, code, cpu = wait_any()
        if pid not in running:  # not a run of ours (nothing else is started without being waited for)
            continue
        spec, started = running.pop(pid)
        wall = time.time() - started
        print(f"[grid] {spec.name}: exit {code} after {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
        # CPU and wall seconds of the attempts this driver saw end (a driver killed with its child never writes
        # them: then the run's accounting is incomplete, and the results page says so)
        timing = replicate_cpu.read_timing(specs_dir, spec.name)
        replicate_cpu.write_json(specs_dir / f"{spec.name}.cpu.json", dict(
            cpu_seconds=timing["cpu_seconds"] + cpu, wall_seconds=timing["wall_seconds"] + wall,
            attempts=timing["attempts"] + 1))
        if code != 0 or not (args.out / spec.name / replicate_cpu.FINISHED).is_file():
            # counted; the next pass resumes it from its checkpoint, until MAX_ATTEMPTS
            counts = json.loads(attempts_file.read_text()) if attempts_file.is_file() else {}
            counts[spec.name] = counts.get(spec.name, 0) + 1
            replicate_cpu.write_json(attempts_file, counts)
        if not args.no_report:  # in a fresh process: the pages come from the code as it is now, not as it was
            subprocess.call([sys.executable, str(script), "--out", str(args.out), "--data", args.data,
                             "--results-dir", str(args.results_dir), "--report-only"] + passed)


def parser(description: str, default_out: Path) -> argparse.ArgumentParser:
    """The options every grid script takes (a grid adds its own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out, help="run folders")
    parser.add_argument("--data", default=replicate.DEFAULT_DATA, help="WikiText-2 folder")
    parser.add_argument("--results-dir", type=Path, default=replicate.RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--workers", type=int, default=1,
                        help="runs at once, each a process of --threads torch threads (one per core: --workers 2 on a "
                        "2-core machine); they start in the grid's order")
    parser.add_argument("--only", default=None, help="regular expression: run only the matching run names")
    parser.add_argument("--pgid-file", type=Path, default=None,
                        help="write this process group's id here (the launcher uses OUT/grid.pgid)")
    parser.add_argument("--no-report", action="store_true", help="do not rewrite the results pages after a run")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the results pages")
    parser.add_argument("--same-stamp", action="store_true",
                        help="with --report-only: keep the committed page's commit, time and machine (the pages "
                        "then come out byte for byte the same when no run and no code that renders them changed)")
    parser.add_argument("--list", action="store_true", help="print the grid as decided now and exit")
    parser.add_argument("--tiny", action="store_true", help="tiny models and runs (for the tests)")
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)  # one run, in a child process
    return parser


def committed_stamp(results_dir: Path, stem: str) -> dict:
    """The commit, time and machine stamped on the committed page `results_dir/<stem>.json` (--same-stamp)."""
    path = results_dir / f"{stem}.json"
    if not path.is_file():
        raise SystemExit(f"--same-stamp: {path} does not exist; rewrite the pages without --same-stamp")
    page = json.loads(path.read_text())
    return {key: page[key] for key in ("code", "written", "machine") if key in page}


def print_plan(records: dict[str, dict], plan: Callable[[dict[str, dict]], tuple[list, list[str]]],
               width: int = 22) -> int:
    """--list: every run decided now, in order, finished or not, then what is not yet decided."""
    runs, undecided = plan(records)
    for spec in runs:
        print(f"{spec.name:{width}s} {'finished' if spec.name in records else '-':9s} {spec.label}")
    for line in undecided:
        print(f"undecided: {line}")
    return 0


def start(args, scale) -> int | None:
    """What every grid script does first: the run folder made and resolved, the data folder checked; in a run's
    child process (--run NAME), that run at `scale` (its exit status is returned); in the driver, the process group
    id written to --pgid-file. Returns None where the script goes on."""
    replicate_cpu.SCALE = scale  # replicate_cpu's run child and plot read their module's scale
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    replicate.split_file(args.data, "train")
    if args.run is not None:
        return replicate_cpu.run_child(args.run, args.out, args.data, args.threads)
    if args.pgid_file is not None:
        args.pgid_file.write_text(f"{os.getpgid(0)}\n")
    return None
