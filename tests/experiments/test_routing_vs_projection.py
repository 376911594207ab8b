"""experiments/routing_vs_projection.py (the second grid) and experiments/grid_driver.py (the loop every grid shares):
the arms and their parameter matching, fresh seeds, the interleaved order with its lr extension, the verdicts on
hand-made records, the driver's resume skip with a fake child. No training (test_grid_pages.py regenerates the
committed pages)."""

from __future__ import annotations

import json
import math
import shutil
import sys
import types
from pathlib import Path

import pytest

from helpers.grids import load_experiment

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"
RESULTS = REPO / "benchmarks" / "results"


grid = load_experiment("routing_vs_projection")
first = grid.first
driver = grid.grid_driver
STEPS = [240, 480, 720, 960, 1200]


def fake(arm: str, lr: float, seed: int, valid: float, test: float) -> dict:
    spec = first.model_spec(arm, lr, seed)
    losses = [math.log(test) + 1.0 - 0.2 * i for i in range(len(STEPS))]
    return dict(name=spec.name, model=spec.model, comparison="rope", role=arm, label=spec.label, seed=seed,
                learning_rate=lr, position="rope", parameters=5_768_000,
                costs=dict(attention_macs_table=27.8e6, attention_memory_table=0.3e6),
                perplexity=dict(valid=dict(perplexity=valid), test=dict(perplexity=test)),
                curve=dict(step=STEPS, loss=losses, valid_step=STEPS, valid_loss=losses),
                code=[dict(commit="f" * 40, dirty=[], at="2026-01-01T00:00:00+00:00")], step_seconds_median=2.5,
                routing_summary=None, torch_threads=1, cpu_seconds=2800.0, wall_seconds=3000.0, timing_complete=True)


def sweep(arm: str, valid_by_rung: dict[int, float]) -> dict[str, dict]:
    runs = [fake(arm, first.lr_of(rung), 0, valid, valid * 1.1) for rung, valid in valid_by_rung.items()]
    return {r["name"]: r for r in runs}


def first_grid(a_lr: float = 4e-3, c_lr: float = 4e-3, a_test=(100.0, 101.0, 99.0, 100.5, 100.2)) -> dict:
    """The first grid's records as far as this grid reads them: A's and C's sweeps decide 4e-3; A's seeds 0-4."""
    records = {**sweep("A", {0: 100.0, -1: 103.0, 1: 102.0}), **sweep("C", {0: 100.0, -1: 103.0, 1: 102.0})}
    for seed, test in enumerate(a_test):
        r = fake("A", a_lr, seed, 100.0, test)
        records[r["name"]] = r
    return records


def names(runs) -> list[str]:
    return [r.name for r in runs]


# ================================================================================================ arms and seeds
def test_arms_d_and_e_at_a_shape():
    a, d, e = (first.model_spec(arm, 4e-3, 0) for arm in ("A", "D", "E"))
    assert not a.match and d.match and e.match
    assert (d.fields["num_attention_experts"], d.fields["num_attention_experts_per_tok"]) == (2, 2)
    assert (e.fields["num_attention_experts"], e.fields["num_attention_experts_per_tok"]) == (5, 1)
    for spec in (d, e):
        assert {k: v for k, v in spec.fields.items() if not k.startswith("num_attention_experts")} == \
            {k: v for k, v in a.fields.items() if not k.startswith("num_attention_experts")}


def test_d_and_e_are_parameter_matched_to_a_within_the_first_grids_tolerance():
    scale, vocab = first.SCALE, first.SCALE.vocab_size
    target = grid.replicate.count_parameters(first.model_spec("A", 4e-3, 0).fields, vocab)
    unit = scale.layers * (2 * scale.d + 1)  # one MLP width step, as the first grid's arms
    for arm in ("B", "C", "D", "E"):
        fields = grid.replicate.resolved_fields(first.model_spec(arm, 4e-3, 0), scale, vocab)
        assert abs(grid.replicate.count_parameters(fields, vocab) - target) <= unit, arm
    # D's two experts cost fewer attention parameters than A's five: its MLP is wider
    d = grid.replicate.resolved_fields(first.model_spec("D", 4e-3, 0), scale, vocab)
    assert d["intermediate_size"] > scale.d_ff


def test_fresh_seeds_are_disjoint_from_the_first_grids():
    used = {seed for arm, count in first.SEEDS.items() for seed in range(count)}
    assert used == {0, 1, 2, 3, 4}
    assert set(grid.FRESH_SEEDS) & used == set() and len(grid.FRESH_SEEDS) == 5
    committed = json.loads((RESULTS / f"{first.STEM}.json").read_text())["runs"]
    assert {r["seed"] for r in committed.values()} & set(grid.FRESH_SEEDS) == set()
    assert grid.COMPARISONS[2][:3] == ("A", "C", grid.FRESH_SEEDS)


