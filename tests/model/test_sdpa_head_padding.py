"""Masked sdpa with heads whose width is not a multiple of 8: the attention pads q, k and v with zero columns so that
sdpa's fused CUDA kernels take the call (transformers_compat.sdpa_head_padding). Padding is exact; these tests turn
it on for CPU tensors and hold the padded model to the unpadded one on random inputs."""

from __future__ import annotations

import unittest.mock

import pytest
import torch
import torch.nn.functional as F

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM, transformers_compat
from switchhead.transformers_compat import sdpa_head_padding


def _model(preset: str, head_dim: int, **overrides):
    config = SwitchHeadConfig.from_preset(preset, head_dim=head_dim, hidden_dropout=0.0, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return SwitchHeadForCausalLM(config).eval()


class SdpaWidths:
    """Records the head width of every sdpa call, and whether it had a mask: (width, masked)."""

    def __init__(self):
        self.widths = []
        self._sdpa = F.scaled_dot_product_attention

    def __call__(self, query, key, value, attn_mask=None, *args, **kwargs):
        self.widths.append((query.shape[-1], attn_mask is not None))
        return self._sdpa(query, key, value, attn_mask, *args, **kwargs)


def _run(model, padded: bool, fn):
    devices = ("cpu",) if padded else ()
    spy = SdpaWidths()
    with unittest.mock.patch.object(transformers_compat, "SDPA_PADDED_DEVICES", devices), \
            unittest.mock.patch.object(F, "scaled_dot_product_attention", spy):
        return fn(), spy.widths


def test_padding_is_asked_only_for_masked_sdpa_on_the_listed_devices():
    q = torch.zeros(1, 2, 3, 12)
    with unittest.mock.patch.object(transformers_compat, "SDPA_PADDED_DEVICES", ("cpu",)):
        assert sdpa_head_padding("sdpa", q, masked=True) == 4
        assert sdpa_head_padding("sdpa", torch.zeros(1, 2, 3, 41), masked=True) == 7
        assert sdpa_head_padding("sdpa", torch.zeros(1, 2, 3, 16), masked=True) == 0
        assert sdpa_head_padding("sdpa", q, masked=False) == 0  # flash takes unmasked calls at any width
        assert sdpa_head_padding("eager", q, masked=True) == 0
    assert sdpa_head_padding("sdpa", q, masked=True) == 0  # CPU tensors: not listed by default


@pytest.mark.parametrize("preset, overrides", [("tiny-switchhead", {}), ("tiny-dense", dict(position_encoding="rope",
                                                                                            xl_memory_length=0)),
                                               ("tiny-switchhead-xl", {})])
def test_padded_heads_give_the_unpadded_logits_and_gradients(preset, overrides):
    """Left-padded batch (a mask reaches sdpa), heads of 12: logits and every gradient as without padding."""
    model = _model(preset, 12, **overrides)
    ids = torch.randint(1, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (logits, grads), plain_widths = _run(model, False, step)
    (padded_logits, padded_grads), widths = _run(model, True, step)
    assert set(plain_widths) == {(12, True)} and set(widths) == {(16, True)}  # the padded run padded every call
    torch.testing.assert_close(padded_logits, logits, atol=1e-5, rtol=1e-5)
    assert padded_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(padded_grads[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_padded_heads_decode_the_same_tokens_from_a_static_cache():
    """Greedy decoding through a static cache (whose unwritten positions are masked): the same tokens padded or not,
    and the cache keeps the model's own head width."""
    model = _model("tiny-switchhead", 12)
    prompt = torch.randint(1, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))

    def generate():
        return model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static",
                              pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(prompt))

    tokens, plain_widths = _run(model, False, generate)
    padded_tokens, widths = _run(model, True, generate)
    assert {w for w, masked in plain_widths} == {12}
    assert {w for w, masked in widths if masked} == {16} and {w for w, masked in widths if not masked} <= {12}
    assert torch.equal(padded_tokens, tokens)
