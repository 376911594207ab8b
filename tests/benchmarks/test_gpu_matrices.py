"""The GPU matrices' parts that run anywhere: the cost model against PyTorch's FLOP counter, the captured decoding
step against `generate`, and each benchmark's CPU smoke."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_attention_block  # noqa: E402
import bench_decode_floor  # noqa: E402
import bench_generate_host  # noqa: E402
import bench_long_context  # noqa: E402
import roofline  # noqa: E402


def _config(preset, **overrides):
    config = SwitchHeadConfig.from_preset(preset, **overrides)
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("preset, experts", [("tiny-dense", None), ("tiny-switchhead", "switchhead_batched"),
                                             ("tiny-switchall", "switchhead_batched")])
def test_cost_model_counts_what_a_forward_multiplies(preset, experts):
    """Every product but the attention core (PyTorch's counter skips sdpa at one query), at one token per row: the
    batched formulation multiplies only the selected experts, so its count is SwitchHead's useful work."""
    config = _config(preset, position_encoding="rope", xl_memory_length=0)
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).eval()
    if experts:
        model.set_experts_implementation(experts)
    ids = torch.randint(1, config.vocab_size, (5, 1))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    core = config.num_hidden_layers * roofline.layer_cost(config, 1).core * 5
    assert counter.get_total_flops() == roofline.forward_flops(config, 5, 1) - core
    assert roofline.training_flops(config, 5, 1) == 3 * roofline.forward_flops(config, 5, 1)


def test_cost_model_attention_core_is_causal_and_grows_with_context():
    config = _config("tiny-dense", position_encoding="rope", xl_memory_length=0)
    heads, dh = config.num_attention_heads, config.head_dim
    assert roofline.layer_cost(config, 7).core == 2 * 2 * heads * dh * 4  # (7 + 1) / 2 keys on average
    xl = _config("tiny-dense-xl")
    assert roofline.layer_cost(xl, 7).core == 3 * 2 * heads * dh * 4  # and the relative-position scores
    # the matrix's predicted ratios: SwitchHead's share of the FLOPs falls as the attention core grows
    rows = {(r["pair"], r["context"]): r["ratio"] for r in roofline.predicted()["train"]}
    assert rows[("47m-rope", 512)] > rows[("47m-rope", 4096)] > rows[("47m-rope", 16384)]


def test_decode_bytes_are_the_weights_and_the_cache():
    config = _config("tiny-switchhead")
    parameters, embedding = roofline.parameter_counts(config)
    model = SwitchHeadForCausalLM(config)
    assert parameters == sum(p.numel() for p in model.parameters())
    assert embedding == model.get_input_embeddings().weight.numel()
    cache = 2 * config.num_hidden_layers * 3 * config.num_attention_heads * 40 * config.head_dim * 2
    assert roofline.decode_bytes(config, parameters, embedding, 3, 40) == (parameters - embedding) * 2 + cache


def test_decode_step_continues_a_prompt_as_greedy_generate_does():
    """The step the benchmark captures (static cache, explicit positions, argmax into its own buffer) produces the
    tokens of `generate` with a static cache, token for token, on a tiny model."""
    config = _config("tiny-switchhead", hidden_dropout=0.0)
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).eval()
    prompt = torch.randint(1, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = model.generate(prompt, max_new_tokens=5, do_sample=False, cache_implementation="static",
                              pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(prompt))[:, 9:]
    decode = bench_decode_floor.DecodeStep(model, 2, 8, torch.device("cpu"), fill=False)
    decode.prefill(prompt)
    with torch.no_grad():
        assert torch.equal(decode.tokens(decode.step, 5), expected)
        assert torch.equal(decode.tokens(decode.step, 5), expected)  # reset() rewinds to the prompt's end


def test_decode_step_reads_the_filled_cache():
    """With the cache filled at random, the step's tokens depend on what was filled (it attends to it), and reset()
    makes the step repeatable."""
    config = _config("tiny-dense", position_encoding="rope", xl_memory_length=0, hidden_dropout=0.0)
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).eval()
    with torch.no_grad():
        decode = bench_decode_floor.DecodeStep(model, 4, 12, torch.device("cpu"))
        first = decode.tokens(decode.step, 3)
        assert torch.equal(decode.tokens(decode.step, 3), first)
        logits = model(input_ids=decode.first, position_ids=torch.full((4, 1), 12), cache=decode.cache).logits
        decode.reset()
        for layer in decode.cache.layers:
            layer.values[:, :, :12].mul_(-3.0)
        decode.reset()
        changed = model(input_ids=decode.first, position_ids=torch.full((4, 1), 12), cache=decode.cache).logits
    assert not torch.allclose(logits, changed)


