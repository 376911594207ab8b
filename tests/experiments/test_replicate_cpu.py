"""experiments/replicate_cpu.py (the cpu grid): a run killed mid-training and resumed by the grid ends bitwise equal
to an uninterrupted one; a finished run is never run again; the grid's order and learning-rate choice."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.data import require

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "experiments" / "replicate_cpu.py"
RUN = "lr0.002-switchhead-s0"  # the tiny grid's first run
TINY_STEPS = 60  # its length (replicate_cpu.use_tiny), checkpoints every 10 steps

pytestmark = pytest.mark.integration  # trains the experiment grid's tiny runs


def _load():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("replicate_cpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grid = _load()
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", RAYON_NUM_THREADS="1",
           TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def command(tmp: Path, out: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp / out), "--data", str(tmp / "data"),
            "--results-dir", str(tmp / f"results-{out}"), "--only", f"^{RUN}$"]


def losses(run: Path) -> list[tuple[str, str, str]]:
    with open(run / "log.csv", newline="") as handle:
        return [(row["step"], row["loss"], row["valid_loss"]) for row in csv.DictReader(handle)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The tiny grid's first run three ways: uninterrupted (`reference`), and killed with SIGKILL (driver and child
    together, as `kill -KILL -PGID` would) after its first checkpoint, then resumed by starting the grid again."""
    wikitext2 = require("wikitext-2") / "wikitext-2"
    tmp = tmp_path_factory.mktemp("replicate_cpu")
    (tmp / "data").mkdir()
    for split in ("train", "valid", "test"):
        with open(wikitext2 / f"wiki.{split}.tokens", encoding="utf-8") as handle:
            (tmp / "data" / f"wiki.{split}.tokens").write_text(handle.read(60_000), encoding="utf-8")
    done = subprocess.run(command(tmp, "reference"), capture_output=True, text=True, env=ENV, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    run = tmp / "killed" / RUN
    process = subprocess.Popen(command(tmp, "killed"), env=ENV, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while process.poll() is None and time.time() < deadline:
        if (run / "checkpoints").is_dir() and any(p.name.startswith("step-") for p in (run / "checkpoints").iterdir()):
            os.killpg(process.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert 0 < len(losses(run)) < TINY_STEPS, "not killed during training"
    assert not (run / grid.FINISHED).exists()
    resumed = subprocess.run(command(tmp, "killed"), capture_output=True, text=True, env=ENV, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(rf"^\[grid\] \S+Z {re.escape(RUN)}: resuming ", resumed.stdout, re.M)  # the shared driver's line
    return tmp


def test_a_killed_and_resumed_run_equals_an_uninterrupted_one(runs):
    reference, resumed = runs / "reference" / RUN, runs / "killed" / RUN
    assert json.loads((resumed / "train_result.json").read_text())["resumed"] is True
    assert json.loads((reference / "train_result.json").read_text())["resumed"] is False
    # every step logged, with the same loss and validation loss, in the same order
    assert losses(resumed) == losses(reference) and len(losses(reference)) == TINY_STEPS
    want, got = load_file(reference / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name  # bitwise
    a, b = (json.loads((r / grid.FINISHED).read_text()) for r in (reference, resumed))
    assert a["perplexity"] == {split: {**b["perplexity"][split], "seconds": a["perplexity"][split]["seconds"]}
                               for split in b["perplexity"]}
    assert a["routing"] == b["routing"] and a["routing_summary"]["routers"] == 2  # one layer: value and output
    # both starts of the interrupted run are recorded with their commit; the uninterrupted run has one
    assert len(b["code"]) == 2 and len(a["code"]) == 1 and len(a["code"][0]["commit"]) == 40
    timed = {name: grid.finished_records(runs / name) for name in ("reference", "killed")}
    for name, records in timed.items():
        grid.add_timing(runs / name, records)
    reference_timing, resumed_timing = timed["reference"][RUN], timed["killed"][RUN]
    assert reference_timing["timing_complete"] and reference_timing["cpu_seconds"] > 0
    # the killed attempt's driver died with it, so only the resumed attempt was timed: marked incomplete
    assert not resumed_timing["timing_complete"] and resumed_timing["cpu_seconds"] > 0


@pytest.mark.integration
def test_a_finished_run_is_never_run_again(runs):
    run = runs / "killed" / RUN
    stamps = {name: (run / name).stat().st_mtime_ns for name in (grid.FINISHED, "model.safetensors", "log.csv")}
    again = subprocess.run(command(runs, "killed"), capture_output=True, text=True, env=ENV, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing left to run" in again.stdout and "starting" not in again.stdout and "resuming" not in again.stdout
    assert {name: (run / name).stat().st_mtime_ns for name in stamps} == stamps
    starts = json.loads((runs / "killed" / "specs" / f"{RUN}.starts.json").read_text())
    assert len(starts) == 2  # no third start was recorded
    page = (runs / "results-killed" / "replication_cpu.md").read_text()
    assert RUN in page and "Analysis, stated before the runs" in page


@pytest.mark.integration
def test_a_run_finished_on_an_earlier_machine_is_not_run_again(runs, tmp_path):
    """A fresh checkout has no run folders: the committed results page is what says which runs are finished."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "replication_cpu.json").write_text((runs / "results-killed" / "replication_cpu.json").read_text())
    fresh = [c if c != str(runs / "results-fresh") else str(results) for c in command(runs, "fresh")]
    again = subprocess.run(fresh, capture_output=True, text=True, env=ENV, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "nothing left to run" in again.stdout and "starting" not in again.stdout
    assert not (runs / "fresh" / RUN).exists()  # nothing was trained
    page = json.loads((results / "replication_cpu.json").read_text())
    assert RUN in page["finished"] and page["runs"][RUN]["cpu_seconds"] > 0  # the earlier machine's timing kept
    other_scale = json.loads((runs / "results-killed" / "replication_cpu.json").read_text())
    other_scale["scale"]["max_steps"] += 1  # a page written at another scale says nothing about this grid's runs
    (results / "replication_cpu.json").write_text(json.dumps(other_scale))
    again = subprocess.run(fresh, capture_output=True, text=True, env=ENV, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"{RUN}: starting" in again.stdout and (runs / "fresh" / RUN / grid.FINISHED).is_file()


def _record(name: str, valid: float, role: str, seed: int, lr: float, position: str = "rope") -> dict:
    return dict(name=name, role=role, seed=seed, learning_rate=lr, position=position,
                perplexity={"valid": {"perplexity": valid}, "test": {"perplexity": valid + 1}})


def test_order_and_learning_rate_choice():
    """The sweep comes first (every lr for the three models), a best lr at an edge of the sweep extends it by a
    factor of 2 before any seed runs, and the later stages use each model's own best lr."""
    records: dict[str, dict] = {}
    runs, undecided = grid.plan(records)
    first = [(s.role, s.training["learning_rate"], s.seed) for s in runs]
    assert first == [(role, lr, 0) for lr in grid.LEARNING_RATES for role in grid.MAIN_ROLES]
    assert undecided
    # SwitchHead best in the middle; dense-total best at the lowest lr; gate best at the highest lr
    valid = {"switchhead": {0.004: 150, 0.008: 140, 0.016: 145}, "dense-total": {0.004: 149, 0.008: 150, 0.016: 151},
             "gate": {0.004: 150, 0.008: 145, 0.016: 140}}
    for role, by_lr in valid.items():
        for lr, value in by_lr.items():
            spec = grid.model_spec(role, lr, 0)
            records[spec.name] = _record(spec.name, value, role, 0, lr)
    runs, undecided = grid.plan(records)
    todo = [s.name for s in runs if s.name not in records]
    assert todo[:2] == [grid.model_spec("dense-total", 0.002, 0).name, grid.model_spec("gate", 0.032, 0).name]
    assert any("dense-total" in line for line in undecided) and any("gate" in line for line in undecided)
    assert not any("switchhead" in line for line in undecided)
    # the extensions bracket both: 0.002 is worse than 0.004 for dense-total, 0.032 worse than 0.016 for gate
    for role, lr, value in (("dense-total", 0.002, 152), ("gate", 0.032, 141)):
        spec = grid.model_spec(role, lr, 0)
        records[spec.name] = _record(spec.name, value, role, 0, lr)
    runs, undecided = grid.plan(records)
    assert undecided == []
    todo = [s.name for s in runs if s.name not in records]
    assert todo[:6] == [grid.model_spec(role, lr, seed).name for seed in (1, 2)
                        for role, lr in (("switchhead", 0.008), ("dense-total", 0.004), ("gate", 0.016))]
    assert todo[6:] == [grid.model_spec("dense-active", 0.004, 0).name] + [
        grid.model_spec(role, 0.008, 0).name for role in ("E2", "E8", "Vonly", "Oonly")] + [
        grid.model_spec(role, lr, 0, "xl").name for role, lr in (("switchhead", 0.008), ("dense-total", 0.004),
                                                                 ("gate", 0.016))]


@pytest.mark.integration
def test_git_state_lists_changed_paths_whole_and_the_report_ignores_the_grids_own_pages(tmp_path, monkeypatch):
    """A change not yet staged starts its porcelain line with a space; the first path keeps its first letter. The
    report's +dirty counts changes to anything but the grid's own results pages."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    page = tmp_path / "benchmarks" / "results" / "replication_cpu.md"
    page.write_text("a")
    git("add", ".")
    git("commit", "-qm", "x")
    page.write_text("b")
    monkeypatch.setattr(grid, "REPO", tmp_path)
    state = grid.git_state()
    assert state["dirty"] == ["benchmarks/results/replication_cpu.md"]
    assert grid.changes_to_code(state["dirty"]) == []
    (tmp_path / "model.py").write_text("x = 1")
    state = grid.git_state()
    assert sorted(state["dirty"]) == ["benchmarks/results/replication_cpu.md", "model.py"]
    assert grid.changes_to_code(state["dirty"]) == ["model.py"]
    # records written before the fix: the first path lost its first letter
    assert grid.changes_to_code(["enchmarks/results/replication_cpu.json", "benchmarks/results/x.md"]) == \
        ["benchmarks/results/x.md"]


def test_zero_shot_scores_runs_whose_record_has_none_yet():
    """A finished run's record carries `zero_shot: None` until it is scored; `--zero-shot` must score it, and skip
    only a scored run or one that has not finished."""
    assert grid.unscored({"name": "lr0.004-switchhead-s0", "zero_shot": None})
    assert grid.unscored({"name": "lr0.004-switchhead-s0"})
    assert not grid.unscored({"name": "lr0.004-switchhead-s0", "zero_shot": {"blimp_acc": 0.6, "lambada_acc": 0.1}})
    assert not grid.unscored(None)
