"""The experts implementations on SwitchAll / SwitchHead, and ours on stock MoE models.

- SwitchAll's sigma-MoE MLP is a Transformers experts module and SwitchHead attention's V/O experts read the same
  switch: "eager", "switchhead_batched", "switchhead_grouped" and "cvmm" run through `config._experts_implementation`
  / `from_pretrained(..., experts_implementation=...)` / `set_experts_implementation(...)`, each name one function
  of `expert_ops.EXPERTS_IMPLEMENTATIONS` for attention and MLP alike, at most three Python calls from the config
  value, and agree (forward and every gradient) within 1e-5 in fp32. Transformers' "batched_mm" / "grouped_mm" run
  SwitchAll's MLP under dense attention and are refused for SwitchHead attention.
- Importing the model registers our names for every MoE model: tiny random Mixtral, Qwen3-MoE, OLMoE (and GPT-OSS,
  whose experts have biases, [in, out] weights and an interleaved custom gate) match their eager experts on "cvmm".
"""

import sys
import unittest.mock

import pytest
import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.integrations import moe

import switchhead.expert_ops as expert_ops
import switchhead.experts_integration as integration
import switchhead.modeling_switchhead as modeling
from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

IMPLEMENTATIONS = ["eager", "switchhead_batched", "switchhead_grouped", "cvmm", "switchhead_auto", "switchhead_fused"]
TOL = dict(rtol=1e-5, atol=1e-5)


def _switchall(**overrides) -> SwitchHeadConfig:
    fields = dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                  num_attention_experts=4, num_attention_experts_per_tok=2, mlp_type="sigma_moe", num_mlp_experts=8,
                  mlp_expert_size=16, num_mlp_experts_per_tok=3, max_position_embeddings=64, hidden_dropout=0.0)
    fields.update(overrides)
    return SwitchHeadConfig(**fields)


def _forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _assert_same(reference, other, label):
    torch.testing.assert_close(other[0], reference[0], **TOL, msg=lambda m: f"{label} logits: {m}")
    assert reference[1].keys() == other[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(other[1][name], grad, **TOL, msg=lambda m, n=name: f"{label} d {n}: {m}")


VARIANTS = {"switchall": {}, "switchhead": dict(mlp_type="dense", intermediate_size=48),
            "switchall-dense-attention": dict(attention_type="dense")}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_implementation_matches_eager_forward_and_gradients(variant):
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_switchall(**VARIANTS[variant])).eval()
    ids = torch.randint(0, 101, (3, 40))
    results = {}
    # Transformers' own experts functions run the MLP where the attention has no experts
    extra = ["batched_mm", "grouped_mm"] if variant == "switchall-dense-attention" else []
    for implementation in IMPLEMENTATIONS + extra:
        model.set_experts_implementation(implementation)
        assert model.config._experts_implementation == implementation
        results[implementation] = _forward_backward(model, ids)
    for implementation in IMPLEMENTATIONS[1:] + extra:
        _assert_same(results["eager"], results[implementation], implementation)


def test_one_name_runs_one_function_for_attention_and_mlp():
    """Whatever the name, SwitchAll's V, O and MLP projections all run the table's entry of that name and no other
    entry, and nothing of Transformers' own experts functions."""
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_switchall()).eval()
    ids = torch.randint(0, 101, (2, 12))
    entries = {name: unittest.mock.Mock(wraps=entry) for name, entry in expert_ops.EXPERTS_IMPLEMENTATIONS.items()}
    theirs = {name: unittest.mock.Mock(wraps=moe.ALL_EXPERTS_FUNCTIONS[name]) for name in ("batched_mm", "grouped_mm")}
    layers = model.config.num_hidden_layers
    with unittest.mock.patch.dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, theirs), \
            unittest.mock.patch.dict(expert_ops.EXPERTS_IMPLEMENTATIONS, entries):
        integration.register()  # Transformers' table holds the spied entries for the length of the test
        for implementation in IMPLEMENTATIONS:
            model.set_experts_implementation(implementation)
            with torch.no_grad():
                model(ids)
            for name, entry in entries.items():  # per layer: V, O, and the MLP's two projections
                # (the fused block makes V in its one input GEMM: test_fused_attention.py)
                sides = 3 if name == "switchhead_fused" else 4
                want = sides * layers if name == implementation else 0
                assert entry.call_count == want, (implementation, name, entry.call_count)
                entry.reset_mock()
            assert all(mock.call_count == 0 for mock in theirs.values()), implementation
    integration.register()
    registered = moe.ALL_EXPERTS_FUNCTIONS._global_mapping
    for name in IMPLEMENTATIONS[1:]:  # what Transformers calls for the MLP is the entry the attention looks up
        assert registered[name].keywords["project"] is expert_ops.EXPERTS_IMPLEMENTATIONS[name]