@pytest.mark.parametrize("stage", ["train", "prefill"])
def test_long_context_benchmark_cpu_smoke(tmp_path, stage):
    out = tmp_path / f"{stage}.json"
    assert bench_long_context.main([stage, "--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    if stage == "train":
        assert [g["group"] for g in report["groups"]] == ["tiny-rope@64", "tiny-xl@32"]
        rope = report["groups"][0]["members"]
        assert set(rope) == {"dense", "switchhead/eager", "switchhead/fused", "switchhead/cvmm", "switchhead/auto"}
        for label, implementation in (("switchhead/eager", "eager"), ("switchhead/fused", "switchhead_fused"),
                                      ("switchhead/auto", "switchhead_auto")):
            assert rope[label]["time_ratio"] > 0 and rope[label]["flop_ratio"] < 1
            assert rope[label]["experts_implementation"] == implementation
    else:
        assert {(r["pair"], r["tokens"]) for r in report["prefill"]} == {("tiny", 16), ("tiny", 32)}
        assert all(r["time_ratio"] > 0 for r in report["prefill"])


def test_decode_floor_benchmark_cpu_smoke(tmp_path):
    out = tmp_path / "decode.json"
    assert bench_decode_floor.main(["--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    labels = {(r["label"], r["batch"], r["length"]) for r in report["rows"]}
    assert labels == {(k, b, n) for k in ("dense", "switchhead", "switchhead/eager",
                                                                   "switchhead/fused") for b, n in ((2, 16), (1, 8))}
    assert all(r["step_seconds"] > 0 and r["kv_bytes"] > 0 for r in report["rows"])
    dense = {r["batch"]: r["kv_bytes"] for r in report["rows"] if r["label"] == "dense"}
    moe = {r["batch"]: r["kv_bytes"] for r in report["rows"] if r["label"] == "switchhead"}
    assert all(moe[b] < dense[b] for b in dense)  # fewer heads, a smaller cache


def test_fused_block_runs_fewer_matrix_products_and_keeps_less_than_the_per_projection_path():
    """The cost model's count for one attention block (bf16 autocast, forward and backward): the fused block makes
    q, k, values and routers in one GEMM, so it runs fewer matrix products than the per-projection path and than
    dense attention, fewer aten ops than the per-projection path, and its backward keeps fewer bytes per token
    (every expert's values are recomputed, not kept)."""
    moe, dense = roofline.rope_configs("47m-rope", 256)
    runs = (("dense", dense, None), ("eager", moe, "eager"), ("fused", moe, "switchhead_fused"))
    counts, doubled = ({label: roofline.attention_ops(config, implementation, tokens=tokens)
                        for label, config, implementation in runs} for tokens in (256, 512))

    def matmuls(c, side):
        return sum(c[f"{side}_ops"].get(op, 0) for op in ("mm", "bmm", "addmm"))

    assert matmuls(counts["fused"], "forward") == 2  # the input GEMM and the output GEMM (the core is sdpa's)
    assert matmuls(counts["dense"], "forward") == 4  # q, k, v, o
    for side in ("forward", "backward"):
        assert matmuls(counts["fused"], side) < matmuls(counts["eager"], side)
        assert matmuls(counts["fused"], side) < matmuls(counts["dense"], side)
        assert counts["fused"][side] < counts["eager"][side]
    per_token = {label: doubled[label]["saved_bytes"] - counts[label]["saved_bytes"] for label in counts}
    assert per_token["fused"] < per_token["eager"]
    assert per_token["fused"] < per_token["dense"]


def test_attention_block_benchmark_cpu_smoke(tmp_path):
    out = tmp_path / "block.json"
    assert bench_attention_block.main(["--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [row["label"] for row in report["rows"]] == ["dense", "switchhead/eager", "switchhead/fused"]
    assert all(row["seconds"] > 0 and row["aten_ops"] > 0 for row in report["rows"])
    assert report["rows"][0]["ratio_to_dense"] == 1.0
    assert out.with_suffix(".md").read_text().startswith("# One attention block")


@pytest.mark.integration  # compiles four models with inductor
def test_generate_host_benchmark_cpu_smoke(tmp_path):
    """Compiled `generate` (static cache) for Llama, dense, SwitchHead and its fused block, each step timed; the
    profile finds a compiled call for every decoding step (`generate` left uncompiled, as it is on a CPU unless
    asked, would have none)."""
    out = tmp_path / "host.json"
    assert bench_generate_host.main(["--cpu-smoke", "--out", str(out)]) == 0
    assert bench_generate_host.main(["--cpu-smoke", "--time-budget", "0", "--out", str(tmp_path / "cut.json")]) == 0
    cut = json.loads((tmp_path / "cut.json").read_text())  # a budget spent: the first model alone, still reported
    assert [row["member"] for row in cut["rows"]] == ["llama"]
    assert cut["not_run"] == list(bench_generate_host.MEMBERS[1:])
    assert "Not run (time budget): switchhead" in (tmp_path / "cut.md").read_text()
    report = json.loads(out.read_text())
    assert [row["member"] for row in report["rows"]] == list(bench_generate_host.MEMBERS)
    rows = {row["member"]: row for row in report["rows"]}
    assert rows["llama"]["ratio_to_llama"] == 1.0 and rows["dense"]["ratio_to_dense"] == 1.0
    assert report["not_run"] == []
    for row in report["rows"]:
        assert row["compiled_calls"] >= report["steps"]
        assert row["microseconds"]["compiled region"] > 0 and row["microseconds"]["guards"] > 0
    assert out.with_suffix(".md").read_text().startswith("# A step of compiled `generate` on the host")
