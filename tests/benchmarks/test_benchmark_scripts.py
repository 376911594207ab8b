"""The benchmark scripts run end to end in their quick modes and write their JSON and Markdown."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from helpers.decoding import variant_model

pytestmark = pytest.mark.integration  # runs the benchmarks


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


def test_model_benchmark_moeut_family_is_three_models_of_44m_and_their_three_ratios():
    """--family moeut: MoEUT 44M, SwitchAll without shared layers and the MoEUT paper's dense baseline, within 4% of
    one another's parameters; the ratios are MoEUT / dense, SwitchAll / dense and MoEUT / SwitchAll."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_model

    models, pairs, references = bench_model.FAMILIES["moeut"]
    assert not references and set(pairs) == {"moeut/dense", "switchall/dense", "moeut/switchall"}
    with torch.device("meta"):
        built = {name: bench_model.build(name, False, "sdpa") for name in models}
    counts = {name: bench_model._count(model) for name, model in built.items()}
    assert built["moeut"].config.layer_group_size == 2 and built["moeut"].config.num_hidden_layers == 16
    assert built["switchall-moeut"].config.layer_group_size is None
    assert {m.config.position_encoding for m in built.values()} == {"rope"}
    assert {m.config.max_position_embeddings for m in built.values()} == {1024}
    assert max(counts.values()) / min(counts.values()) < 1.04, counts
    medians = {f"{kind}/{name}{suffix}": value for name, value in (("moeut", 3.0), ("switchall-moeut", 2.0),
                                                                   ("dense-moeut", 1.0))
               for kind, suffix in (("train_s", "/32"), ("prefill_s", ""), ("decode_tok_s/eager", "/1"))}
    report = dict(medians=medians, samples={}, train_peak_memory={},
                  kv_cache_bytes={"moeut": 3, "switchall-moeut": 2, "dense-moeut": 1})
    ratios = bench_model.ratios(report, [32], [1], [], None, pairs)
    assert ratios["moeut/dense"]["train_time@32"] == 3.0 and ratios["moeut/switchall"]["prefill_time"] == 1.5
    assert ratios["switchall/dense"]["decode_tok_s_eager@b1"] == 2.0
    assert "| measure | MoEUT / dense | SwitchAll / dense | MoEUT / SwitchAll |" in bench_model.markdown(dict(
        report, ratios=ratios, machine=dict(cpu="c", cores=1, threads=1, torch="t", transformers="t",
                                            omp_wait_policy=None), mode="full", family="moeut",
        attn_implementation="sdpa", load_average_before=(0, 0, 0), load_average_after=(0, 0, 0),
        settings=dict(contexts=[32]), parameters=counts))


@pytest.mark.integration
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


def test_vllm_markdown_of_one_pair_gives_each_cells_median_ratio_and_range():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_vllm

    ours, dense = (bench_vllm.label(spec) for spec in bench_vllm.PAIRS["47M RoPE"])
    info = dict(machine="test", cpu="test cpu", cpu_count=2, torch="t", torch_threads=1, omp_num_threads="1",
                transformers="t", vllm="v", kv_cache_gib=1.0, new_tokens=16, load_average_before=[1.0, 1.0, 1.0],
                load_average_after=[1.0, 1.0, 1.0], note="test")

    def row(model, tokens_per_s, repeat):
        return dict(model=model, prompt_tokens=1024, concurrency=32, repeat=repeat, tokens_per_s=tokens_per_s,
                    seconds=1.0, generated=512, p50_s=10.0 * repeat, p95_s=20.0)

    # three repetitions, the second with the dense model first: ratios 1.5, 1.2, 1.1
    speed = [row(ours, 6.0, 0), row(dense, 4.0, 0), row(dense, 5.0, 1), row(ours, 6.0, 1), row(ours, 5.5, 2),
             row(dense, 5.0, 2)]
    results = dict(info=info, speed=speed, capacity={ours: dict(cache_tokens=65536, sequences=64),
                                                     dense: dict(cache_tokens=12288, sequences=12)},
                   generate_batch={})
    assert bench_vllm.pairs_in(results) == ["47M RoPE"]  # the XL pair was not run: no row, no KeyError
    (cell,) = bench_vllm.ratio_summary(results)
    assert cell["ratios"] == pytest.approx([1.5, 1.2, 1.1])
    assert (cell["median"], cell["min"], cell["max"]) == pytest.approx((1.2, 1.1, 1.5))
    assert cell["switchhead"]["tokens_per_s"] == 6.0 and cell["dense"]["p50_s"] == 10.0
    text = bench_vllm.markdown(results)
    assert "| 47M RoPE | 1024 | 32 | 3 | 1.20x | 1.10-1.50x | 6.0 | 5.0 | 10.00 / 20.00 | 10.00 / 20.00 |" in text
    assert "| 47M RoPE | 64 | 12 | 5.33x |" in text
    assert "47M XL" not in text and "generate_batch" not in text  # neither the XL pair nor generate_batch was run
    # a result written before repetitions (one row per model and cell, no `repeat`) reads as one repetition
    for item in speed:
        del item["repeat"]
    results["speed"] = speed[:2]
    assert "| 47M RoPE | 1024 | 32 | 1 | 1.50x | 1.50-1.50x |" in bench_vllm.markdown(results)


