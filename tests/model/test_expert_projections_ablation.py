"""The value-only / output-only expert ablation (`attention_expert_projections`, the paper's Table 6).

"value_output" (the default) is SwitchHead; "value" keeps the value experts and uses a dense, ungated output
projection; "output" uses a dense value projection and keeps the output experts. Each variant's layer equals the
formula written as loops (fp64, with gradients); the default is untouched (same tensors, same initialisation,
old config files without the field load); save / load, cached decoding, accounting, routers and LoRA targets.
"""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM, SwitchHeadModel
from switchhead.evaluation.accounting import attention_macs, attention_memory, cost_report
from switchhead.modeling_switchhead import SwitchHeadAttention
from switchhead.routing import mlp_router_logits
from helpers.padding import generate_cached_and_uncached, left_padded_batch

SIDES = ["value_output", "value", "output"]
SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, head_dim=8,
             num_attention_experts=4, num_attention_experts_per_tok=2, intermediate_size=32,
             max_position_embeddings=64, hidden_dropout=0.0)


def small_model(sides: str, **overrides) -> SwitchHeadForCausalLM:
    torch.manual_seed(0)
    return SwitchHeadForCausalLM(SwitchHeadConfig(**{**SMALL, **overrides}, attention_expert_projections=sides))


# ------------------------------------------------------------------------------------------ the formula
def slow_attention(x, q_w, k_w, value_side, output_side, heads, experts, top_k, rotary):
    """One causal RoPE attention layer as loops over batch, heads, positions and experts.

    value_side: ("experts", W_S [H*E, d], W_V [H*E, d, dh]) or ("dense", W_v [H*dh, d]);
    output_side: ("experts", W_D [H*E, d], W_O [H*E, dh, d]) or ("dense", W_o [d, H*dh]).
    An expert side sums the top-k experts of each head, each scaled by its raw sigmoid score; a dense side is a
    plain matrix product of that head's slice (no gate).
    """
    batch, length, d = x.shape
    dh = q_w.shape[0] // heads
    y = torch.zeros(batch, length, d, dtype=x.dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=x.dtype) / rotary))

    def rope(vector, position):
        angles = position * inv_freq
        cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
        part, half = vector[:rotary], rotary // 2
        return torch.cat([part * cos + torch.cat([-part[half:], part[:half]]) * sin, vector[rotary:]])

    for b in range(batch):
        for h in range(heads):
            rows = slice(h * dh, (h + 1) * dh)
            q = torch.stack([rope(x[b, t] @ q_w[rows].T, float(t)) for t in range(length)])
            k = torch.stack([rope(x[b, t] @ k_w[rows].T, float(t)) for t in range(length)])
            values = []
            for t in range(length):
                if value_side[0] == "dense":
                    values.append(x[b, t] @ value_side[1][rows].T)
                    continue
                scores = torch.sigmoid(x[b, t] @ value_side[1].T).view(heads, experts)[h]
                v = torch.zeros(dh, dtype=x.dtype)
                for e in torch.topk(scores, top_k).indices.tolist():
                    v = v + scores[e] * (x[b, t] @ value_side[2][h * experts + e])
                values.append(v)
            values = torch.stack(values)
            for t in range(length):
                attended = torch.softmax((q[t] @ k[: t + 1].T) / dh**0.5, -1) @ values[: t + 1]
                if output_side[0] == "dense":
                    y[b, t] = y[b, t] + attended @ output_side[1][:, rows].T
                    continue
                scores = torch.sigmoid(x[b, t] @ output_side[1].T).view(heads, experts)[h]
                for e in torch.topk(scores, top_k).indices.tolist():
                    y[b, t] = y[b, t] + scores[e] * (attended @ output_side[2][h * experts + e])
    return y


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("sides", SIDES)
def test_each_variant_matches_the_formula_with_gradients(sides, implementation):
    torch.manual_seed(1)
    config = SwitchHeadConfig(**{**SMALL, "num_hidden_layers": 1}, attention_expert_projections=sides,
                              attn_implementation=implementation)
    model = SwitchHeadModel(config).double()
    layer = model.layers[0].self_attn
    assert isinstance(layer, SwitchHeadAttention)
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    cos_sin = model.rotary_emb(x, torch.arange(6)[None].expand(2, -1))
    fast, _ = layer(x, position_embeddings=cos_sin, attention_mask=None)

    if sides in ("value_output", "value"):
        value_params = [layer.value_selection.weight, layer.value_experts]
    else:
        value_params = [layer.v_proj.weight]
    if sides in ("value_output", "output"):
        output_params = [layer.output_selection.weight, layer.output_experts]
    else:
        output_params = [layer.o_proj.weight]
    params = [layer.q_proj.weight, layer.k_proj.weight] + value_params + output_params
    # exactly these tensors: no router or expert tensor on a dense side
    assert {id(p) for p in layer.parameters()} == {id(p) for p in params}
    grad_out = torch.randn_like(fast)
    fast_grads = torch.autograd.grad(fast, [x] + params, grad_out)

    x_slow = x.detach().clone().requires_grad_(True)
    slow_params = [p.detach().clone().requires_grad_(True) for p in params]
    q_w, k_w = slow_params[:2]
    rest = slow_params[2:]
    value_side = ("experts", *rest[:2]) if len(value_params) == 2 else ("dense", rest[0])
    rest = rest[len(value_params):]
    output_side = ("experts", *rest) if len(output_params) == 2 else ("dense", rest[0])
    slow = slow_attention(x_slow, q_w, k_w, value_side, output_side, heads=2, experts=4, top_k=2,
                          rotary=config.num_rotary_channels)
    slow_grads = torch.autograd.grad(slow, [x_slow] + slow_params, grad_out)
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=1e-10)
    for index, (got, want) in enumerate(zip(fast_grads, slow_grads)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=f"gradient {index}")


