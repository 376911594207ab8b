"""The benchmark scripts run end to end in their quick modes and write their JSON and Markdown."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers.decoding import variant_model


def test_model_benchmark_quick_mode_writes_json_and_markdown(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_model

    out = tmp_path / "model.json"
    assert bench_model.main(["--quick", "--no-reference", "--no-memory", "--decode-steps", "2", "--out",
                             str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert report["machine"]["threads"] >= 1 and report["machine"]["torch"] == torch.__version__
    assert set(report["ratios"]) == {"rope", "xl"}
    rope = report["ratios"]["rope"]
    for key in ("train_time@32", "train_time@64", "prefill_time", "decode_tok_s_eager@b1", "decode_tok_s_eager@b8",
                "kv_cache_bytes"):
        assert rope[key] > 0
    assert 0 < rope["kv_cache_bytes"] < 1  # SwitchHead's cache is smaller than the dense baseline's
    assert rope["train_peak_memory@32"] is None  # --no-memory; the child's measurement itself, in-process:
    peak = bench_model._peak_memory("dense-rope", 1, 16, True, "sdpa")
    assert peak["peak_rise_bytes"] > 0 and peak["parameters"] == report["parameters"]["dense-rope"]
    assert "Ratios" in out.with_suffix(".md").read_text()


def test_compiled_train_benchmark_quick_run_and_its_relu_swap(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_compiled_train

    out = tmp_path / "compiled_train.json"
    assert bench_compiled_train.main(["--quick", "--models", "dense-rope", "--variants", "compiled,compiled_aten_relu",
                                      "--context", "16", "--reps", "1", "--out", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert set(report["ratios"]["dense-rope"]) == {"compiled", "compiled_aten_relu"}
    assert all(ratio > 0 for ratio in report["ratios"]["dense-rope"].values())
    assert "F.relu (defaults): compiled / eager" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit) as error:
        bench_compiled_train.main(["--variants", "compiled,fastest"])
    assert error.value.code == 2


def test_saved_memory_benchmark_attributes_the_saved_tensors(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import saved_memory

    model = variant_model("dense-rope").train()
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    want = model(input_ids=ids, labels=ids, use_cache=False).loss
    parts = saved_memory.saved_bytes(model, 2, 12)
    torch.testing.assert_close(model(input_ids=ids, labels=ids, use_cache=False).loss, want)  # hooks removed
    assert all(parts[part] > 0 for part in saved_memory.PARTS)
    # the MLP's share: per layer and token what its two projections keep, the ReLU output (intermediate_size) and
    # the up projection's input (the LayerNorm output, hidden_size), fp32
    per_row = model.config.num_hidden_layers * 2 * 12 * 4  # layers x tokens x fp32 bytes
    assert per_row * model.config.intermediate_size <= parts["mlp"]
    assert parts["mlp"] <= per_row * (model.config.intermediate_size + model.config.hidden_size)
    out = tmp_path / "saved.json"
    assert saved_memory.main(["--quick", "--context", "16", "--out", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    for family in ("rope", "xl"):
        assert report["ratios"][family]["attention"] < 1  # SwitchHead's attention keeps less than dense's
    assert "| switchhead-xl |" in out.with_suffix(".md").read_text()


def test_compare_runs_reads_both_scripts_results_and_compares_medians(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import json

    import compare_runs

    def model_run(train, kv):  # bench_model.py's shape; None (not measured) and the paired rows are left out
        return {"machine": {"cpu": "test cpu"}, "ratios": {"rope": {"train_time@32": train, "kv_cache_bytes": kv,
                                                                    "train_peak_memory@64": None,
                                                                    "decode_tok_s_eager@b1 paired": 9.0}}}

    def experts_run(cvmm, grouped):  # bench_experts.py's shape
        return {"device": "test cpu", "results": [{"tokens": 8, "mode": "forward",
                                                   "ms": {"cvmm": cvmm, "grouped_mm": grouped}}]}

    paths = {}
    for name, run in {"b1": model_run(1.0, 0.3), "b2": model_run(1.2, 0.3), "a1": model_run(1.1, 0.3),
                      "a2": model_run(1.3, 0.3), "e1": experts_run(2.0, 1.0), "e2": experts_run(4.0, 1.0)}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(run))
    out = tmp_path / "cmp.md"
    assert compare_runs.main(["--before", str(paths["b1"]), str(paths["b2"]), "--after", str(paths["a1"]),
                              str(paths["a2"]), "--out", str(out)]) == 0
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in
            out.read_text().splitlines() if line.startswith("| rope")}
    assert set(rows) == {"rope train_time@32", "rope kv_cache_bytes"}
    # every run, the before runs' spread (0.2 / median 1.1), and the medians' ratio (1.2 / 1.1)
    assert rows["rope train_time@32"] == ["1.000", "1.200", "1.100", "1.300", "18.2%", "1.091"]
    assert rows["rope kv_cache_bytes"][-2:] == ["0.0%", "1.000"]
    assert "Machine: test cpu" in out.read_text()
    # a partial run (bench_model --decode-only) leaves its rows out: "-", and the medians of the runs that have them
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"ratios": {"rope": {"kv_cache_bytes": 0.6}}}))
    assert compare_runs.main(["--before", str(paths["b1"]), "--after", str(paths["a1"]), str(partial), "--out",
                              str(out)]) == 0
    rows = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[1:] for line in
            out.read_text().splitlines() if line.startswith("| rope")}
    assert rows["rope train_time@32"] == ["1.000", "1.100", "-", "-", "1.100"]
    assert rows["rope kv_cache_bytes"] == ["0.300", "0.300", "0.600", "-", "1.500"]

    assert compare_runs.ratios_of(json.loads(paths["e2"].read_text())) == {"8 tokens forward: grouped_mm x cvmm": 0.25}
    with pytest.raises(ValueError, match="not a bench_model.py or bench_experts.py result"):
        compare_runs.ratios_of({"something": 1})