@pytest.mark.integration
def test_compare_runs_takes_interleaved_runs_with_the_earlier_version_first_on_the_path(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import json
    import subprocess

    import compare_runs

    assert compare_runs.order(3) == ["before", "after", "after", "before", "before", "after"]
    site = tmp_path / "site"
    (site / "switchhead").mkdir(parents=True)
    (site / "switchhead" / "__init__.py").write_text("")
    calls = []

    def run(command, env, **kwargs):  # the import check for real; the benchmark faked: a result per version
        if command[1] == "-c":
            return subprocess.run(command, env=env, **kwargs)
        out = Path(command[command.index("--out") + 1])
        calls.append((Path(command[1]).name, command[2:-2], out.name, env.get("PYTHONPATH", "")))
        out.write_text(json.dumps({"ratios": {"rope": {"decode_tok_s_eager@b1": 1.0 if "before" in out.name
                                                       else 1.1}}}))

    paths = compare_runs.take_runs(site, ["bench_model.py", "--decode-only"], 2, tmp_path / "runs", run=run)
    assert [c[2] for c in calls] == ["before_1.json", "after_1.json", "after_2.json", "before_2.json"]
    assert all(c[:2] == ("bench_model.py", ["--decode-only"]) for c in calls)
    assert all(c[3].startswith(str(site)) == c[2].startswith("before") for c in calls)
    assert paths == {"before": [tmp_path / "runs" / "before_1.json", tmp_path / "runs" / "before_2.json"],
                     "after": [tmp_path / "runs" / "after_1.json", tmp_path / "runs" / "after_2.json"]}
    empty = tmp_path / "empty"  # an earlier version that is not where switchhead is imported from: refused
    empty.mkdir()
    with pytest.raises(RuntimeError, match="the before run would import switchhead from"):
        compare_runs.take_runs(empty, ["bench_model.py"], 1, tmp_path / "runs2", run=run)


@pytest.mark.integration
def test_compare_runs_installs_the_package_of_a_commit(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import subprocess

    import compare_runs

    repo = Path(__file__).resolve().parents[2]
    site = compare_runs.install_commit("HEAD", tmp_path)
    committed = subprocess.run(["git", "-C", str(repo), "show", "HEAD:modeling_switchhead/modeling_switchhead.py"],
                               check=True, capture_output=True, text=True).stdout
    assert (site / "switchhead" / "modeling_switchhead.py").read_text() == committed  # the commit's, not the tree's
    assert (site / "switchhead" / "kernels" / "__init__.py").is_file()  # laid out as the package imports


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("transformers.distributed.expert_parallel") is None,
                    reason="this Transformers release has no expert parallelism in its distributed engine")
def test_scaleout_benchmark_quick_run_counts_what_fsdp_and_expert_parallelism_send(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import json

    import bench_scaleout
    import scaleout_model

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    out = tmp_path / "scaleout.json"
    assert bench_scaleout.main(["--quick", "--context", "16", "--steps", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    single, sharded = report["rows"]
    assert (single["processes"], sharded["processes"]) == (1, 2) and not sharded.get("refused")
    assert single["sent_bytes"] == 0 and sharded["unaccounted_collectives"] == {}
    assert single["train_peak_rss_bytes"] > single["held_bytes"] > 0 and single["median_step_seconds"] > 0
    # 2 processes: FSDP shards the dense parameters and EP puts 4 of the 8 experts of a layer on each, so each holds
    # half of the parameters, gradients and AdamW state
    assert sharded["held_parts"]["parameters"] * 2 == single["held_parts"]["parameters"]
    assert sharded["held_parts"]["gradients"] * 2 == single["held_parts"]["gradients"]
    assert sharded["held_bytes"] * 2 == pytest.approx(single["held_bytes"], rel=1e-3)  # AdamW's step counters
    # FSDP reduce-scatters each gradient outside the experts once (the experts' own group has one process here)
    config = SwitchHeadConfig.from_preset("tiny-switchall")
    dense = sum(p.numel() for name, p in SwitchHeadForCausalLM(config).named_parameters()
                if ".mlp.experts." not in name)
    kinds = sharded["collectives"]
    assert kinds["reduce_scatter"]["payload_bytes"] == 4 * dense
    assert kinds["all_to_all"]["count"] >= 4 * config.num_hidden_layers and kinds["all_reduce"]["count"] == 0
    # the model's shard and payload formulas (scripts/scaleout_model.py) at this run's settings give the counted
    # bytes: exactly for the shards and FSDP, and for the all-to-alls up to the routing metadata sent beside the tokens
    (check,) = scaleout_model.check(report)
    assert check["modelled"]["parameters_held"] == check["counted"]["parameters_held"]
    assert check["modelled"]["all_gather"] == check["counted"]["all_gather"]
    assert check["modelled"]["reduce_scatter"] == check["counted"]["reduce_scatter"]
    assert check["modelled"]["all_to_all"] <= check["counted"]["all_to_all"] <= 1.2 * check["modelled"]["all_to_all"]
    assert "| SwitchAll | `fsdp_size=2, ep_size=2` | 2 |" in out.with_suffix(".md").read_text()


def test_decode_experts_benchmark_checks_every_formulation_and_names_the_rules_choice(tmp_path, monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import json

    import bench_decode_experts

    from switchhead import expert_ops

    out = tmp_path / "decode_experts.json"
    assert bench_decode_experts.main(["--reps", "1", "--ring-mib", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["variant"], r["k"]) for r in report["rows"]] == [(v, k) for v in ("rope", "xl") for k in range(1, 6)]
    # one token selects at most every expert once: the rule gathers the selected ones at every k
    assert [r["rule_chooses"] for r in report["rows"]] == ["batched"] * 10
    assert all(len(r["us_per_layer"]) == 5 and min(r["us_per_layer"].values()) > 0 for r in report["rows"])
    assert "| rope | 3 of 5 |" in out.with_suffix(".md").read_text()
    # a formulation that disagrees with the naive twin stops the run before any timing
    broken = dict(bench_decode_experts.FORMULATIONS, batched=lambda *args: expert_ops.naive(*args) * 2)
    monkeypatch.setattr(bench_decode_experts, "FORMULATIONS", broken)
    with pytest.raises(SystemExit) as stopped:
        bench_decode_experts.main(["--reps", "1", "--ring-mib", "1", "--out", str(tmp_path / "broken.json")])
    assert stopped.value.code == 1 and not (tmp_path / "broken.json").exists()


def test_autocast_precision_probe_writes_its_tables(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import autocast_precision

    out = tmp_path / "precision.json"
    assert autocast_precision.main(["--variants", "k=E", "--steps", "2", "--out", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert report["steps"] == 2 and set(report["errors"]) == {"k=E"}
    errors = report["errors"]["k=E"]["trained"]
    assert len(errors) == len(autocast_precision.NAMES) * 2 * 2 and all(value > 0 for value in errors.values())
    markdown = out.with_suffix(".md").read_text()
    assert "## bf16, routing fixed" in markdown and "## fp16, routing free" in markdown
    with pytest.raises(SystemExit) as error:
        autocast_precision.main(["--variants", "k=9"])
    assert error.value.code == 2


@pytest.mark.parametrize("variant", ["dense-rope", "dense-xl"])
def test_saved_memory_counts_sdpa_as_a_fused_kernel_keeps_it(variant):
    # under bf16 autocast, causal RoPE attention runs the CPU's flash kernel, which keeps what a GPU's fused kernel
    # keeps (q, k, v, output, log-sum-exp): the same bytes either way; XL's float mask needs a gradient, so the CPU
    # runs the math kernel, whose float32 copies of q, k and v are told apart and left out of the parts
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import saved_memory

    model = variant_model(variant).train()
    memory = 6 if variant == "dense-xl" else 0
    model.config._attn_implementation = "sdpa"
    plain = saved_memory.saved_bytes(model, 2, 12, autocast=True, memory=memory, square={})
    cpu = {}
    fused = saved_memory.saved_bytes(model, 2, 12, autocast=True, memory=memory, square={}, fused_sdpa=cpu)
    assert fused["mlp"] == plain["mlp"] and fused["layernorm"] == plain["layernorm"]
    if variant == "dense-rope":
        assert fused == plain and set(cpu) == {"attention"}  # only the CPU kernel's own log-sum-exp, counted alike
    else:
        assert cpu["attention"] > 0 and fused["attention"] < plain["attention"]


def test_saved_memory_per_token_counts_both_dtypes_and_every_formulation(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import json

    import saved_memory

    out = tmp_path / "tokens.json"
    assert saved_memory.main(["--per-token", "--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    table = report["per_token"]
    assert set(table) == {f"{f}/{m}/{d}" for f in saved_memory.FAMILIES for m in saved_memory.FORMULATIONS
                          for d in saved_memory.DTYPES}
    for family in saved_memory.FAMILIES:
        attention = {key: row["layer"]["attention"] for key, row in table.items() if key.startswith(family + "/")}
        # bf16 autocast keeps half-width copies: dense attention keeps less than in fp32; the lean block keeps less
        # than the per-projection path and than dense
        assert attention[f"{family}/dense/bf16"] < attention[f"{family}/dense/fp32"]
        assert attention[f"{family}/switchhead/lean/bf16"] < attention[f"{family}/switchhead/eager/bf16"]
        assert attention[f"{family}/switchhead/lean/bf16"] < attention[f"{family}/dense/bf16"]
    # a whole step is the per-token bytes times its tokens plus the constant: the same model, twice the tokens
    row = table["47m-rope/dense/bf16"]
    one, two = (sum(saved_memory.step_bytes(row, 2, tokens).values()) for tokens in (1000, 2000))
    assert two - one == one - sum(row["constant"].values())
    assert "| 47m-xl | attention block |" in out.with_suffix(".md").read_text()
