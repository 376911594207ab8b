"""experiments/replicate.py: the --smoke grid end to end (train, evaluate, zero-shot, results), resuming, skipping
finished runs, and parameter matching of the dense baselines."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.data import require

pytestmark = pytest.mark.integration  # trains the experiment grids' tiny runs

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "experiments" / "replicate.py"


def _load():
    spec = importlib.util.spec_from_file_location("replicate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["replicate"] = module
    spec.loader.exec_module(module)
    return module


replicate = _load()


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", RAYON_NUM_THREADS="1",
                TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def _smoke(tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp / "runs"), "--data", str(tmp / "data"),
               "--results-dir", str(tmp / "results"), *extra]
    return subprocess.run(command, capture_output=True, text=True, env=_env(), timeout=900)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --smoke grid on slices of WikiText-2 (the first 60 kB of each split)."""
    wikitext2 = require("wikitext-2", "blimp", "lambada") / "wikitext-2"  # the grid's zero-shot reads the other two
    tmp = tmp_path_factory.mktemp("replicate")
    (tmp / "data").mkdir()
    for split in ("train", "valid", "test"):
        with open(wikitext2 / f"wiki.{split}.tokens", encoding="utf-8") as handle:
            (tmp / "data" / f"wiki.{split}.tokens").write_text(handle.read(60_000), encoding="utf-8")
    done = _smoke(tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, done


def test_smoke_grid_records_every_number(smoke):
    tmp, _ = smoke
    report = json.loads((tmp / "results" / "replication.json").read_text())
    assert report["not_finished"] == []
    assert sorted(report["finished"]) == ["rope-dense-total-s0", "rope-switchhead-s0"]
    runs = {run["role"]: run for run in report["runs"]}
    scale = replicate.SCALES["smoke"]
    for run in runs.values():
        assert run["train"]["step"] == scale.max_steps
        assert run["curve"]["step"][-1] == scale.max_steps and len(run["curve"]["loss"]) == scale.max_steps
        for split in ("valid", "test"):
            numbers = run["perplexity"][split]
            assert numbers["protocol"] == scale.perplexity_protocol and numbers["context"] == scale.block_size
            # exp(mean NLL) of the scored tokens
            assert math.isclose(numbers["perplexity"], math.exp(numbers["nll"] / numbers["scored_tokens"]))
            assert 1 < numbers["perplexity"] < 10 * scale.vocab_size
        zero = run["zero_shot"]
        assert zero["blimp_paradigms"] == scale.blimp_paradigms and zero["lambada_passages"] == scale.lambada_passages
        assert 0 <= zero["blimp_acc"] <= 1 and 0 <= zero["lambada_acc"] <= 1
        assert run["train"]["tokens_per_second_median"] > 0 and run["train"]["peak_memory_mb"] > 0
        settings = run["training_settings"]
        assert (settings["batch_size"], settings["block_size"], settings["learning_rate"]) == \
            (scale.batch_size, scale.block_size, scale.learning_rate)
        assert settings["seed"] == 0 and settings["tokenizer"].endswith("tokenizer")  # one shared tokenizer
    switchhead, dense = runs["switchhead"], runs["dense-total"]
    assert switchhead["fields"]["attention_type"] == "switchhead" and dense["fields"]["attention_type"] == "dense"
    assert dense["fields"]["num_attention_heads"] == scale.dense_heads
    # parameter-matched: within one MLP unit (2d + 1 per layer) of SwitchHead's count
    assert abs(dense["parameters"] - switchhead["parameters"]) <= scale.layers * (2 * scale.d + 1)
    # the costs are the accounting of switchhead flops at the training context
    assert switchhead["costs"]["context"] == scale.block_size
    assert switchhead["costs"]["attention_macs_table"] < dense["costs"]["attention_macs_table"]


def test_smoke_results_files(smoke):
    tmp, _ = smoke
    markdown = (tmp / "results" / "replication.md").read_text()
    assert "SwitchHead H=2 E=4 k=2 dh=8, RoPE" in markdown and "dense H=8 dh=4 (same total heads), RoPE" in markdown
    assert "Not finished: none" in markdown and replicate.READING_MARKER in markdown
    image = tmp / "results" / "replication_rope.png"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
def test_rerun_skips_finished_runs_and_keeps_the_reading(smoke):
    tmp, _ = smoke
    record = tmp / "runs" / "rope-switchhead-s0" / replicate.RUN_RECORD
    before = record.stat().st_mtime_ns
    markdown = tmp / "results" / "replication.md"
    markdown.write_text(markdown.read_text() + "\nmy reading\n")
    done = _smoke(tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("finished earlier, skipped") == 2
    assert record.stat().st_mtime_ns == before
    assert markdown.read_text().endswith("\nmy reading\n")


@pytest.mark.integration
def test_interrupted_run_resumes_from_its_checkpoint(smoke):
    """A run whose record and results are gone but whose checkpoint is there continues it (resume) instead of
    training again; a run killed before its first checkpoint starts afresh."""
    tmp, _ = smoke
    run = tmp / "runs" / "rope-dense-total-s0"
    for name in (replicate.RUN_RECORD, "train_result.json", "perplexity.json", "zero_shot.json"):
        (run / name).unlink()
    fresh = tmp / "runs" / "rope-switchhead-s0"
    for name in list(os.listdir(fresh)):
        path = fresh / name
        if path.is_dir():
            import shutil
            shutil.rmtree(path)
        elif name != "log.csv":
            path.unlink()  # only a stale log left: no checkpoint, no tokenizer
    done = _smoke(tmp, "--no-zero-shot")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    resumed = json.loads((run / "train_result.json").read_text())
    assert resumed["resumed"] is True and resumed["step"] == replicate.SCALES["smoke"].max_steps
    again = json.loads((fresh / "train_result.json").read_text())
    assert again["resumed"] is False and again["step"] == replicate.SCALES["smoke"].max_steps
    assert json.loads((run / replicate.RUN_RECORD).read_text())["zero_shot"] is None


def test_parameter_matching_of_the_small_grid():
    """Every dense baseline and ablation of the `small` grid (benchmarks/results/replication.md) has SwitchHead's
    parameter count to within one MLP unit; SwitchHead's attention MACs are under 55% of the same-total-heads baseline's."""
    from switchhead import SwitchHeadConfig
    from switchhead.evaluation import attention_macs

    scale = replicate.SCALES["small"]
    vocab = 8000
    for spec in [s for s in replicate.plan(scale) if s.seed == 0]:  # the other seeds have the same fields
        target = replicate.count_parameters(replicate.switchhead_fields(scale, spec.fields["position_encoding"]),
                                            vocab)
        count = replicate.count_parameters(replicate.resolved_fields(spec, scale, vocab), vocab)
        if spec.match:
            assert abs(count - target) <= scale.layers * (2 * scale.d + 1), spec.name
    for position in ("rope", "xl"):
        switchhead = SwitchHeadConfig(vocab_size=vocab, **replicate.switchhead_fields(scale, position))
        dense = SwitchHeadConfig(vocab_size=vocab, **replicate.dense_fields(scale, position, scale.dense_heads,
                                                                           scale.dense_head_dim))
        assert attention_macs(switchhead, scale.block_size) < 0.55 * attention_macs(dense, scale.block_size)


def test_match_parameters_solves_for_the_mlp_width():
    fields = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8, attention_type="dense",
                  intermediate_size=64, max_position_embeddings=64)
    target = replicate.count_parameters({**fields, "intermediate_size": 100}, 500) + 7
    matched, count = replicate.match_parameters(fields, target, 500)
    assert matched["intermediate_size"] == 100 and count == target - 7


def test_routing_statistics_of_a_trained_switchhead(smoke):
    tmp, _ = smoke
    scale = replicate.SCALES["smoke"]
    stats = replicate.routing_statistics(tmp / "runs" / "rope-switchhead-s0", str(tmp / "data"), tokens=512,
                                         block_size=scale.block_size)
    names = sorted(stats)
    assert names == ["model.layers.0.self_attn.output_selection", "model.layers.0.self_attn.value_selection"]
    for router in stats.values():
        assert len(router["share"]) == scale.heads and all(len(row) == scale.experts for row in router["share"])
        for row, entropy in zip(router["share"], router["normalised_entropy"]):
            assert math.isclose(sum(row), 1.0, abs_tol=1e-3) and 0.0 <= entropy <= 1.0 + 1e-6
            # k of E experts are picked per token: no expert can hold more than 1/k of the picks
            assert max(row) <= 1 / scale.k + 1e-6
        assert 0.0 < router["mean_gate"] < 1.0


def test_interleaved_throughput_measures_every_model_of_the_grid():
    scale = replicate.SCALES["smoke"]
    numbers = replicate.interleaved_throughput(scale, 1000, repetitions=2, steps=1)
    assert sorted(numbers) == ["rope-dense-total", "rope-switchhead"]
    for entry in numbers.values():
        assert len(entry["step_seconds"]) == 2 and entry["step_seconds_median"] > 0
        assert math.isclose(entry["tokens_per_second"],
                            scale.batch_size * scale.block_size / entry["step_seconds_median"])


def test_small_grid_has_the_one_sided_ablations_and_the_sweep():
    scale = replicate.SCALES["small"]
    specs = {spec.name: spec for spec in replicate.plan(scale)}
    for tag, sides in (("Vonly", "value"), ("Oonly", "output")):
        spec = specs[f"rope-ablation-{tag}-s0"]
        assert spec.fields["attention_expert_projections"] == sides and spec.match and spec.seed == 0
        assert spec.fields["attention_type"] == "switchhead" and spec.training == {}
    # the earlier runs' fields are unchanged (no new key), so their finished records still match the plan
    assert "attention_expert_projections" not in specs["rope-switchhead-s0"].fields
    sweep = [spec for spec in specs.values() if spec.role == "sweep"]
    assert len([s for s in sweep if s.seed == 0]) == len(scale.sweeps) * len(scale.sweep_models) + 2 == 17
    for tag in ("Vonly", "Oonly"):  # the one-sided ablations at lr 8e-3: their grid fields, the sweep's lr
        spec = specs[f"rope-sweep-lr8e-3-{tag}-s0"]
        assert spec.fields == specs[f"rope-ablation-{tag}-s0"].fields and spec.training == {"learning_rate": 8e-3}
    # seeds 1 and 2 only for the seeded sweep settings, after every seed-0 run
    assert sorted(s.name for s in sweep if s.seed) == sorted(f"rope-sweep-lr8e-3-{role}-s{seed}" for seed in (1, 2)
                                                             for role in scale.sweep_models)
    names = list(specs)
    # (the one-sided ablations at lr 8e-3 come last of all)
    assert max(names.index(s.name) for s in sweep if s.seed == 0 and not s.model.endswith("only")) < \
        min(names.index(s.name) for s in sweep if s.seed) < names.index("rope-sweep-lr8e-3-Vonly-s0")
    for spec in sweep:
        assert spec.fields["position_encoding"] == "rope" and spec.training
        if spec.model.endswith("only"):
            continue
        base = {"switchhead": "rope-switchhead-s0", "dense-total": "rope-dense-total-s0",
                "gate": "rope-ablation-gate-s0"}[next(r for r in scale.sweep_models if spec.model.endswith("-" + r))]
        assert spec.fields == specs[base].fields and spec.match == specs[base].match
    assert specs["rope-sweep-lr4e-3-gate-s0"].training == {"learning_rate": 4e-3}
    assert specs["rope-sweep-tokens2x-switchhead-s0"].training == {"max_steps": 320, "warmup_steps": 32}
    # the interleaved throughput does not measure the sweep's copies of the same architectures again
    assert all(spec.role != "sweep" for spec in replicate.plan(replicate.SCALES["smoke"]))


def test_sweep_rows_line_up_the_grid_run_and_the_sweep_runs():
    scale = replicate.SCALES["small"]

    def record(model, seed, ppl):
        return dict(model=model, seed=seed, label=model, perplexity={"test": {"perplexity": ppl}})

    records = [record("rope-switchhead", 0, 200.0), record("rope-switchhead", 1, 1.0),
               record("rope-sweep-lr1e-3-switchhead", 0, 210.0), record("rope-sweep-tokens2x-switchhead", 0, 150.0),
               record("rope-dense-total", 0, 205.0)]
    rows = {row["role"]: row for row in replicate.sweep_rows(records, scale)}
    assert sorted(rows) == ["dense-total", "switchhead"]  # no gate runs at all: no row
    assert rows["switchhead"]["test_ppl"] == {"lr 0.002 (grid)": 200.0, "lr 0.001": 210.0, "lr 0.004": None, "lr 0.008": None, "lr 0.016": None,
                                              "2x tokens": 150.0}
    assert rows["dense-total"]["test_ppl"]["lr 0.002 (grid)"] == 205.0