# ------------------------------------------------------------------------------------------ the default
def test_the_default_is_value_output_with_the_same_tensors_init_and_outputs():
    assert SwitchHeadConfig().attention_expert_projections == "value_output"
    torch.manual_seed(0)
    implicit = SwitchHeadForCausalLM(SwitchHeadConfig(**SMALL))
    explicit = small_model("value_output")
    names = [n for n, _ in implicit.named_parameters()]
    assert names == [n for n, _ in explicit.named_parameters()]
    attention = sorted(n.split("self_attn.")[1] for n in names if n.startswith("model.layers.0.self_attn."))
    assert attention == ["k_proj.weight", "output_experts", "output_selection.weight", "q_proj.weight",
                         "value_experts", "value_selection.weight"]
    for (name, a), b in zip(implicit.state_dict().items(), explicit.state_dict().values()):
        assert torch.equal(a, b), name  # same random draws in the same order
    ids = torch.randint(0, 64, (2, 7))
    assert torch.equal(implicit(ids).logits, explicit(ids).logits)


def test_a_config_file_without_the_field_loads_as_the_default(tmp_path):
    """Checkpoints saved before the field existed have no `attention_expert_projections` in config.json."""
    model = small_model("value_output").eval()
    ids = torch.randint(0, 64, (2, 7))
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("attention_expert_projections") == "value_output"
    (tmp_path / "config.json").write_text(json.dumps(config))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.attention_expert_projections == "value_output"
    assert torch.equal(reloaded(ids).logits, expected)


# ------------------------------------------------------------------------------------------ init
@pytest.mark.parametrize("sides", ["value", "output"])
def test_the_dense_side_gets_the_papers_init_for_that_side(sides):
    """A dense V gets std init_scale / sqrt(d) like W_V, a dense O std init_scale / sqrt(H*dh) like W_O."""
    config = SwitchHeadConfig(**{**SMALL, "hidden_size": 128, "head_dim": 64, "num_hidden_layers": 2},
                              attention_expert_projections=sides)
    torch.manual_seed(0)
    layer = SwitchHeadForCausalLM(config).model.layers[0].self_attn
    if sides == "value":
        dense, width = layer.o_proj.weight, 2 * 64
        assert tuple(dense.shape) == (128, 2 * 64) and not hasattr(layer, "output_selection")
    else:
        dense, width = layer.v_proj.weight, 128
        assert tuple(dense.shape) == (2 * 64, 128) and not hasattr(layer, "value_selection")
    assert getattr(layer, "o_proj" if sides == "value" else "v_proj").bias is None
    want = config.init_scale / width**0.5
    assert abs(float(dense.std()) / want - 1) < 0.05