def test_transformers_mlp_only_functions_are_refused_for_switchhead_attention():
    model = SwitchHeadForCausalLM(_switchall())
    for name in ("batched_mm", "grouped_mm"):
        with pytest.raises(ValueError, match="switchhead_batched"):
            model.set_experts_implementation(name)
        with pytest.raises(ValueError, match="experts_implementation"):
            SwitchHeadForCausalLM(_switchall(experts_implementation=name))
    assert model.config._experts_implementation == "switchhead_auto"
    model.config._experts_implementation = "batched_mm"  # set around the check: the attention still refuses it
    with pytest.raises(ValueError, match="has no expert projection"):
        model(torch.tensor([[1, 2, 3]]))


def _chains(run, starts, resolvers, entries):
    """Run `run()` under a profiler; for every call of a table entry, (Python calls made directly by the frame that
    read the configured name to resolve it, frames from that frame down to the entry, the entry's name)."""
    resolved, found = {}, []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code in starts:
            resolved[id(frame)] = 0  # a new activation (frame ids are reused)
        elif code in resolvers and frame.f_back is not None and frame.f_back.f_code in starts:
            resolved[id(frame.f_back)] = resolved.get(id(frame.f_back), 0) + 1
        elif code in entries:
            depth, outer = 1, frame.f_back
            while outer is not None and outer.f_code not in starts:
                if outer.f_code in entries:  # an entry that another entry calls: counted at the outer one
                    return
                depth, outer = depth + 1, outer.f_back
            if outer is not None:
                found.append((resolved.get(id(outer), 0), depth, entries[code]))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return found


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_at_most_three_calls_from_the_config_value_to_the_code_that_runs(implementation):
    """From the frame that reads `config._experts_implementation` (an attention projection, or the MLP's experts
    decorator) to the table's function for that name: one lookup, then at most three Python calls in all."""
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_switchall()).eval()
    model.set_experts_implementation(implementation)
    attention, experts = modeling.SwitchHeadAttention, modeling.SigmaMoeExperts
    starts = {attention.project_values.__code__, attention.project_output.__code__, experts.forward.__code__}
    resolvers = {expert_ops.lookup.__code__, moe.ExpertsInterface.get_interface.__code__}
    entries = {entry.__code__: name for name, entry in expert_ops.EXPERTS_IMPLEMENTATIONS.items()}
    with torch.no_grad():
        found = _chains(lambda: model(torch.randint(0, 101, (2, 12))), starts, resolvers, entries)
    layers = model.config.num_hidden_layers
    # "switchhead_fused": the layer makes the values itself, in its one input GEMM (test_fused_attention.py)
    table_sides = 3 if implementation == "switchhead_fused" else 4
    assert len(found) == table_sides * layers and {name for _, _, name in found} == {implementation}
    assert all(lookups == 1 for lookups, _, _ in found), found
    assert max(lookups + depth for lookups, depth, _ in found) <= 3, found


def test_choosing_through_config_and_from_pretrained(tmp_path):
    config = _switchall(experts_implementation="switchhead_batched")
    model = SwitchHeadForCausalLM(config)
    assert model.config._experts_implementation == "switchhead_batched"
    model.save_pretrained(tmp_path)
    loaded = SwitchHeadForCausalLM.from_pretrained(tmp_path, experts_implementation="switchhead_grouped")
    assert loaded.config._experts_implementation == "switchhead_grouped"
    assert SwitchHeadForCausalLM.from_pretrained(tmp_path).config._experts_implementation == "switchhead_auto"
    with pytest.raises((ValueError, KeyError), match="experts_implementation"):
        model.set_experts_implementation("no_such_kernel")


def test_default_is_switchhead_auto_with_the_package_and_eager_without():
    assert SwitchHeadForCausalLM(_switchall()).config._experts_implementation == "switchhead_auto"
    without = {name: fn for name, fn in moe.ALL_EXPERTS_FUNCTIONS._global_mapping.items()
               if name != "switchhead_auto"}
    with unittest.mock.patch.dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, without, clear=True):
        assert SwitchHeadForCausalLM(_switchall()).config._experts_implementation == "eager"


def test_sigma_moe_mlp_has_a_router_and_an_experts_module():
    model = SwitchHeadForCausalLM(_switchall())
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts, modeling.SigmaMoeExperts) and isinstance(mlp.gate, modeling.ExpertSelection)
    experts = mlp.experts
    assert (experts.has_gate, experts.has_bias, experts.is_transposed) == (False, False, True)
    assert experts.up_proj is experts.expert_keys and experts.down_proj is experts.expert_values
    names = {name for name in model.state_dict() if ".mlp." in name and name.startswith("model.layers.0.")}
    assert names == {"model.layers.0.mlp.experts.expert_keys", "model.layers.0.mlp.experts.expert_values",
                     "model.layers.0.mlp.gate.weight"}


# ------------------------------------------------------------------------------------------------ stock MoE models
def _mixtral():
    return MixtralForCausalLM(MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                                            num_experts_per_tok=2, max_position_embeddings=64))


