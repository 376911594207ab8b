"""Static-cache decoding (eager and compiled) equals the full forward and dynamic-cache generation."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, StaticCache

from helpers.decoding import next_step, prefill, variant_model
from helpers.padding import left_padded_batch, positions_from_mask


@pytest.mark.parametrize("variant", ["switchhead-rope", "switchhead-xl", "switchall-xl", "dense-xl", "moeut"])
def test_static_cache_logits_equal_the_full_forward_with_left_padding(variant):
    model = variant_model(variant)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(6, 3, 5))
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    out = prefill(model, cache, ids, mask)
    steps = [out.logits[:, -1]]
    for _ in range(3):
        ids, mask, token = next_step(out, ids, mask)
        with torch.no_grad():
            out = model(input_ids=token, attention_mask=mask, position_ids=positions_from_mask(mask)[:, -1:],
                        cache=cache, use_cache=True)
        steps.append(out.logits[:, -1])
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    for i, logits in enumerate(steps):  # step i predicts the token after position width - 1 + i
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 4 + i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["switchhead-rope", "switchhead-xl", "switchall-xl", "moeut"])
def test_static_cache_generation_equals_dynamic_cache(variant):
    model = variant_model(variant)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(6, 3, 5))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    dynamic = model.generate(ids, attention_mask=mask, **kwargs)
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", **kwargs)
    torch.testing.assert_close(static, dynamic, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["switchhead-rope", "switchall-xl", "moeut"])
def test_compiled_static_cache_generation(variant):
    model = variant_model(variant)
    assert model._can_compile_fullgraph
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(6, 3, 5))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    eager = model.generate(ids, attention_mask=mask, **kwargs)
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend="aot_eager", dynamic=False)
    config._compile_all_devices = True  # Transformers auto-compiles on accelerators only unless told
    compiled = model.generate(ids, attention_mask=mask, cache_implementation="static", compile_config=config,
                              **kwargs)
    assert hasattr(model, "_compiled_call") and model._compiled_call is not None  # it really compiled
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