# ------------------------------------------------------------------------------------------ save / load, decoding
@pytest.mark.parametrize("sides", ["value", "output"])
def test_save_and_reload_gives_identical_logits(sides, tmp_path):
    model = small_model(sides).eval()
    ids = torch.randint(0, 64, (2, 9))
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attention_expert_projections"] == sides
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.attention_expert_projections == sides
    assert torch.equal(reloaded(ids).logits, expected)


@pytest.mark.parametrize("position", ["rope", "xl"])
@pytest.mark.parametrize("sides", ["value", "output"])
def test_cached_decoding_equals_uncached(sides, position):
    extra = dict(position_encoding="xl", xl_memory_length=0) if position == "xl" else {}
    model = small_model(sides, **extra).eval()
    ids, mask = left_padded_batch(64)
    generate_cached_and_uncached(model, ids, mask, new_tokens=6)


# ------------------------------------------------------------------------------------------ routers
@pytest.mark.parametrize("sides, routers", [("value_output", 2), ("value", 1), ("output", 1)])
def test_router_logits_count_only_the_expert_sides(sides, routers):
    model = small_model(sides, mlp_type="sigma_moe", num_mlp_experts=4, mlp_expert_size=8,
                        num_mlp_experts_per_tok=2).eval()
    assert model.config.routers_per_layer == routers + 1
    out = model(torch.randint(0, 64, (1, 5)), output_router_logits=True)
    assert len(out.router_logits) == SMALL["num_hidden_layers"] * (routers + 1)
    # the sigma-MoE routers are still the ones picked out for the entropy term: E = 4 columns
    assert all(logits.shape[-1] == 4 for logits in mlp_router_logits(out.router_logits, model.config))
    from switchhead.evaluation.analysis import router_layout

    names = [name for name, _, _ in router_layout(model.config)]
    want = {"value_output": ["value selection (W_S)", "output selection (W_D)"],
            "value": ["value selection (W_S)"], "output": ["output selection (W_D)"]}[sides]
    assert names == want + ["sigma-MoE MLP"]


# ------------------------------------------------------------------------------------------ accounting
def test_accounting_counts_a_dense_value_or_output_projection():
    """d=16, H=2, dh=8, E=4, k=2, T=10, RoPE (C=1), by hand from the table formula:
    attention matrices 2*H*dh*T*T = 3,200; one projection d*H*dh*T = 2,560.
    V+O experts: Q, K + k experts of V and O = 6 x 2,560; gates 2*H*k*T*dh = 640; selections 2*E*d*T = 1,280.
    V or O experts: Q, K, the dense side + k experts of the other = 5 x 2,560; gates 320; one selection 640.
    Memory: logits and probabilities 2*H*T*T = 400, q, k, v, output 4*H*dh*T = 640, selections E*T per router.
    """
    configs = {sides: SwitchHeadConfig(**SMALL, attention_expert_projections=sides) for sides in SIDES}
    assert attention_macs(configs["value_output"], 10) == 3_200 + 6 * 2_560 + 640 + 1_280 == 20_480
    for sides in ("value", "output"):
        assert attention_macs(configs[sides], 10) == 3_200 + 5 * 2_560 + 320 + 640 == 16_960
        assert attention_memory(configs[sides], 10) == 400 + 640 + 40 == 1_080
        # the printed equation (eq13) leaves the selections out
        assert attention_macs(configs[sides], 10, formula="eq13") == 3_200 + 5 * 2_560 + 320
        report = cost_report(configs[sides], 10)
        assert report.attention_macs_table == 16_960 and report.model_forward_macs["attention_per_layer"] == 16_960
    assert attention_memory(configs["value_output"], 10) == 400 + 640 + 80 == 1_120
    # XL with one memory chunk (C=2): selections over C*T positions, one positional projection 2*H*d*T*dh
    xl = SwitchHeadConfig(**{**SMALL, "max_position_embeddings": 20}, position_encoding="xl", xl_memory_length=10,
                          attention_expert_projections="value")
    assert attention_macs(xl, 10) == 2 * 2 * 8 * 100 * 2 + 5 * 2_560 + 320 + 4 * 16 * 10 * 2 + 2 * 2 * 16 * 10 * 8


