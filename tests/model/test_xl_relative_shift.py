"""XL's position term by the relative shift (pad and view) against its reference twin, the gather over distances
(`xl_position_bias_gathered`): the bias on every key a query sees, and whole models' outputs and gradients in
training (with and without XL memory), under autocast, and in cached decoding; and what one attention block runs and
keeps (no `[Tq, Tk]` index, no scatter-add)."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead import positions


def _config(attention="switchhead", **overrides) -> SwitchHeadConfig:
    fields = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=8,
                  num_attention_experts=5, num_attention_experts_per_tok=2, intermediate_size=48,
                  max_position_embeddings=64, hidden_dropout=0.0, position_encoding="xl", xl_memory_length=6,
                  attention_type=attention)
    fields.update(overrides)
    return SwitchHeadConfig(**fields)


@pytest.mark.parametrize("queries,keys", [(1, 1), (1, 9), (5, 5), (5, 12), (7, 30)])
def test_relative_shift_equals_the_gather_where_a_query_sees_the_key(queries, keys):
    torch.manual_seed(0)
    attention = SwitchHeadForCausalLM(_config()).model.layers[0].self_attn
    query = torch.randn(2, 2, queries, 8, dtype=torch.float64)
    attention.double()
    shifted = positions.xl_position_bias(attention, query, keys, keys - queries)
    gathered = positions.xl_position_bias_gathered(attention, query, keys, keys - queries)
    visible = torch.arange(keys)[None, :] <= torch.arange(queries)[:, None] + keys - queries
    assert shifted.shape == gathered.shape == (2, 2, queries, keys)
    torch.testing.assert_close(shifted[..., visible], gathered[..., visible], rtol=1e-12, atol=1e-12)


def _train(model, ids, gathered, monkeypatch, autocast=False, **inputs):
    if gathered:
        monkeypatch.setattr(positions, "xl_position_bias", positions.xl_position_bias_gathered)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, labels=ids, use_cache=False, **inputs)
    out.loss.backward()
    monkeypatch.undo()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("attention", ["switchhead", "dense"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_models_train_as_with_the_gather(monkeypatch, attention, implementation):
    torch.manual_seed(1)
    config = _config(attention)
    config._attn_implementation = implementation
    model = SwitchHeadForCausalLM(config).train()
    ids = torch.randint(0, 97, (2, 10))
    memory = None
    for _ in range(2):  # the first segment without memory, the next with the first's
        extra = {} if memory is None else dict(xl_memory=memory)
        want, want_grads = _train(model, ids, True, monkeypatch, **extra)
        got, got_grads = _train(model, ids, False, monkeypatch, **extra)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        memory = [m.detach() for m in want.xl_memory]
    want, _ = _train(model, ids, True, monkeypatch, autocast=True, xl_memory=memory)
    got, _ = _train(model, ids, False, monkeypatch, autocast=True, xl_memory=memory)
    torch.testing.assert_close(got.logits, want.logits, rtol=2e-2, atol=2e-2)


def test_cached_decoding_as_with_the_gather(monkeypatch):
    torch.manual_seed(2)
    model = SwitchHeadForCausalLM(_config()).eval()
    ids = torch.randint(0, 97, (2, 7))
    got = model.generate(ids, max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    monkeypatch.setattr(positions, "xl_position_bias", positions.xl_position_bias_gathered)
    want = model.generate(ids, max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.scores, want.scores):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_position_term_runs_no_gather_and_keeps_no_index():
    torch.manual_seed(3)
    attention = SwitchHeadForCausalLM(_config()).model.layers[0].self_attn
    query = torch.randn(2, 2, 10, 8, requires_grad=True)
    saved = []
    with _Ops() as ops, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        bias = positions.xl_position_bias(attention, query, 16, 6)
    with _Ops() as backward:
        bias.sum().backward()
    assert "gather" not in ops.ops and "scatter_add" not in backward.ops and "scatter_add_" not in backward.ops
    assert not any(t.dtype == torch.int64 for t in saved)
