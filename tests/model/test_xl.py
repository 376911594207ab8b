"""Transformer-XL attention: the authors' relative-position convention, XL memory, exact cached decoding, backends,
the E = 1 output-gate option, and the XL presets of the paper."""

import math

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.positions import sinusoidal_embedding
from switchhead.transformers_compat import output_cache
from helpers.models import tiny_model
from helpers.padding import left_padded_batch, positions_from_mask

XL_PRESETS = ["tiny-switchhead-xl", "tiny-dense-xl"]


def assert_real_tokens_close(actual, expected, mask, atol):
    """Compare logits `[B, T, V]` only where the token is real (padded rows attend to nothing meaningful)."""
    keep = mask.bool()
    torch.testing.assert_close(actual[keep], expected[keep], atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------ the authors' convention
def test_sinusoidal_embedding_is_the_authors_interleaved_layout():
    positions = torch.tensor([-7.0, -1.0, 0.0, 3.0], dtype=torch.float64)
    dim = 10
    expected = torch.zeros(4, dim, dtype=torch.float64)
    for row, p in enumerate(positions.tolist()):
        for f in range(dim // 2):
            rate = math.exp(-2 * f * math.log(10000.0) / dim)
            expected[row, 2 * f], expected[row, 2 * f + 1] = math.sin(p * rate), math.cos(p * rate)
    torch.testing.assert_close(sinusoidal_embedding(positions, dim, torch.float64), expected, atol=1e-12, rtol=0)


def slow_xl_attention(attention, x, memory=None):
    """PAPER.md section 1 (XL variant) as explicit loops, from the layer's weights only; fp64.

    score[i, j] = (q_i . k_j + q_i . (W_pk PE(j - i))_h) / sqrt(dh) over keys j = memory then current tokens, query i
    at key index M + i, every memory key visible and causal inside the segment. PE is computed here from its
    definition. Values / output: SwitchHead experts with sigmoid top-k gates, or dense projections (optionally with
    the per-head sigmoid output gate).
    """
    batch, length, d = x.shape
    sources = x if memory is None else torch.cat([memory, x], 1)
    offset = sources.shape[1] - length
    heads, dh = attention.num_heads, attention.head_dim
    w_q, w_k = attention.q_proj.weight, attention.k_proj.weight
    w_pk = attention.position_key_proj.weight  # [H*dh, d]
    switchhead = hasattr(attention, "value_experts")

    def encoding(p):
        out = torch.zeros(d, dtype=torch.float64)
        for f in range(d // 2):
            rate = 10000.0 ** (-2 * f / d)
            out[2 * f], out[2 * f + 1] = math.sin(p * rate), math.cos(p * rate)
        return out

    pe = {p: w_pk @ encoding(p) for p in range(-sources.shape[1], 1)}
    y = torch.zeros(batch, length, d, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            rows = slice(h * dh, (h + 1) * dh)
            values = []
            for j in range(sources.shape[1]):
                if switchhead:
                    gate = torch.sigmoid(attention.value_selection.weight @ sources[b, j]).view(heads, -1)[h]
                    v = torch.zeros(dh, dtype=torch.float64)
                    for e in torch.topk(gate, attention.top_k).indices.tolist():
                        v = v + gate[e] * (sources[b, j] @ attention.value_experts[h * gate.numel() + e])
                else:
                    v = attention.v_proj.weight[rows] @ sources[b, j]
                values.append(v)
            for i in range(length):
                q = w_q[rows] @ x[b, i]
                visible = range(offset + i + 1)
                scores = torch.stack([
                    (q @ (w_k[rows] @ sources[b, j]) + q @ pe[j - (offset + i)][rows]) / math.sqrt(dh) for j in visible
                ])
                attended = torch.softmax(scores, 0) @ torch.stack([values[j] for j in visible])
                if switchhead:
                    gate = torch.sigmoid(attention.output_selection.weight @ x[b, i]).view(heads, -1)[h]
                    for e in torch.topk(gate, attention.top_k).indices.tolist():
                        y[b, i] += gate[e] * (attended @ attention.output_experts[h * gate.numel() + e])
                else:
                    if attention.output_gate is not None:
                        attended = attended * torch.sigmoid(attention.output_gate[h] @ x[b, i])
                    y[b, i] += attention.o_proj.weight[:, rows] @ attended
    return y


@pytest.mark.parametrize("preset,overrides", [("tiny-switchhead-xl", {}), ("tiny-dense-xl", {}),
                                              ("tiny-dense-xl", {"attention_output_gate": True})])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_xl_layer_equals_slow_relative_position_loop_fp64(preset, overrides, implementation):
    model = tiny_model(preset, implementation, torch.float64, **overrides).eval()
    attention = model.model.layers[0].self_attn
    torch.manual_seed(5)
    x = torch.randn(2, 5, model.config.hidden_size, dtype=torch.float64)
    memory = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        plain, _ = attention(x, position_embeddings=None, attention_mask=None)
        with_memory, _ = attention(x, position_embeddings=None, attention_mask=None if implementation == "eager" else
                                   _memory_mask(model, x, memory.shape[1]), memory=memory)
        torch.testing.assert_close(plain, slow_xl_attention(attention, x), atol=1e-10, rtol=0)
        torch.testing.assert_close(with_memory, slow_xl_attention(attention, x, memory), atol=1e-10, rtol=0)


def _memory_mask(model, x, memory_length):
    from switchhead.positions import create_xl_memory_mask

    return create_xl_memory_mask(model.config, x, None, memory_length)


# ------------------------------------------------------------------------------------------ cached decoding
@pytest.mark.parametrize("preset", XL_PRESETS + ["tiny-switchhead"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_cached_decoding_equals_full_forward_with_left_padding(preset, implementation):
    model = tiny_model(preset, implementation).eval()
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(9, 5, 7))
    positions = positions_from_mask(mask)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        prompt = 4
        out = model(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=positions[:, :prompt],
                    use_cache=True)
        steps = [out.logits]
        for t in range(prompt, ids.shape[1]):  # one token at a time through the DynamicCache
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=positions[:, t:t + 1],
                        cache=output_cache(out), use_cache=True)
            steps.append(out.logits)
    assert_real_tokens_close(torch.cat(steps, 1), full, mask, atol=1e-5)


@pytest.mark.parametrize("preset", XL_PRESETS)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_three_chunks_through_the_cache_equal_one_pass(preset, implementation):
    model = tiny_model(preset, implementation).eval()
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(12, 8, 11))
    positions = positions_from_mask(mask)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        chunks, cache = [], None
        for start, end in [(0, 5), (5, 7), (7, 12)]:  # chunks of 5, 2 and 5 tokens: q_len > 1 with a cache
            out = model(ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                        cache=cache, use_cache=True)
            cache = output_cache(out)
            chunks.append(out.logits)
    assert_real_tokens_close(torch.cat(chunks, 1), full, mask, atol=1e-5)


def test_xl_generate_with_cache_equals_without():
    model = tiny_model("tiny-switchhead-xl", "sdpa").eval()
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(9, 5, 7))
    common = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, use_cache=True, **common), model.generate(ids, use_cache=False, **common))