def test_a_and_c_at_the_lrs_the_first_grid_chose():
    committed = first.committed_records(RESULTS)
    assert grid.first_grid_lrs(committed) == {"A": 4e-3, "C": 4e-3}
    assert grid.first_grid_lrs({}) == {"A": None, "C": None}


# ================================================================================================ order
def test_order_sweeps_interleaved_then_balanced_rounds():
    runs, undecided = grid.plan({}, first_grid())
    assert names(runs)[:6] == ["D-lr0.004-s0", "E-lr0.004-s0", "D-lr0.0028-s0", "E-lr0.0028-s0", "D-lr0.0057-s0",
                               "E-lr0.0057-s0"]
    assert names(runs)[6:] == [f"{arm}-lr0.004-s{s}" for s in range(5, 10) for arm in ("A", "C")]
    assert len(undecided) == 2 and grid.planned_count(runs, undecided) == grid.PLANNED_RUNS == 24
    records = {**sweep("D", {0: 100.0, -1: 103.0, 1: 102.0}), **sweep("E", {0: 104.0, -1: 103.0, 1: 105.0})}
    records.update(sweep("E", {-2: 103.5}))  # E: 2.8e-3, bracketed after one extension
    runs, undecided = grid.plan(records, first_grid())
    assert not undecided and len(runs) == 25 and names(runs)[6] == "E-lr0.002-s0"
    rounds = names(runs)[7:]
    assert rounds[:8] == ["A-lr0.004-s5", "C-lr0.004-s5", "D-lr0.004-s1", "E-lr0.0028-s1",
                          "A-lr0.004-s6", "C-lr0.004-s6", "D-lr0.004-s2", "E-lr0.0028-s2"]
    assert rounds[-2:] == ["A-lr0.004-s9", "C-lr0.004-s9"]
    # balanced: after every round of four, each arm has had the same number of seeds
    for end in range(4, 17, 4):
        counts = {arm: sum(n.startswith(arm) for n in rounds[:end]) for arm in "ACDE"}
        assert len(set(counts.values())) == 1, counts


def test_lr_extension_at_an_edge_holds_back_the_seeds():
    records = sweep("D", {0: 100.0, -1: 99.0, 1: 101.0})  # best at the lower edge
    runs, undecided = grid.plan(records, first_grid())
    assert "D-lr0.002-s0" in names(runs) and not any(n.startswith("D-") and n.endswith("-s1") for n in names(runs))
    assert undecided[0].startswith("D:") and grid.planned_count(runs, undecided) == 25
    assert first.sweep_of("D", records) == ([4e-3, 2.8e-3, 5.7e-3, 2e-3], None)


def test_without_the_first_grids_page_a_and_c_wait():
    runs, undecided = grid.plan({}, {})
    assert names(runs) == names(grid.plan({}, first_grid())[0])[:6] and len(undecided) == 4


# ================================================================================================ verdicts
def full(d_test, e_test, a_fresh, c_fresh) -> dict:
    records = {**sweep("D", {0: 100.0, -1: 103.0, 1: 102.0}), **sweep("E", {0: 100.0, -1: 103.0, 1: 102.0})}
    for arm, tests, seeds in (("D", d_test, grid.NEW_SEEDS), ("E", e_test, grid.NEW_SEEDS),
                              ("A", a_fresh, grid.FRESH_SEEDS), ("C", c_fresh, grid.FRESH_SEEDS)):
        for seed, test in zip(seeds, tests):
            r = fake(arm, 4e-3, seed, 100.0, test)
            records[r["name"]] = r
    return records


