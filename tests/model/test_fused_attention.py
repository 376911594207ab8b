"""The "switchhead_fused" attention block: q, k, every expert's values and both routers from one GEMM, the value mix
with a recomputing backward, the output one GEMM over H * E * dh. Held to the per-projection path ("eager", itself
held to the naive twin in test_expert_ops.py): outputs, every gradient, router logits, expert dropout, padding, XL
memory and cached decoding; and what its backward keeps (no tensor of every expert's values), under autocast too."""

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead import expert_ops
from switchhead import modeling_switchhead as modeling

TOL = dict(rtol=2e-5, atol=2e-5)


def _config(**overrides) -> SwitchHeadConfig:
    fields = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=8,
                  num_attention_experts=5, num_attention_experts_per_tok=2, intermediate_size=48,
                  max_position_embeddings=64, hidden_dropout=0.0)
    fields.update(overrides)
    return SwitchHeadConfig(**fields)


def _run(model, implementation, seed=3, **inputs):
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same expert-dropout draws for both paths
    out = model(**inputs, labels=inputs["input_ids"], output_router_logits=True, use_cache=False)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_paths_agree(model, **inputs):
    want, want_grads = _run(model, "eager", **inputs)
    got, got_grads = _run(model, "switchhead_fused", **inputs)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    assert len(got.router_logits) == len(want.router_logits) > 0
    for g, w in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(g, w, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"d {n}: {m}")


@pytest.mark.parametrize("positions", ["rope", "xl"])
def test_fused_block_matches_the_per_projection_path(positions):
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_config(position_encoding=positions)).train()
    ids = torch.randint(0, 97, (3, 20))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in one row
    _assert_paths_agree(model, input_ids=ids, attention_mask=mask)


def test_fused_block_matches_with_expert_dropout_in_training():
    torch.manual_seed(1)
    model = SwitchHeadForCausalLM(_config(attention_expert_dropout=0.3)).train()
    _assert_paths_agree(model, input_ids=torch.randint(0, 97, (2, 16)))


def test_fused_block_really_runs_one_input_gemm(monkeypatch):
    # the layer's q, k, value and router projections are not called one by one: one F.linear makes them all
    torch.manual_seed(2)
    model = SwitchHeadForCausalLM(_config()).eval()
    model.set_experts_implementation("switchhead_fused")
    attention = model.model.layers[0].self_attn
    separate = []
    for name in ("q_proj", "k_proj"):
        getattr(attention, name).register_forward_hook(lambda *_, n=name: separate.append(n))
    monkeypatch.setattr(attention, "project_values", lambda *_: separate.append("values"))
    widths = []
    linear = torch.nn.functional.linear

    def recording_linear(inputs, weight, bias=None):
        widths.append(weight.shape[0])
        return linear(inputs, weight, bias)

    monkeypatch.setattr(modeling.F, "linear", recording_linear)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 97, (2, 9)))
    config = model.config
    heads, experts, dh = config.num_attention_heads, config.num_attention_experts, config.head_dim
    assert separate == []
    assert widths.count(2 * heads * dh + heads * experts * dh + 2 * heads * experts) == config.num_hidden_layers


def test_fused_block_matches_with_xl_memory_and_in_cached_decoding():
    torch.manual_seed(4)
    # XL memory: the layer falls back to one projection at a time (queries come from fewer tokens than keys)
    model = SwitchHeadForCausalLM(_config(position_encoding="xl", xl_memory_length=8)).eval()
    first, second = torch.randint(0, 97, (2, 12)), torch.randint(0, 97, (2, 12))
    results = {}
    for implementation in ("eager", "switchhead_fused"):
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            memory = model(input_ids=first, use_cache=False).xl_memory
            results[implementation] = model(input_ids=second, xl_memory=memory, use_cache=False).logits
    torch.testing.assert_close(results["switchhead_fused"], results["eager"], **TOL)
    # decoding with a cache: the same greedy tokens and scores
    model = SwitchHeadForCausalLM(_config()).eval()
    prompt = torch.randint(0, 97, (2, 7))
    generated = {}
    for implementation in ("eager", "switchhead_fused"):
        model.set_experts_implementation(implementation)
        generated[implementation] = model.generate(prompt, max_new_tokens=6, do_sample=False, output_scores=True,
                                                   return_dict_in_generate=True, pad_token_id=0)
    assert torch.equal(generated["switchhead_fused"].sequences, generated["eager"].sequences)
    for got, want in zip(generated["switchhead_fused"].scores, generated["eager"].scores):
        torch.testing.assert_close(got, want, **TOL)