# ------------------------------------------------------------------------------------------ backends
@pytest.mark.integration
def test_eager_sdpa_and_flex_agree_on_padding_cache_and_memory(monkeypatch):
    # Transformers runs FlexAttention through torch.compile; the CPU (inductor C++) template of torch 2.13 fails to
    # compile a score_mod that reads a captured bias tensor together with a BlockMask, so here the same integration
    # (its score_mod adding our position bias, its BlockMask) runs with the uncompiled flex_attention. On GPU the
    # compiled path is used unchanged.
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as flex_integration

    def uncompiled(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(flex_integration, "compile_friendly_flex_attention", uncompiled)
    models = {impl: tiny_model("tiny-switchhead-xl", impl, xl_memory_length=6).eval()
              for impl in ("eager", "sdpa", "flex_attention")}
    ids, mask = left_padded_batch(512, lengths=(9, 5, 7))
    positions = positions_from_mask(mask)
    results = {}
    with torch.no_grad():
        for impl, model in models.items():
            full = model(ids, attention_mask=mask, position_ids=positions, use_cache=False)
            # memory from an unpadded segment (padded rows attend to nothing; backends may fill them differently)
            first = model(ids.flip(1).clamp(min=1), use_cache=False)
            follow = model(ids, xl_memory=first.xl_memory, use_cache=False).logits
            prefix = model(ids[:, :6], attention_mask=mask[:, :6], position_ids=positions[:, :6], use_cache=True)
            chunk = model(ids[:, 6:], attention_mask=mask, position_ids=positions[:, 6:],
                          cache=output_cache(prefix), use_cache=True).logits
            results[impl] = (full.logits, follow, chunk)
    for impl in ("sdpa", "flex_attention"):
        for name, reference, other, rows in zip(("full", "memory", "cached"), results["eager"], results[impl],
                                               (mask, torch.ones_like(mask), mask[:, 6:])):
            assert_real_tokens_close(other, reference, rows, atol=1e-5)


# ------------------------------------------------------------------------------------------ XL memory
@pytest.mark.parametrize("preset", XL_PRESETS)
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_segment_with_previous_segment_as_memory_equals_rows_of_the_concatenation(preset, implementation):
    model = tiny_model(preset, implementation, xl_memory_length=6).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        first = model(ids[:, :6], use_cache=False)
        second = model(ids[:, 6:], xl_memory=first.xl_memory, use_cache=False)
        whole = model(ids, use_cache=False)  # memory = the whole previous segment: plain causal over the two
    torch.testing.assert_close(second.logits, whole.logits[:, 6:], atol=1e-5, rtol=0)
    assert len(first.xl_memory) == model.config.num_hidden_layers
    assert all(m.shape == (2, 6, model.config.hidden_size) and not m.requires_grad for m in first.xl_memory)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_memory_shorter_than_segment_follows_the_papers_masking_over_three_segments(implementation):
    """Segments of 6 with a memory of 4: query t of segment s sees the last 4 positions of segment s - 1 (all of
    them, whatever t) and positions <= t of its own segment. One forward over the concatenation with exactly that
    mask must give the same logits as three chained segment forwards."""
    segment, memory = 6, 4
    model = tiny_model("tiny-switchhead-xl", implementation, xl_memory_length=memory).eval()
    ids = torch.randint(0, 512, (2, 3 * segment), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        chained, state = [], None
        for s in range(3):
            out = model(ids[:, s * segment:(s + 1) * segment], xl_memory=state, use_cache=False)
            state = out.xl_memory
            chained.append(out.logits)
        index = torch.arange(3 * segment)
        first_visible = (index // segment) * segment - memory  # segment start minus memory (clamped below by 0)
        visible = (index[None, :] <= index[:, None]) & (index[None, :] >= first_visible[:, None])
        paper_mask = visible[None, None].expand(2, 1, -1, -1)
        whole = model(ids, attention_mask=paper_mask, use_cache=False).logits
    torch.testing.assert_close(torch.cat(chained, 1), whole, atol=1e-5, rtol=0)


def test_memory_with_padding_mask_over_current_tokens_only():
    model = tiny_model("tiny-dense-xl", "sdpa", xl_memory_length=5).eval()
    ids = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        first = model(ids[:, :5], use_cache=False)
        short = model(ids[:, 5:], attention_mask=torch.ones(2, 5, dtype=torch.long), xl_memory=first.xl_memory,
                      use_cache=False).logits
        long = model(ids[:, 5:], attention_mask=torch.ones(2, 10, dtype=torch.long), xl_memory=first.xl_memory,
                     use_cache=False).logits
        # hiding the first memory position changes every query's result: the memory really is attended to
        hidden = torch.ones(2, 10, dtype=torch.long)
        hidden[:, 0] = 0
        masked = model(ids[:, 5:], attention_mask=hidden, xl_memory=first.xl_memory, use_cache=False).logits
    torch.testing.assert_close(short, long, atol=0, rtol=0)
    assert (masked - short).abs().amax(-1).min() > 1e-6


def test_xl_memory_output_presence():
    model = tiny_model("tiny-switchhead-xl", "eager", xl_memory_length=3).eval()
    ids = torch.randint(0, 512, (1, 5))
    with torch.no_grad():
        assert model(ids, use_cache=True).xl_memory is None
        assert model(ids, use_cache=False).xl_memory[0].shape == (1, 3, 64)
        without = tiny_model("tiny-switchhead-xl", "eager").eval()  # xl_memory_length 0
        assert without(ids, use_cache=False).xl_memory is None


@pytest.mark.parametrize("preset,kwargs,message", [
    ("tiny-switchhead", dict(use_cache=False), "position_encoding='xl'"),
    ("tiny-switchhead-xl", dict(use_cache=True), "use_cache=False"),
    ("tiny-switchhead-xl", dict(use_cache=False, layers=1), "list of 2 tensors"),
    ("tiny-switchhead-xl", dict(use_cache=False, batch=3), "batch=1"),
])
def test_unusable_xl_memory_is_rejected_with_a_clear_error(preset, kwargs, message):
    model = tiny_model(preset, "eager").eval()
    memory = [torch.zeros(kwargs.pop("batch", 1), 4, 64)] * kwargs.pop("layers", 2)
    with pytest.raises(ValueError, match=message):
        model(torch.zeros(1, 3, dtype=torch.long), xl_memory=memory, **kwargs)


# ------------------------------------------------------------------------------------------ E = 1 output gate
def test_output_gate_option_is_validated_and_off_in_presets():
    with pytest.raises(ValueError, match="attention_output_gate"):
        SwitchHeadConfig.from_preset("tiny-switchhead", attention_output_gate=True)
    with pytest.raises(ValueError, match="attention_output_gate"):
        SwitchHeadConfig.from_preset("tiny-dense", attention_output_gate="yes")
    assert not any(SwitchHeadConfig.from_preset(name).attention_output_gate for name in SwitchHeadConfig.preset_names())
    gated = tiny_model("tiny-dense", "eager", attention_output_gate=True).eval()
    plain = tiny_model("tiny-dense", "eager").eval()
    extra = sum(p.numel() for p in gated.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == gated.config.num_hidden_layers * gated.config.num_attention_heads * gated.config.hidden_size


# ------------------------------------------------------------------------------------------ paper presets
XL_PARAMETERS = {  # PAPER.md section 4, the authors' code
    "c4-262m-switchhead-xl": 262.37e6, "wt103-262m-switchhead-xl": 262.48e6,
    "c4-47m-switchhead-xl": 47.25e6, "wt103-47m-switchhead-xl": 47.25e6,
    "enwik8-41m-switchhead-xl": 41.21e6,
    "wt103-259m-switchall-xl": 259.48e6, "c4-259m-switchall-xl": 259.48e6, "pes2o-259m-switchall-xl": 259.48e6,
    "wt103-47m-switchall-xl": 46.89e6, "c4-47m-switchall-xl": 46.89e6, "pes2o-47m-switchall-xl": 46.89e6,
}


@pytest.mark.parametrize("preset", sorted(XL_PARAMETERS))
def test_xl_preset_builds_with_the_papers_parameter_count(preset):
    config = SwitchHeadConfig.from_preset(preset)
    assert config.position_encoding == "xl" and config.xl_memory_length == config.max_position_embeddings
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = SwitchHeadForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - XL_PARAMETERS[preset]) / XL_PARAMETERS[preset] < 0.005, count
    assert all(hasattr(layer.self_attn, "position_key_proj") for layer in model.model.layers)
