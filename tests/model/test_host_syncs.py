"""No host synchronisation in the expert path, a training step or a decoding step; XL decoding projects only
the distances it needs."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import StaticCache

from switchhead import positions as position_ops
from switchhead.transformers_compat import output_cache

from helpers.cvmm_cases import every_projection, random_case
from helpers.decoding import MODEL_VARIANTS, host_syncs, next_step, prefill, variant_model
from helpers.padding import left_padded_batch, positions_from_mask


def modeling_sinusoidal(count, dim):
    from switchhead.positions import past_sinusoidal_encoding, sinusoidal_embedding

    direct = sinusoidal_embedding(-torch.arange(count), dim)
    cached = past_sinusoidal_encoding(count, dim, torch.float32, torch.device("cpu"))
    assert torch.equal(cached, direct)  # the cached table is the same function, row for row
    assert torch.equal(past_sinusoidal_encoding(count + 700, dim, torch.float32, torch.device("cpu"))[:count], direct)
    return direct


def test_sync_counter_sees_a_sync():
    assert host_syncs(lambda: torch.tensor([1.0]).item()) == ["aten::item"]  # the counter below is not blind


@pytest.mark.parametrize("name", sorted(every_projection()))
def test_no_host_sync_forward_and_backward(name):
    project = every_projection()[name]
    case = random_case(torch.Generator().manual_seed(1), "value", tokens=700, heads=2, experts=5, k=2, d_in=8,
                       d_out=4, dtype=torch.float32)

    def run():
        out = project(*case.args())
        torch.autograd.grad(out.sum(), case.leaves())

    syncs = host_syncs(run)
    assert all(name == "aten::_grouped_mm" for name in syncs), syncs  # none from our code
    decode = random_case(torch.Generator().manual_seed(2), "output", tokens=8, heads=2, experts=5, k=2, d_in=8,
                         d_out=4, dtype=torch.float32)
    decode_syncs = host_syncs(lambda: project(*decode.args()))
    assert decode_syncs == [] or name in ("switchhead_grouped", "_grouped"), decode_syncs


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("variant", sorted(MODEL_VARIANTS))
def test_no_host_sync_in_a_decoding_step(variant, cache_kind):
    model = variant_model(variant)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(6, 3, 5))
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2) if cache_kind == "static" else None
    out = prefill(model, cache, ids, mask)
    ids, mask, token = next_step(out, ids, mask)
    positions = positions_from_mask(mask)[:, -1:]

    def step():
        with torch.no_grad():
            model(input_ids=token, attention_mask=mask, position_ids=positions, cache=output_cache(out),
                  use_cache=True)

    syncs = host_syncs(step)
    if cache_kind == "static":
        assert syncs == []
    else:
        # Transformers' own mask helper asks once per forward, in eager mode with a growing (non-compilable) cache,
        # whether the padding mask is all ones (`_ignore_causal_mask_sdpa`, as for Llama or Mixtral); nothing else
        assert len(syncs) <= 1 and _sync_callers(step) <= {"_ignore_causal_mask_sdpa"}, syncs


def _sync_callers(fn) -> set[str]:
    """The innermost Python function of every sync `fn` runs (profiler stacks)."""
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        fn()
    callers = set()
    for event in prof.events():
        if event.name == "aten::item":
            parent = event
            while parent is not None and not parent.name.endswith(".py)") and "): " not in parent.name:
                parent = parent.cpu_parent
            callers.add(parent.name.rsplit(": ", 1)[-1] if parent is not None else "?")
    return callers


def test_xl_decoding_does_not_project_every_distance():
    model = variant_model("switchhead-xl")
    calls = []
    for layer in model.model.layers:
        layer.self_attn.position_key_proj.register_forward_hook(lambda *args: calls.append(1))
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(6, 3, 5))
    out = prefill(model, None, ids, mask)
    assert len(calls) == model.config.num_hidden_layers  # the prompt (many queries) projects the distances
    ids, mask, token = next_step(out, ids, mask)
    with torch.no_grad():
        model(input_ids=token, attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:],
              cache=output_cache(out), use_cache=True)
    assert len(calls) == model.config.num_hidden_layers  # a decoding step projects its queries instead
    # both orders of the product give the same bias
    attention = model.model.layers[0].self_attn
    query = torch.randn(1, attention.num_heads, 1, attention.head_dim)
    with torch.no_grad():
        few = position_ops.xl_distance_scores(attention, query, 40)
        many = torch.einsum("bhqd,khd->bhqk", query, attention.position_key_proj(
            modeling_sinusoidal(40, model.config.hidden_size)).view(40, attention.num_heads, -1)) * attention.scaling
    torch.testing.assert_close(few, many, rtol=1e-5, atol=1e-6)