def _qwen3_moe():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                              moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                                              decoder_sparse_step=1, max_position_embeddings=64))


def _olmoe():
    return OlmoeForCausalLM(OlmoeConfig(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_experts=6,
                                        num_experts_per_tok=2, max_position_embeddings=64))


def _gpt_oss():  # experts with biases, [E, in, out] weights and an interleaved gate/up with a custom gate
    return GptOssForCausalLM(GptOssConfig(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=64,
                                          layer_types=["full_attention", "full_attention"]))


STOCK = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe, "gpt_oss": _gpt_oss}


@pytest.mark.parametrize("name", list(STOCK))
def test_cvmm_runs_stock_moe_models_like_eager(name):
    torch.manual_seed(0)
    model = STOCK[name]().eval()
    with torch.no_grad():  # biases start at zero: make them matter
        for param_name, param in model.named_parameters():
            if "experts" in param_name and param_name.endswith("_bias"):
                param.normal_(std=0.1)
    ids = torch.randint(0, 97, (2, 24))
    model.set_experts_implementation("eager")
    eager = _forward_backward(model, ids)
    experts_calls = unittest.mock.Mock(wraps=moe.ALL_EXPERTS_FUNCTIONS["cvmm"])
    with unittest.mock.patch.dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, {"cvmm": experts_calls}):
        model.set_experts_implementation("cvmm")
        assert model.config._experts_implementation == "cvmm"
        cvmm = _forward_backward(model, ids)
    assert experts_calls.call_count == 2  # one experts module per layer ran on cvmm
    _assert_same(eager, cvmm, f"{name} cvmm")


@pytest.mark.parametrize("model_name, implementation", [("mixtral", "cvmm"), ("switchall", "cvmm"),
                                                        ("switchall", "eager")])
def test_routes_to_other_processes_experts_add_nothing(model_name, implementation):
    """Expert parallelism hands a module its local experts and marks a route to another process's expert with the
    id `num_experts` and gate 0 (Transformers' AllReduceEP): that route adds nothing, as if it were not there."""
    torch.manual_seed(0)
    model = _mixtral() if model_name == "mixtral" else SwitchHeadForCausalLM(_switchall())
    model.set_experts_implementation(implementation)
    experts = model.model.layers[0].mlp.experts
    tokens, index, weights = torch.randn(5, 32), torch.randint(0, experts.num_experts, (5, 2)), torch.rand(5, 2)
    only_local = experts(tokens, index[:, :1], weights[:, :1])
    index[:, 1], weights[:, 1] = experts.num_experts, 0.0  # every second slot: another process's expert
    experts._is_expert_parallel = True
    with_sentinels = experts(tokens, index, weights)
    torch.testing.assert_close(with_sentinels, only_local, rtol=0, atol=1e-6)


def test_experts_benchmark_smoke(tmp_path):
    """benchmarks/bench_experts.py on a tiny shape: checks every implementation against eager, writes JSON + MD."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_experts

    out = tmp_path / "experts.json"
    assert bench_experts.main(["--hidden", "32", "--intermediate", "48", "--tokens", "4,24", "--reps", "1",
                               "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {row["mode"] for row in report["results"]} == {"forward", "forward+backward"}
    assert set(report["results"][0]["ms"]) == set(bench_experts.IMPLEMENTATIONS)
    assert all(error < 1e-4 for errors in report["check"].values() for error in errors.values())
    assert report["threads"] >= 1 and "load_before" in report
    assert "| tokens | mode |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("implementation", ["switchhead_batched", "cvmm"])
def test_training_step_compiles_fullgraph_with_the_switch_and_dynamic_rope(implementation):
    """The experts dispatch (MLP and attention) and the dynamic RoPE trace into one graph (aot_eager: dynamo, fake
    tensors and AOTAutograd without inductor's C++ build)."""
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_switchall(rope_parameters={"rope_type": "dynamic", "factor": 2.0},
                                             max_position_embeddings=8)).eval()
    model.set_experts_implementation(implementation)
    ids = torch.randint(0, 101, (2, 12))  # longer than max_position_embeddings: the dynamic base is in use

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    torch._dynamo.reset()
    eager_loss = loss_fn(ids)
    compiled_loss = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(ids)
    torch.testing.assert_close(compiled_loss, eager_loss, **TOL)


def test_the_attention_reads_the_configured_implementation_as_set():
    # the same value after from_config, set_experts_implementation and a plain assignment
    model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead"))
    called = []  # the implementation each projection asks the table for
    lookup = expert_ops.lookup
    with unittest.mock.patch.object(modeling, "lookup", lambda name: called.append(name) or lookup(name)):
        for name in IMPLEMENTATIONS:
            model.set_experts_implementation(name)
            with torch.no_grad():
                model(input_ids=torch.tensor([[1, 2, 3]]))
            assert called and set(called) == {name}
            called.clear()
        model.config._experts_implementation = "switchhead_grouped"
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    assert called and set(called) == {"switchhead_grouped"}