def test_verdicts_by_the_first_grids_rule_on_the_stated_seeds():
    a = [100.0, 101.0, 99.0, 100.5, 100.2]
    d = [x * 1.025 for x in a]  # A 2.5% better than D on every seed: choosing helps
    e = [x * math.exp(0.001 * (-1) ** i) for i, x in enumerate(a)]  # within ±0.1%: equivalent
    fresh_a, fresh_c = [100.0, 100.0, 100.0], [99.0, 101.0, 100.0]  # 3 of 5 fresh seeds
    summary = grid.summarise(full(d, e, fresh_a, fresh_c), first_grid(a_test=a))
    ad, ae, ac = summary["comparisons"]
    assert ad["pair"] == "A - D" and ad["seeds"] == [0, 1, 2, 3, 4] and ad["final"] and ad["x_runs"] == "first grid"
    assert ad["deltas"] == pytest.approx([-math.log(1.025)] * 5) and ad["verdict"] == "better"
    assert ad["words"] == "choosing among experts helps beyond two gated projections"
    assert ae["verdict"] == "equivalent" and ae["words"].startswith("the second active projection does not help")
    # A - C: the fresh seeds alone, never the first grid's seeds 0-4 (which first_grid() also holds)
    assert ac["seeds"] == [5, 6, 7] and not ac["final"] and ac["x_runs"] == "this grid"
    assert ac["deltas"] == pytest.approx([math.log(100 / 99), math.log(100 / 101), 0.0])
    assert summary["seeds"]["A first grid"]["0"]["test_perplexity"] == 100.0
    worse = grid.summarise(full([x / 1.03 for x in a], e, [], []), first_grid(a_test=a))["comparisons"][0]
    assert worse["above_zero"] and "A worse" in worse["words"]


def test_results_page_reads_the_verdicts(tmp_path, monkeypatch):
    """The page of a finished grid: each comparison's row with where X's runs come from, and the seeds tables."""
    a = [100.0, 101.0, 99.0, 100.5, 100.2]
    monkeypatch.setattr(grid, "first_grid_records", lambda results_dir: first_grid(a_test=a))
    out = tmp_path / "out"
    for name, record in full([x * 1.025 for x in a], a, a, [x * 1.001 for x in a]).items():
        (out / name).mkdir(parents=True)
        (out / name / first.FINISHED).write_text(json.dumps(record))
    code = dict(commit="c0de" * 10, dirty=[], at="2026-01-01T00:00:00+00:00")
    report = grid.write_results(out, tmp_path, "DATA", code=code, written="2026-01-01T00:00:00+00:00",
                                machine=dict(cpu="test CPU"))
    page = (tmp_path / f"{grid.STEM}.md").read_text()
    assert "**Complete: all 24 runs have finished.**" in page and not report["undecided"]
    assert "| comparison | X's runs | seeds |" in page
    assert "| A - D | first grid | 5 (s0, s1, s2, s3, s4) | " in page
    assert "| A - C | this grid | 5 (s5, s6, s7, s8, s9) | " in page and "(interim" not in page
    assert "choosing among experts helps beyond two gated projections |" in page
    assert "| A first grid | 0.004 | 5 of 5 | 100.14 ± 0.74 |" in page
    assert "took 50 wall-minutes and 47 CPU-minutes on average" in page and "Estimate" not in page


def test_results_page_states_the_plan_before_any_run(tmp_path):
    shutil.copy(RESULTS / f"{first.STEM}.json", tmp_path / f"{first.STEM}.json")
    code = dict(commit="c0de" * 10, dirty=[], at="2026-01-01T00:00:00+00:00")
    report = grid.write_results(tmp_path / "out", tmp_path, "DATA", code=code, written="2026-01-01T00:00:00+00:00",
                                machine=dict(cpu="test CPU"))
    page = (tmp_path / f"{grid.STEM}.md").read_text()
    assert "**Progress: 0 of 24 runs finished** (16 decided so far; next: D-lr0.004-s0" in page
    assert "## Question, arms, seeds and rule, fixed before the first run" in page
    assert "seed indices 5–9" in page and "(A 0.004, C 0.004)" in page and "0.01 nats" in page
    assert "No comparison has runs of both arms yet: no verdict." in page
    assert report["planned_runs"] == 24 and report["runs"] == {}


