"""The lean default: "switchhead_auto" training SwitchHead's attention on a GPU runs the lean block of
"switchhead_fused" (and, where the layer does not fuse, `_fused`'s per-head projection). The GPU's rule is tested on
the CPU by naming the CPU a lean device. Held to "eager" (itself held to the naive twin in test_expert_ops.py) in
fp32, to the naive twin by gradcheck in fp64, and to the fused block's bytes kept for the backward under autocast."""

import pytest
import torch

from switchhead import SwitchHeadForCausalLM
from switchhead import expert_ops
from test_fused_attention import _config

TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture
def lean_cpu(monkeypatch):
    monkeypatch.setattr(expert_ops, "LEAN_DEVICES", frozenset({"cpu"}))


def _step(model, implementation, ids, **inputs):
    model.set_experts_implementation(implementation)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    out = model(input_ids=ids, labels=ids, use_cache=False, **inputs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _saved_bytes(model, implementation, ids, autocast=True, **inputs) -> int:
    """Bytes autograd keeps in one training forward, each storage once, parameters left out."""
    model.set_experts_implementation(implementation)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=ids, labels=ids, use_cache=False, **inputs).loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("positions", ["rope", "xl"])
def test_lean_default_matches_eager_in_fp32(lean_cpu, positions):
    torch.manual_seed(0)
    extra = dict(xl_memory_length=6) if positions == "xl" else {}
    model = SwitchHeadForCausalLM(_config(position_encoding=positions, **extra)).train()
    ids = torch.randint(0, 97, (2, 12))
    want, want_grads = _step(model, "eager", ids)
    got, got_grads = _step(model, "switchhead_auto", ids)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"d {n}: {m}")
    if positions == "xl":  # the next segment reads the memory: the layer does not fuse, `_fused`'s projections run
        memory = [m.detach() for m in want.xl_memory]
        want, want_grads = _step(model, "eager", ids, xl_memory=memory)
        got, got_grads = _step(model, "switchhead_auto", ids, xl_memory=memory)
        torch.testing.assert_close(got.logits, want.logits, **TOL)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"d {n}: {m}")


def test_lean_default_keeps_what_the_fused_block_keeps_under_autocast(lean_cpu):
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_config(num_hidden_layers=1)).train()
    ids = torch.randint(0, 97, (2, 24))
    auto, fused, eager = (_saved_bytes(model, name, ids) for name in ("switchhead_auto", "switchhead_fused", "eager"))
    assert auto == fused < eager


def test_cpu_default_keeps_eagers_rule_and_evaluation_is_not_lean(lean_cpu, monkeypatch):
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_config(num_hidden_layers=1)).train()
    ids = torch.randint(0, 97, (2, 24))
    lean = _saved_bytes(model, "switchhead_auto", ids)
    monkeypatch.setattr(expert_ops, "LEAN_DEVICES", frozenset({"cuda"}))
    assert _saved_bytes(model, "switchhead_auto", ids) == _saved_bytes(model, "eager", ids) > lean
    monkeypatch.setattr(expert_ops, "LEAN_DEVICES", frozenset({"cpu"}))
    with torch.no_grad():
        assert not expert_ops.fuses_attention_block("switchhead_auto", ids)
    assert expert_ops.fuses_attention_block("switchhead_auto", ids)
    assert not expert_ops.fuses_attention_block("eager", ids)


@pytest.mark.parametrize("side", ["values", "output"])
def test_lean_default_projection_gradcheck_against_the_naive_twin(lean_cpu, side):
    # the per-head projection the lean default runs where the layer does not fuse (XL memory), in fp64: its
    # gradients checked numerically and its values equal to the naive twin's
    torch.manual_seed(4)
    heads, experts, k, n, d, dh = 2, 3, 2, 5, 4, 3
    index = torch.stack([torch.randperm(experts)[:k] + h * experts for _ in range(n) for h in range(heads)])
    index = index.view(n, heads * k)
    gates = torch.rand(n, heads * k, dtype=torch.float64, requires_grad=True)
    if side == "values":
        inputs = torch.randn(n, 1, d, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(heads * experts, d, dh, dtype=torch.float64, requires_grad=True)
        groups = heads
    else:
        inputs = torch.randn(n, heads, dh, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(heads * experts, dh, d, dtype=torch.float64, requires_grad=True)
        groups = 1

    def lean(x, g, w):
        return expert_ops.expert_projection(x, index, w, g, groups, "switchhead_auto", grouped_routing=True)

    torch.testing.assert_close(lean(inputs, gates, weight), expert_ops.naive(inputs, index, weight, gates, groups))
    assert torch.autograd.gradcheck(lean, (inputs, gates, weight))


def _autocast_step(model, implementation, ids, share, monkeypatch, **inputs):
    monkeypatch.setattr(expert_ops, "SHARE_AUTOCAST_INPUTS", share)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _step(model, implementation, ids, **inputs)
    return out, grads


@pytest.mark.parametrize("implementation", ["switchhead_auto", "eager"])
@pytest.mark.parametrize("positions", ["rope", "xl"])
def test_shared_autocast_copies_change_no_output_or_gradient(lean_cpu, monkeypatch, positions, implementation):
    # one low-precision copy of each attention input for every projection that reads it, against autocast's own
    # copy per projection (the twin): the same logits and gradients bit for bit, fewer bytes kept
    torch.manual_seed(0)
    extra = dict(xl_memory_length=6) if positions == "xl" else {}
    model = SwitchHeadForCausalLM(_config(position_encoding=positions, **extra)).train()
    ids = torch.randint(0, 97, (2, 12))
    inputs = {}
    if positions == "xl":  # a segment reading XL memory: the sources are the memory and the current tokens
        inputs["xl_memory"] = [torch.randn(2, 6, 32) for _ in range(model.config.num_hidden_layers)]
    want, want_grads = _autocast_step(model, implementation, ids, False, monkeypatch, **inputs)
    got, got_grads = _autocast_step(model, implementation, ids, True, monkeypatch, **inputs)
    assert torch.equal(got.logits, want.logits)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    monkeypatch.setattr(expert_ops, "SHARE_AUTOCAST_INPUTS", False)
    separate = _saved_bytes(model, implementation, ids, **inputs)
    monkeypatch.setattr(expert_ops, "SHARE_AUTOCAST_INPUTS", True)
    shared = _saved_bytes(model, implementation, ids, **inputs)
    if (positions, implementation) == ("rope", "switchhead_auto"):  # the fused block: one GEMM, one copy already
        assert shared == separate
    else:
        assert shared < separate


def test_a_shared_autocast_copy_is_made_again_after_an_in_place_change():
    # the copy is keyed by the tensor's memory and its version counter: a reader after an in-place change gets the
    # changed values, never the copy made before it
    from switchhead.expert_ops import autocast_input, shared_autocast_inputs
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), shared_autocast_inputs(x) as shared:
        assert shared.active
        first = autocast_input(x)
        assert autocast_input(x).data_ptr() == first.data_ptr()  # shared while unchanged
        x.add_(1.0)
        torch.testing.assert_close(autocast_input(x), x.to(torch.bfloat16), rtol=0, atol=0)