def _saved_numels(attention, hidden, autocast):
    numels = []

    def pack(tensor):
        numels.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out, _ = attention(hidden, position_embeddings=None, attention_mask=None)
    return numels, out


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_fused_backward_keeps_no_tensor_of_every_experts_values(autocast):
    """Every expert's values `[N, H * E * dh]` (E times the values a dense layer keeps) are recomputed in the
    backward, not kept: the per-projection path under autocast keeps them (its custom backwards step aside there),
    the fused one keeps none, in fp32 and under autocast."""
    torch.manual_seed(5)
    config = _config(position_encoding="xl", hidden_size=48, head_dim=12)  # no RoPE: the layer alone
    model = SwitchHeadForCausalLM(config).train()
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(2, 40, config.hidden_size, requires_grad=True)
    every_values = hidden.shape[0] * hidden.shape[1] * config.num_attention_heads * config.num_attention_experts \
        * config.head_dim
    kept = {}
    for implementation in ("eager", "switchhead_fused"):
        model.set_experts_implementation(implementation)
        numels, out = _saved_numels(attention, hidden, autocast)
        kept[implementation] = numels
        out.float().pow(2).sum().backward()  # and the backward runs on what was kept
    assert every_values not in kept["switchhead_fused"]
    if autocast:
        assert every_values in kept["eager"]
        assert sum(kept["switchhead_fused"]) < sum(kept["eager"])


def test_fused_block_under_autocast_is_as_close_to_fp32_as_the_per_projection_path():
    """bf16 rounds in different places on the two paths, so neither equals the other: each gradient of the fused
    block under autocast is as close to the fp32 gradients as the per-projection path's under autocast (a wrong
    gradient would be off by its own size)."""
    torch.manual_seed(6)
    model = SwitchHeadForCausalLM(_config()).train()
    ids = torch.randint(0, 97, (2, 24))
    grads = {}
    for implementation, autocast in (("eager", False), ("eager", True), ("switchhead_fused", True)):
        model.set_experts_implementation(implementation)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads[implementation, autocast] = {n: p.grad.float() for n, p in model.named_parameters()
                                           if p.grad is not None}
    exact = grads["eager", False]
    for name, grad in exact.items():
        def error(path):
            return float((grads[path][name] - grad).norm() / grad.norm().clamp_min(1e-12))

        assert error(("switchhead_fused", True)) <= 1.5 * error(("eager", True)) + 1e-3, name


def test_recomputed_mix_matches_the_plain_mix():
    generator = torch.Generator().manual_seed(7)
    n, heads, experts, dh, d = 6, 3, 4, 5, 7
    inputs = torch.randn(n, d, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(heads * experts * dh, d, generator=generator, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(n, heads, experts, generator=generator, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(n, heads, dh, generator=generator, dtype=torch.float64)

    def plain():
        every = torch.nn.functional.linear(inputs, weight).view(n, heads, experts, dh)
        return (every * gates.unsqueeze(-1)).sum(2)

    def recomputed():
        return expert_ops.mix_values_recomputed(torch.nn.functional.linear(inputs, weight), gates, inputs, weight)

    want, got = plain(), recomputed()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for w, g in zip(torch.autograd.grad(want, (inputs, weight, gates), upstream),
                    torch.autograd.grad(got, (inputs, weight, gates), upstream)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
