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