def test_a_variant_with_one_expert_side_has_the_parameters_the_accounting_assumes():
    d, heads, dh, experts = 16, 2, 8, 4
    counts = {}
    for sides in SIDES:
        layer = small_model(sides).model.layers[0].self_attn
        counts[sides] = sum(p.numel() for p in layer.parameters())
    moe_side = heads * experts * d * dh + heads * experts * d  # experts + their router
    dense_side = d * heads * dh
    assert counts["value"] == counts["output"] == counts["value_output"] - moe_side + dense_side


# ------------------------------------------------------------------------------------------ validation, TP, PEFT
@pytest.mark.parametrize("value", ["values", "Value", "v", "", None, 1, ["value"]])
def test_unknown_values_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="attention_expert_projections"):
        SwitchHeadConfig(**SMALL, attention_expert_projections=value)


def test_a_dense_attention_refuses_an_expert_side():
    with pytest.raises(ValueError, match="attention_expert_projections='value' needs attention_type='switchhead'"):
        SwitchHeadConfig(**SMALL, attention_type="dense", attention_expert_projections="value")
    assert SwitchHeadConfig(**SMALL, attention_type="dense").attention_expert_projections == "value_output"


@pytest.mark.parametrize("sides", ["value", "output"])
def test_tensor_parallel_plan_names_only_what_the_variant_has(sides):
    """Every attention entry of the TP plan names a module the variant has, and its dense side, where planned,
    is split the way a dense layer's is (v_proj colwise, o_proj rowwise)."""
    model = small_model(sides)
    plan = model.config.base_model_tp_plan or {}
    layer = model.model.layers[0].self_attn
    for key, style in plan.items():
        if key.startswith("layers.*.self_attn"):
            path = key[len("layers.*.self_attn"):].lstrip(".")
            assert path == "" or hasattr(layer, path), (key, style)
    dense = "o_proj" if sides == "value" else "v_proj"
    assert plan.get(f"layers.*.self_attn.{dense}") in (None, "rowwise" if dense == "o_proj" else "colwise")
    gone = "output_selection" if sides == "value" else "value_selection"
    assert f"layers.*.self_attn.{gone}" not in plan


@pytest.mark.parametrize("sides, modules, parameters", [
    ("value_output", [], ["value_experts", "output_experts"]),
    ("value", ["o_proj"], ["value_experts"]),
    ("output", ["v_proj"], ["output_experts"]),
])
def test_default_lora_targets_follow_the_expert_sides(sides, modules, parameters):
    from switchhead.training.finetune import apply_lora, default_lora_targets

    config = SwitchHeadConfig(**SMALL, attention_expert_projections=sides)
    target_modules, target_parameters = default_lora_targets(config)
    assert [m for m in target_modules if m in ("v_proj", "o_proj")] == modules
    assert target_parameters == parameters
    model = apply_lora(small_model(sides), r=2, init_lora_weights=False)
    lora_names = [name for name, _ in model.named_parameters() if "lora_" in name]
    for name in modules:  # the dense side got LoRA factors
        assert any(f".{name}.lora_A" in n for n in lora_names), name
    assert {m.parameter_name for m in model.modules() if hasattr(m, "parameter_name")} == set(parameters)
    ids = torch.randint(0, 64, (1, 5))
    model.train()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_the_authors_format_refuses_a_variant():
    from switchhead.conversion.authors_format import ConversionError, module_names

    assert "self_attn.value_experts" in module_names(SwitchHeadConfig(**SMALL)).values()
    with pytest.raises(ConversionError, match="attention_expert_projections='output'"):
        module_names(SwitchHeadConfig(**SMALL, attention_expert_projections="output"))