# ================================================================================================ the driver
@pytest.mark.parametrize("workers", [1, 2])
def test_driver_skips_finished_runs_and_runs_the_plan_in_order(tmp_path, monkeypatch, workers):
    """The shared loop with a fake child (its work done at start, then a real short process to reap): a run
    finished before (its record in a run folder) is never started again; the others start in plan order, each with
    its spec and start written first; with 2 workers two runs are in flight at once, never more, and each run's CPU
    time is its own child's."""
    out = tmp_path / "out"
    done = fake("D", 4e-3, 0, 100.0, 110.0)
    (out / done["name"]).mkdir(parents=True)
    (out / done["name"] / first.FINISHED).write_text(json.dumps(done))
    started: list[str] = []
    in_flight: list[int] = []  # runs started and not yet reaped, seen at each start
    live = {"n": 0}

    def spawn(command):
        name = command[command.index("--run") + 1]
        assert (out / "specs" / f"{name}.json").is_file() and (out / "specs" / f"{name}.starts.json").is_file()
        started.append(name)
        arm, lr, seed = name.split("-")
        (out / name).mkdir()
        valid = 100.0 + abs(math.log(float(lr[2:]) / 4e-3))  # 4e-3 best: no extension
        (out / name / first.FINISHED).write_text(json.dumps(fake(arm, float(lr[2:]), int(seed[1:]), valid, 110.)))
        live["n"] += 1
        in_flight.append(live["n"])
        # a child that burns a little CPU, so that its own usage (not its siblings') is what gets recorded
        return real_spawn([sys.executable, "-c", "sum(range(2_000_000))"])

    real_spawn, real_wait = driver.spawn, driver.wait_any

    def wait_any():
        reaped = real_wait()
        live["n"] -= 1
        return reaped

    monkeypatch.setattr(driver, "spawn", spawn)
    monkeypatch.setattr(driver, "wait_any", wait_any)
    monkeypatch.setattr(driver.subprocess, "call", lambda command: pytest.fail(f"no page with --no-report: {command}"))
    monkeypatch.setattr(driver.replicate_cpu, "git_state", lambda: dict(commit="c" * 40, dirty=[], at="t"))
    args = types.SimpleNamespace(out=out, data="DATA", threads=1, results_dir=tmp_path, only="-s0$", no_report=True,
                                 tiny=False, workers=workers)
    code = driver.run_grid(args, EXPERIMENTS / "routing_vs_projection.py",
                           lambda: grid.finished_records(out), lambda records: grid.plan(records, first_grid()))
    assert code == 0 and live["n"] == 0
    assert started == ["E-lr0.004-s0", "D-lr0.0028-s0", "E-lr0.0028-s0", "D-lr0.0057-s0", "E-lr0.0057-s0"]
    assert max(in_flight) == workers
    for name in started:
        timing = json.loads((out / "specs" / f"{name}.cpu.json").read_text())
        assert timing["attempts"] == 1 and 0 < timing["cpu_seconds"] < 30 and timing["wall_seconds"] > 0
    assert not (out / "attempts.json").exists()


def test_a_finished_run_is_reaped_by_the_driver_even_after_another_process_started():
    """A run that ends while the driver starts another process (the pages' rewrite) is still the driver's to reap:
    subprocess reaps the dropped Popens it tracks whenever it starts a process, which lost such a run."""
    import subprocess
    import time

    pid = driver.spawn([sys.executable, "-c", "pass"])
    time.sleep(1.0)  # the run has ended, unreaped
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    reaped, code, _ = driver.wait_any()
    assert (reaped, code) == (pid, 0)


def test_driver_refuses_zero_workers(tmp_path):
    args = types.SimpleNamespace(out=tmp_path, data="DATA", threads=1, results_dir=tmp_path, only=None,
                                 no_report=True, tiny=False, workers=0)
    with pytest.raises(SystemExit, match="--workers 0"):
        driver.run_grid(args, EXPERIMENTS / "routing_vs_projection.py", dict, lambda records: ([], []))


@pytest.mark.integration
def test_tiny_run_through_driver_and_child(tmp_path):
    """The grid's first run, tiny (the smoke scale, 20 steps), through the shared driver, the run child and the
    pages: D is E=2 k=2 with its MLP widened to A's parameter count."""
    import os
    import subprocess

    from helpers.grids import run_environment, tiny_wikitext2

    tiny_wikitext2(tmp_path)
    env = run_environment()
    run = "D-lr0.002-s0"
    done = subprocess.run([sys.executable, str(EXPERIMENTS / "routing_vs_projection.py"), "--tiny", "--out",
                           str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--results-dir",
                           str(tmp_path / "results"), "--only", f"^{run}$"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "out" / run / first.FINISHED).read_text())
    assert (record["fields"]["num_attention_experts"], record["fields"]["num_attention_experts_per_tok"]) == (2, 2)
    assert record["curve"]["valid_step"] == [10, 20] and record["code"][0]["commit"]
    report = json.loads((tmp_path / "results" / f"{grid.STEM}.json").read_text())
    assert report["finished"] == [run] and "D-lr0.002-s0" in (tmp_path / "results" / f"{grid.STEM}.md").read_text()
    # a second start finds the run finished and starts nothing
    again = subprocess.run([sys.executable, str(EXPERIMENTS / "routing_vs_projection.py"), "--tiny", "--out",
                            str(tmp_path / "out"), "--data", str(tmp_path / "data"), "--results-dir",
                            str(tmp_path / "results"), "--only", f"^{run}$", "--no-report"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "nothing left to run (1 finished" in again.stdout, again.stdout + again.stderr
