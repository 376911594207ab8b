"""Continuous batching (Transformers' `generate_batch` / `init_continuous_batching`, paged KV cache) for every variant.

Greedy tokens must equal `generate()` on each prompt alone, for all tiny presets (RoPE and XL), with prompts of
mixed lengths, also when requests arrive while others are decoding. XL needs its relative bias from the positions
of each request's keys in the paged cache (`paged_key_distances`). The paged cache's bytes per token must be
SwitchHead's real cache size (`switchhead.evaluation.accounting.kv_cache_bytes_per_token`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from switchhead import PRESETS, SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.evaluation.accounting import kv_cache_bytes_per_token
from switchhead.positions import paged_key_distances, xl_paged_attention_mask, xl_position_bias

from helpers.models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_serve import cb_config, resolved_cb_config  # noqa: E402  (across Transformers versions)

TINY = sorted(name for name in PRESETS if name.startswith("tiny"))
LENGTHS = [5, 17, 1, 33, 9, 24]
NEW_TOKENS = 10
CB_CONFIG = dict(num_blocks=16, page_size=32, max_batch_tokens=128)  # small cache: several pages per request


def batching_model(preset: str, attn: str = "sdpa") -> SwitchHeadForCausalLM:
    """No end-of-sequence token (every request generates its full length), padding id 0."""
    return tiny_model(preset, attn, eos_token_id=None, pad_token_id=0, bos_token_id=None).eval()


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def reference(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy_config(new_tokens: int = NEW_TOKENS) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("preset", TINY)
def test_generate_batch_equals_generate(preset):
    model = batching_model(preset)
    inputs = prompts(model.config.vocab_size)
    results = model.generate_batch(inputs=inputs, generation_config=greedy_config(),
                                   continuous_batching_config=cb_config(**CB_CONFIG))
    by_prompt = {tuple(out.prompt_ids): out for out in results.values()}
    assert len(by_prompt) == len(inputs)
    for ids in inputs:
        out = by_prompt[tuple(ids)]
        assert out.error is None, out.error
        assert out.generated_tokens == reference(model, ids), (preset, len(ids))


@pytest.mark.parametrize("preset", ["tiny-switchhead-xl"])
def test_requests_arriving_while_others_decode(preset):
    """Requests join a running batch: some prefill while others decode (mixed packed steps), chunked prompts."""
    model = batching_model(preset)
    inputs = prompts(model.config.vocab_size)
    long_tokens = 24
    manager = model.init_continuous_batching(
        generation_config=greedy_config(long_tokens),
        continuous_batching_config=cb_config(num_blocks=16, page_size=32, max_batch_tokens=16))
    manager.start()
    try:
        first = manager.add_request(inputs[3], request_id="first", max_new_tokens=long_tokens, streaming=True)
        seen = [manager.get_result(first, timeout=60) for _ in range(3)]  # decoding has started
        assert all(result is not None for result in seen)
        later = {f"later-{i}": ids for i, ids in enumerate(inputs[:3] + inputs[4:])}
        for request_id, ids in later.items():
            manager.add_request(ids, request_id=request_id, max_new_tokens=NEW_TOKENS)
        finished = {}
        while len(finished) < len(later) + 1:
            result = manager.get_result(timeout=60)
            assert result is not None, "continuous batching stalled"
            assert result.error is None, result.error
            if result.is_finished():
                finished[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=10)
    assert finished["first"] == reference(model, inputs[3], long_tokens)
    for request_id, ids in later.items():
        assert finished[request_id] == reference(model, ids), request_id


@pytest.mark.parametrize("preset", ["tiny-dense-xl"])
def test_xl_eager_paged(preset):
    """The XL bias is folded into the paged mask, so `paged|eager` applies it too."""
    model = batching_model(preset, attn="eager")
    inputs = prompts(model.config.vocab_size)[:3]
    results = model.generate_batch(inputs=inputs, generation_config=greedy_config(),
                                   continuous_batching_config=cb_config(**CB_CONFIG))
    for out in results.values():
        assert out.generated_tokens == reference(model, out.prompt_ids)


def test_sampling_runs():
    model = batching_model("tiny-switchhead-xl")
    inputs = prompts(model.config.vocab_size)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=True, temperature=1.0, top_k=50, pad_token_id=0,
                              eos_token_id=None)
    results = model.generate_batch(inputs=inputs, generation_config=config,
                                   continuous_batching_config=cb_config(**CB_CONFIG))
    assert len(results) == len(inputs)
    for out in results.values():
        assert out.error is None
        assert len(out.generated_tokens) == NEW_TOKENS
        assert all(0 <= token < model.config.vocab_size for token in out.generated_tokens)


def test_paged_distances_match_positions():
    """Two requests packed: a 2-token step after 3 cached tokens, and a 4-token fresh prefill."""
    kwargs = {"cache": object(), "cu_seq_lens_q": torch.tensor([0, 2, 6]),
              "cu_seq_lens_k": {"full_attention": torch.tensor([0, 5, 9])}}
    distance = paged_key_distances(kwargs, 6, 9, "cpu")
    query_positions = [3, 4, 0, 1, 2, 3]
    key_positions = [0, 1, 2, 3, 4, 0, 1, 2, 3]
    want = torch.tensor([[q - k for k in key_positions] for q in query_positions])
    assert torch.equal(distance, want)
    assert paged_key_distances({"cu_seq_lens_q": torch.tensor([0, 1])}, 1, 1, "cpu") is None  # not a paged call


@pytest.mark.parametrize("preset", ["tiny-switchhead-xl", "tiny-dense-xl"])
def test_xl_paged_mask_equals_per_request_bias_without_host_sync(preset):
    """The packed XL bias (two requests as above) equals `xl_position_bias` of each request alone, and building it
    (distances included) traces as one graph with no host sync in it (no `.item()` / `.tolist()` read of a tensor
    value: torch 2.13 traces those into the graph, so the graph's nodes are checked)."""
    attention = batching_model(preset).model.layers[0].self_attn
    heads, head_dim = attention.num_heads, attention.head_dim
    query = torch.randn(1, heads, 6, head_dim, generator=torch.Generator().manual_seed(0))
    cu_q, cu_k = torch.tensor([0, 2, 6]), torch.tensor([0, 5, 9])
    mask = torch.zeros(1, 1, 6, 9, dtype=torch.bool)
    mask[..., 0:2, 0:4], mask[..., 1, 4] = True, True  # request 0: 3 cached keys + 2 new (causal)
    mask[..., 2:6, 5:9] = torch.ones(4, 4, dtype=torch.bool).tril()  # request 1: a 4-token prefill

    def packed(query, mask, cu_q, cu_k):
        kwargs = {"cache": True, "cu_seq_lens_q": cu_q, "cu_seq_lens_k": {"full_attention": cu_k}}
        return xl_paged_attention_mask(attention, query, mask, paged_key_distances(kwargs, 6, 9, query.device))

    with torch.no_grad():
        bias = packed(query, mask, cu_q, cu_k)
        graphs = []
        compiled = torch.compile(packed, fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm.forward)(
            query, mask, cu_q, cu_k)
        alone = [xl_position_bias(attention, query[:, :, 0:2], 5, query_offset=3),
                 xl_position_bias(attention, query[:, :, 2:6], 4, query_offset=0)]
    torch.testing.assert_close(compiled, bias)
    syncs = [node.format_node() for graph in graphs for node in graph.graph.nodes
             if str(node.target) in ("item", "tolist", "aten._local_scalar_dense.default")]
    assert len(graphs) == 1 and not syncs, syncs
    for (rows, cols), want in zip([(slice(0, 2), slice(0, 5)), (slice(2, 6), slice(5, 9))], alone):
        visible = mask[0, 0, rows, cols]
        got = bias[0, :, rows, cols]
        torch.testing.assert_close(got[:, visible], want[0][:, visible], atol=1e-6, rtol=1e-5)
        assert (got[:, ~visible] == torch.finfo(bias.dtype).min).all()


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-dense", "wt103-45m-switchhead-rope",
                                    "wt103-47m-switchhead-xl", "wt103-47m-dense-xl"])
def test_paged_cache_bytes_are_switchheads(preset):
    """The paged cache holds exactly SwitchHead's per-token K/V bytes (H heads of dh per layer), not a dense model's."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    config = SwitchHeadConfig.from_preset(preset)
    cb = cb_config(num_blocks=4, page_size=16, max_batch_tokens=32)
    cb = resolved_cb_config(config, cb)
    cache = PagedAttentionCache(config, cb, "cpu", DistributedHelper(None, None), dtype=torch.float32)
    allocator = next(iter(cache.cache_allocators.values()))
    per_token = allocator.bytes_per_block // allocator.tokens_per_page  # a block: one page per layer
    assert per_token == kv_cache_bytes_per_token(config, "float32")


def test_same_cache_memory_holds_more_switchhead_tokens():
    """47M XL: SwitchHead's cache per token is about 0.37x the parameter-matched dense model's."""
    switchhead = kv_cache_bytes_per_token(SwitchHeadConfig.from_preset("wt103-47m-switchhead-xl"), "float32")
    dense = kv_cache_bytes_per_token(SwitchHeadConfig.from_preset("wt103-47m-dense-xl"), "float32")
    assert dense / switchhead > 2.5
