"""experiments/experts_vs_gate.py: the grid's order, the learning-rate choice with its edge extension, the paired
statistic and its verdicts on hand-computed cases, and the results pages rendered from fake records (no training);
one tiny real run through the driver and its child (integration)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.grids import load_experiment, run_environment, tiny_wikitext2

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "experiments" / "experts_vs_gate.py"


grid = load_experiment("experts_vs_gate")
STEPS = [240, 480, 720, 960, 1200]
CODE = dict(commit="c0de" * 10, dirty=[], at="2026-01-01T00:00:00+00:00")  # the pages' stamp (git is a process)


def fake(arm: str, lr: float, seed: int, valid: float, test: float, valid_losses=None) -> dict:
    spec = grid.model_spec(arm, lr, seed)
    losses = valid_losses or [math.log(test) + 1.0 - 0.2 * i for i in range(len(STEPS))]
    return dict(name=spec.name, model=spec.model, comparison="rope", role=arm, label=spec.label, seed=seed,
                learning_rate=lr, position="rope", parameters=5_768_000,
                costs=dict(attention_macs_table={"A": 27.8e6, "B": 21.1e6, "C": 62.9e6}[arm],
                           attention_memory_table=0.3e6),
                perplexity=dict(valid=dict(perplexity=valid), test=dict(perplexity=test)),
                curve=dict(step=STEPS, loss=losses, valid_step=STEPS, valid_loss=losses),
                code=[dict(commit="f" * 40, dirty=[], at="2026-01-01T00:00:00+00:00")], step_seconds_median=2.5,
                routing_summary=None, torch_threads=1, cpu_seconds=2800.0, wall_seconds=3000.0, timing_complete=True)


def sweep_records(arm: str, valid_by_rung: dict[int, float]) -> dict[str, dict]:
    records = {}
    for rung, valid in valid_by_rung.items():
        r = fake(arm, grid.lr_of(rung), 0, valid, valid * 1.1)
        records[r["name"]] = r
    return records


# ================================================================================================ learning rates
def test_ladder_is_the_planned_grid():
    assert [grid.lr_of(r) for r in (-3, -2, -1, 0, 1, 2, 3)] == [1.4e-3, 2e-3, 2.8e-3, 4e-3, 5.7e-3, 8e-3, 1.1e-2]
    assert [grid.lr_of(r) for r in grid.SWEEP_RUNGS] == [4e-3, 2.8e-3, 5.7e-3]


def test_sweep_undecided_until_every_lr_finished():
    lrs, best = grid.sweep_of("A", sweep_records("A", {0: 100.0, -1: 105.0}))
    assert best is None and lrs == [4e-3, 2.8e-3, 5.7e-3]


def test_sweep_bracketed_best_chosen_on_validation_only():
    records = sweep_records("A", {0: 100.0, -1: 105.0, 1: 101.0})
    # test perplexity that would choose otherwise is never read
    records[grid.model_spec("A", 5.7e-3, 0).name]["perplexity"]["test"]["perplexity"] = 1.0
    assert grid.sweep_of("A", records) == ([4e-3, 2.8e-3, 5.7e-3], 4e-3)


def test_sweep_extends_at_the_upper_edge_then_decides():
    records = sweep_records("B", {0: 100.0, -1: 105.0, 1: 98.0})
    assert grid.sweep_of("B", records) == ([4e-3, 2.8e-3, 5.7e-3, 8e-3], None)
    records.update(sweep_records("B", {2: 99.0}))  # 8e-3 worse: 5.7e-3 is bracketed
    assert grid.sweep_of("B", records) == ([4e-3, 2.8e-3, 5.7e-3, 8e-3], 5.7e-3)


def test_sweep_extends_at_the_lower_edge_at_most_twice():
    records = sweep_records("C", {0: 100.0, -1: 99.0, 1: 101.0, -2: 98.0, -3: 97.0})
    lrs, best = grid.sweep_of("C", records)
    assert lrs == [4e-3, 2.8e-3, 5.7e-3, 2e-3, 1.4e-3] and best == 1.4e-3  # still at the edge: extensions used up


# ================================================================================================ order
def names(runs) -> list[str]:
    return [r.name for r in runs]


def test_order_sweeps_of_a_and_b_first_then_alternating_seeds_then_c():
    runs, undecided = grid.plan({})
    assert names(runs) == ["A-lr0.004-s0", "B-lr0.004-s0", "A-lr0.0028-s0", "B-lr0.0028-s0", "A-lr0.0057-s0",
                           "B-lr0.0057-s0", "C-lr0.004-s0", "C-lr0.0028-s0", "C-lr0.0057-s0"]
    assert len(undecided) == 3
    records = {**sweep_records("A", {0: 100.0, -1: 103.0, 1: 102.0}),
               **sweep_records("B", {0: 101.0, -1: 99.0, 1: 104.0})}  # B's best at the lower edge
    runs, _ = grid.plan(records)
    assert names(runs)[6:9] == ["B-lr0.002-s0", "A-lr0.004-s1", "A-lr0.004-s2"]  # A's seeds wait for no one
    records.update(sweep_records("B", {-2: 100.0}))  # 2.8e-3 bracketed
    runs, undecided = grid.plan(records)
    assert names(runs)[7:] == ["A-lr0.004-s1", "B-lr0.0028-s1", "A-lr0.004-s2", "B-lr0.0028-s2", "A-lr0.004-s3",
                               "B-lr0.0028-s3", "A-lr0.004-s4", "B-lr0.0028-s4",
                               "C-lr0.004-s0", "C-lr0.0028-s0", "C-lr0.0057-s0"]
    assert undecided == ["C: best lr (its sweep is not finished), so its seeds"]
    records.update(sweep_records("C", {0: 100.0, -1: 101.0, 1: 102.0}))
    runs, undecided = grid.plan(records)
    assert names(runs)[-2:] == ["C-lr0.004-s1", "C-lr0.004-s2"] and not undecided
    assert len(runs) == 7 + 8 + 3 + 2


def test_arms_are_parameter_matched_except_a():
    a, b, c = (grid.model_spec(arm, 4e-3, 0) for arm in ("A", "B", "C"))
    assert not a.match and b.match and c.match
    assert (a.fields["num_attention_experts"], a.fields["num_attention_experts_per_tok"]) == (5, 2)
    assert (b.fields["num_attention_experts"], b.fields["num_attention_experts_per_tok"]) == (1, 1)
    assert b.fields["num_attention_heads"] == a.fields["num_attention_heads"] == 2
    assert b.fields["head_dim"] == a.fields["head_dim"] == 32
    assert c.fields["attention_type"] == "dense" and c.fields["attention_output_gate"]
    assert c.fields["num_attention_heads"] == 8


# ================================================================================================ statistic
@pytest.mark.parametrize("q, df, expected", [
    (0.975, 1, 12.706204736), (0.975, 2, 4.302652730), (0.975, 3, 3.182446305), (0.975, 4, 2.776445105),
    (0.95, 2, 2.919985580), (0.95, 4, 2.131846786), (0.975, 29, 2.045229642), (0.95, 30, 1.697260887)])
def test_t_quantiles_match_the_tables(q, df, expected):
    assert grid.t_quantile(q, df) == pytest.approx(expected, abs=1e-8)


def test_t_coverage_closed_forms():
    assert grid.t_coverage(1.0, 1) == pytest.approx(0.5)  # Cauchy
    assert grid.t_coverage(1.0, 2) == pytest.approx(1 / math.sqrt(3))  # t / sqrt(2 + t^2)
    assert grid.t_coverage(0.0, 5) == 0.0
    with pytest.raises(ValueError):
        grid.t_coverage(1.0, 0)


def test_statistic_experts_help():
    s = grid.paired_statistic([-0.02, -0.03, -0.025, -0.015, -0.02])
    half = 2.776445105 * math.sqrt(32.5e-6) / math.sqrt(5)  # sd^2 = 130e-6 / 4
    assert s["mean"] == pytest.approx(-0.022) and s["sd"] == pytest.approx(math.sqrt(32.5e-6))
    assert s["ci95"] == pytest.approx([-0.022 - half, -0.022 + half])
    assert s["verdict"] == "better" and not s["above_zero"]
    assert grid.verdict_words(("A", "B"), s) == "the experts help"


def test_statistic_equivalence():
    s = grid.paired_statistic([0.001, -0.002, 0.0, 0.002, -0.001])
    half90 = 2.131846786 * math.sqrt(2.5e-6) / math.sqrt(5)
    assert s["ci90"] == pytest.approx([-half90, half90]) and s["verdict"] == "equivalent"


def test_statistic_significant_but_smaller_than_the_effect_of_interest_is_equivalence_not_help():
    s = grid.paired_statistic([-0.005, -0.006, -0.004, -0.005, -0.005])
    assert s["ci95"][1] < 0 and s["verdict"] == "equivalent"


def test_statistic_inconclusive_and_worse_named():
    assert grid.paired_statistic([-0.02, 0.01, -0.03])["verdict"] == "inconclusive"
    # a mean beyond -0.01 whose interval crosses 0 is not "help"
    assert grid.paired_statistic([-0.05, 0.01, -0.02, -0.01, 0.0])["verdict"] == "inconclusive"
    worse = grid.paired_statistic([0.03, 0.02, 0.025])
    assert worse["verdict"] == "inconclusive" and worse["above_zero"]
    assert "worse" in grid.verdict_words(("A", "C"), worse)
    assert grid.paired_statistic([-0.02])["ci95"] is None


# ================================================================================================ report
def full_records(a_test: list[float], b_test: list[float], c_test: list[float]) -> dict[str, dict]:
    records = {**sweep_records("A", {0: 100.0, -1: 103.0, 1: 102.0}),
               **sweep_records("B", {0: 100.0, -1: 103.0, 1: 102.0}),
               **sweep_records("C", {0: 100.0, -1: 103.0, 1: 102.0})}
    for arm, tests in (("A", a_test), ("B", b_test), ("C", c_test)):
        for seed, test in enumerate(tests):
            r = fake(arm, 4e-3, seed, 100.0, test)
            records[r["name"]] = r
    return records


def test_summary_pairs_by_seed_on_test_nll():
    a, b, c = [100.0, 101.0, 99.0, 100.5, 100.2], [102.0, 103.5, 101.0, 102.0, 102.5], [101.0, 100.0]
    summary = grid.summarise(full_records(a, b, c))
    ab, ac = summary["comparisons"]
    assert ab["pair"] == "A - B" and ab["seeds"] == [0, 1, 2, 3, 4] and ab["final"]
    assert ab["deltas"] == pytest.approx([math.log(x / y) for x, y in zip(a, b)])
    assert ab["verdict"] == "better"
    assert ac["pair"] == "A - C" and ac["seeds"] == [0, 1] and not ac["final"]
    assert ac["deltas"] == pytest.approx([math.log(100 / 101), math.log(101 / 100)])
    # the validation curve: the same paired differences at each evaluated step
    assert [p["step"] for p in ab["valid_curve"]] == STEPS
    assert ab["valid_curve"][-1]["mean"] == pytest.approx(sum(ab["deltas"]) / 5)


@pytest.fixture
def no_process(monkeypatch):
    """The machine description without `uname` (platform.processor starts it): the fast tier starts no process."""
    monkeypatch.setattr(grid.replicate, "machine", lambda: dict(host="h", cpu="test CPU", cores=2))


@pytest.mark.integration
def test_results_pages_from_fake_run_folders(tmp_path, no_process):
    records = full_records([100.0, 101.0, 99.0], [100.1, 100.9, 99.05], [])
    out, results = tmp_path / "out", tmp_path / "results"
    for name, record in records.items():
        (out / name).mkdir(parents=True)
        (out / name / grid.FINISHED).write_text(json.dumps(record))
    first = next(iter(records))
    record = json.loads((out / first / grid.FINISHED).read_text())
    record["training_settings"] = dict(output_dir=str(out / first), data=str(tmp_path / "wt2"))
    (out / first / grid.FINISHED).write_text(json.dumps(record))
    report = grid.write_results(out, results, str(tmp_path / "wt2"), code=CODE)
    page = (results / f"{grid.STEM}.md").read_text()
    runs, _ = grid.plan(records)
    # no folder of the machine that ran the grid in the committed pages
    assert str(tmp_path) not in (results / f"{grid.STEM}.json").read_text()
    # run folders read as every grid reads them (replicate.portable_paths): the run folder as RUNS/..., a folder
    # outside the checkout by its last component
    assert report["runs"][first]["training_settings"] == dict(output_dir=f"RUNS/{first}", data="wt2")
    assert f"**Progress: {len(records)} of the {len(runs)} runs decided so far have finished**" in page
    assert "## The statistic, fixed before the runs" in page and "0.01 nats" in page
    assert "| A - B | 3 (s0, s1, s2) |" in page and "(interim: not every seed has finished)" in page
    assert "learned per-head constant scale" in page  # arm D: left out, and why
    assert "| A | SwitchHead H=2 dh=32, E=5 k=2" in page and "27.8M" in page
    assert "at commit c0dec0dec0de," in page
    assert report["machine"] == dict(cpu="test CPU", cores=2)  # no host name
    ab, ac = report["summary"]["comparisons"]
    assert ab["n"] == 3 and ac["n"] == 1 and ac["ci95"] is None  # C: only its sweep's seed 0
    assert "/tmp" not in page and str(tmp_path) not in page
    # the hand-written reading below the marker survives a rewrite
    (results / f"{grid.STEM}.md").write_text(page + "\nmy reading\n")
    grid.write_results(out, results, code=CODE)
    assert (results / f"{grid.STEM}.md").read_text().endswith("\nmy reading\n")

    docs = tmp_path / "results_page.md"
    docs.write_text(f"# Results\n\nintro\n\n{grid.DOCS_BEGIN}\nold\n{grid.DOCS_END}\n\nafter\n")
    grid.update_docs(report, docs)
    text = docs.read_text()
    assert text.startswith("# Results\n\nintro\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    assert f"{len(records)} of the {len(runs)} runs decided so far have finished" in text
    assert "* A (SwitchHead H=2 dh=32, E=5 k=2, sigmoid expert gates on value and output), lr 0.004: test " \
        "perplexity 100.00 ± 1.00 over 3 of 5 seeds." in text
    assert "Measured: the 19 run(s)" not in page and "took 50 wall-minutes and 47 CPU-minutes on average" in page
    assert "* A - B (test NLL, 3 seeds)" in text and "(interim)" in text and "* A - C: no verdict yet" in text
    docs.write_text("# Results\n")
    with pytest.raises(SystemExit):
        grid.update_docs(report, docs)


@pytest.mark.integration
def test_complete_grid_reads_final(tmp_path, no_process):
    records = full_records([100.0, 101.0, 99.0, 100.5, 100.2], [102.0, 103.5, 101.0, 102.0, 102.5],
                           [100.0, 101.0, 99.5])
    out = tmp_path / "out"
    for name, record in records.items():
        (out / name).mkdir(parents=True)
        (out / name / grid.FINISHED).write_text(json.dumps(record))
    report = grid.write_results(out, tmp_path / "results", code=CODE)
    page = (tmp_path / "results" / f"{grid.STEM}.md").read_text()
    assert not report["undecided"] and set(report["planned"]) <= set(report["runs"])
    assert f"**Complete: all {len(report['planned'])} runs have finished.**" in page
    assert "Progress:" not in page and "Estimate, not a measurement" not in page and "(interim" not in page
    docs = tmp_path / "results_page.md"
    docs.write_text(f"# Results\n\n{grid.DOCS_BEGIN}\n{grid.DOCS_END}\n")
    grid.update_docs(report, docs)
    text = docs.read_text()
    assert "in progress" not in text and "(interim)" not in text and "* A - B (test NLL, 5 seeds)" in text


@pytest.mark.integration
def test_no_runs_renders_progress_and_no_verdict(tmp_path, no_process):
    report = grid.write_results(tmp_path / "out", tmp_path / "results", code=CODE)
    page = (tmp_path / "results" / f"{grid.STEM}.md").read_text()
    assert "**Progress: 0 of the 9 runs decided so far have finished**" in page
    assert "no verdict" in page and report["summary"]["comparisons"] == []


# ================================================================================================ one real run
@pytest.mark.integration
def test_tiny_run_through_driver_and_child(tmp_path):
    """The grid's first run, tiny (the smoke scale: E=4, 20 steps), through the driver, its child and the report."""
    tiny_wikitext2(tmp_path)
    env = run_environment()
    first = "A-lr0.002-s0"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(tmp_path / "out"), "--data",
                           str(tmp_path / "data"), "--results-dir", str(tmp_path / "results"), "--only", f"^{first}$",
                           "--pgid-file", str(tmp_path / "out" / "grid.pgid")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "out" / first / grid.FINISHED).read_text())
    assert record["fields"]["num_attention_experts"] == 4 and record["curve"]["valid_step"] == [10, 20]
    assert (tmp_path / "out" / "grid.pgid").read_text().strip() == str(int(
        (tmp_path / "out" / "grid.pgid").read_text()))
    report = json.loads((tmp_path / "results" / f"{grid.STEM}.json").read_text())
    assert report["finished"] == [first]
