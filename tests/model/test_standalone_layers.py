"""Every layer runs alone: built from a config that no model dispatched (`config._experts_implementation` None), it runs
the experts implementation a model gets by default and computes what the same layer computes inside a model."""

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.experts_integration import configured_implementation
from switchhead.expert_ops import default_experts_implementation
from switchhead.modeling_switchhead import (MultiHeadAttention, SigmaMoeMLP, SwitchHeadAttention,
                                            SwitchHeadDecoderLayer)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

CASES = {  # name: (preset overrides, the part of block 0 to take, how to build it alone)
    "switchhead_attention": ({}, "self_attn", lambda c: SwitchHeadAttention(c, 0)),
    "dense_attention": ({"attention_type": "dense"}, "self_attn", lambda c: MultiHeadAttention(c, 0)),
    "sigma_moe_mlp": ({"mlp_type": "sigma_moe"}, "mlp", SigmaMoeMLP),
    "decoder_layer": ({"mlp_type": "sigma_moe"}, "", lambda c: SwitchHeadDecoderLayer(c, 0)),
    "decoder_layer_xl": ({"mlp_type": "sigma_moe", "position_encoding": "xl"}, "",
                         lambda c: SwitchHeadDecoderLayer(c, 0)),
}


def _pair(name):
    """(the part inside a model, the same part built alone with the model's weights, the model)."""
    overrides, path, build = CASES[name]
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=64, **overrides))
    inside = model.model.layers[0].get_submodule(path)
    alone = build(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=64, **overrides))
    alone.load_state_dict(inside.state_dict(), strict=True)
    return inside, alone, model


def _run(module, x, model):
    """The module's output for `x` `[B, T, d]`, given what its model gives it (RoPE's cos/sin)."""
    if isinstance(getattr(module, "_orig_mod", module), SigmaMoeMLP):
        return module(x)
    positions = torch.arange(x.shape[1])[None]
    rotary = model.model.rotary_emb
    embeddings = rotary(x, positions) if rotary is not None else None
    out = module(x, position_embeddings=embeddings, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def test_the_issue_repro_runs():
    cfg = SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=64)
    assert cfg._experts_implementation is None
    layer = SwitchHeadAttention(cfg, 0)
    torch.nn.init.normal_(layer.value_experts, std=0.1)
    torch.nn.init.normal_(layer.output_experts, std=0.1)
    # the routers too: a layer built outside a model is not initialised (as any Transformers module), and a
    # router holding leftover memory could give a non-finite output whatever the implementation
    torch.nn.init.normal_(layer.value_selection.weight, std=0.1)
    torch.nn.init.normal_(layer.output_selection.weight, std=0.1)
    out, _ = layer(torch.randn(1, 4, cfg.hidden_size), None, None)
    assert out.shape == (1, 4, cfg.hidden_size) and torch.isfinite(out).all()


def test_alone_runs_the_default_a_model_gets():
    config = SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=64)
    model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=64))
    assert configured_implementation(config) == model.config._experts_implementation \
        == default_experts_implementation(ALL_EXPERTS_FUNCTIONS)
    assert config._experts_implementation is None  # resolved per call, the config is left as it was


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("training", [False, True])
def test_alone_equals_inside_a_model(name, training):
    inside, alone, model = _pair(name)
    inside.train(training), alone.train(training)
    x = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    torch.manual_seed(1)
    expected = _run(inside, x, model)
    torch.manual_seed(1)
    got = _run(alone, x2, model)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(expected)
    (expected * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, atol=1e-5, rtol=1e-5)
    for (key, a), (_, b) in zip(inside.named_parameters(), alone.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_alone_under_autocast(name):
    inside, alone, model = _pair(name)
    inside.eval(), alone.eval()
    x = torch.randn(2, 5, model.config.hidden_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = _run(inside, x, model), _run(alone, x, model)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_alone_compiles_fullgraph(name):
    """Dynamo traces the layer alone in one graph (nothing logs or breaks it); the inductor run is in test_compile."""
    torch._dynamo.reset()
    _, alone, model = _pair(name)
    alone.eval()
    x = torch.randn(2, 5, model.config.hidden_size)
    compiled = torch.compile(alone, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(_run(compiled, x, model), _run(alone, x, model))


@pytest.mark.integration
def test_alone_compiles_with_inductor():
    torch._dynamo.reset()
    _, alone, model = _pair("decoder_layer")
    alone.train()
    x = torch.randn(2, 5, model.config.hidden_size)
    compiled = torch.compile(alone, fullgraph=True)
    torch.manual_seed(2)
    got = _run(compiled, x, model)
    got.sum().backward()
    alone.eval()
    with torch.no_grad():
        torch.testing.assert_close(_run(torch.compile(alone, fullgraph=True), x, model), _run(alone, x, model),
                                   atol=1e-5, rtol=1e-5)
