"""The contract of vLLM's Transformers backend (`model_impl="transformers"`), checked without vLLM installed; the
native plugin (switchhead.vllm) is tested with vLLM itself in test_vllm.py and test_vllm_serve.py.

vLLM's Transformers backend builds the base model with `AutoModel.from_config`, sets `_attn_implementation` to its
own name registered in `ALL_ATTENTION_FUNCTIONS`, and calls the base model with the packed tokens of a step as one
row: `model(input_ids=[1, T], position_ids=[1, T], use_cache=False, attention_instances={layer: Attention},
return_dict=False)`. Its attention function looks up `attention_instances[module.layer_idx]`, takes `scaling`,
and returns the attended values as `[T, heads * head_dim]` (its own paged KV cache; causal attention per request).

Here a recording attention function with the same signature and return shape stands in for vLLM's: every
attention call of the RoPE variants must go through it, once per layer, with those kwargs, and the model output
must equal the model's own eager forward. XL cannot run there: its relative-position bias is passed as
`position_bias`, which vLLM's attention ignores, so the model refuses such a function instead of running without
the position term.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

NAME = "recording_vllm_like"
CALLS: list[dict] = []


def recording_attention(module, query, key, value, attention_mask, scaling=None, attention_instances=None,
                        **kwargs):
    """Same contract as vLLM's `vllm_flash_attention_forward`: packed row in, `[T, H * dh]` out."""
    CALLS.append(dict(layer_idx=module.layer_idx, scaling=scaling, instance=attention_instances[module.layer_idx],
                      query=tuple(query.shape), key=tuple(key.shape), value=tuple(value.shape),
                      extra=sorted(kwargs)))
    tokens = query.shape[-2]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)  # [1, H, T, dh]
    return out.transpose(1, 2).reshape(tokens, -1), None


@pytest.fixture(autouse=True)
def registered():
    ALL_ATTENTION_FUNCTIONS[NAME] = recording_attention
    ALL_MASK_ATTENTION_FUNCTIONS[NAME] = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    CALLS.clear()
    yield
    del ALL_ATTENTION_FUNCTIONS[NAME]
    del ALL_MASK_ATTENTION_FUNCTIONS[NAME]


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-switchall", "tiny-dense"])
def test_rope_attention_goes_through_the_registered_function(preset):
    assert SwitchHeadForCausalLM._supports_attention_backend
    config = SwitchHeadConfig.from_preset(preset)
    torch.manual_seed(0)
    reference = SwitchHeadForCausalLM(config).eval()
    config = SwitchHeadConfig.from_preset(preset)
    config._attn_implementation = NAME  # what vLLM does before AutoModel.from_config
    base = AutoModel.from_config(config).eval()
    base.load_state_dict(reference.model.state_dict())
    tokens = 11
    input_ids = torch.randint(0, config.vocab_size, (1, tokens))
    instances = {layer: object() for layer in range(config.num_hidden_layers)}
    with torch.no_grad():
        hidden = base(input_ids=input_ids, position_ids=torch.arange(tokens)[None], use_cache=False,
                      attention_instances=instances, return_dict=False)[0][0]
        want = reference.model(input_ids=input_ids, use_cache=False).last_hidden_state[0]
    assert [call["layer_idx"] for call in CALLS] == list(range(config.num_hidden_layers))
    for call in CALLS:
        assert call["instance"] is instances[call["layer_idx"]]
        assert call["scaling"] == pytest.approx(config.head_dim ** -0.5)
        heads = (1, config.num_attention_heads, tokens, config.head_dim)
        assert call["query"] == call["key"] == call["value"] == heads
        assert "position_bias" not in call["extra"]
    torch.testing.assert_close(hidden, want, rtol=1e-5, atol=1e-5)


def _xl_base(name: str):
    config = SwitchHeadConfig.from_preset("tiny-switchhead-xl")
    config._attn_implementation = name
    return AutoModel.from_config(config).eval()


def _packed_call(base):
    with torch.no_grad():
        return base(input_ids=torch.randint(0, base.config.vocab_size, (1, 5)), use_cache=False,
                    attention_instances=dict.fromkeys(range(base.config.num_hidden_layers)), return_dict=False)


def test_xl_under_an_attention_function_that_drops_the_bias_is_refused():
    base = _xl_base(NAME)
    with pytest.raises(ValueError, match=f"position_bias.*{NAME}.*would ignore the positions"):
        _packed_call(base)
    assert not CALLS  # refused before any attention ran: no output without the position term


def test_an_attention_function_marked_as_adding_the_bias_receives_it():
    recording_attention.adds_position_bias = True
    try:
        _packed_call(_xl_base(NAME))
    finally:
        del recording_attention.adds_position_bias
    assert CALLS and all("position_bias" in call["extra"] for call in CALLS)


@pytest.mark.integration
@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flex_attention"])
def test_xl_runs_under_the_implementations_that_add_the_bias(implementation):
    if implementation == "flex_attention":
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
        if not check_cpu_supported():  # torch's own test of the processor; Transformers always compiles flex
            pytest.skip("inductor compiles flex_attention on a CPU only with its AVX2 kernels (not without AVX2, "
                        "nor under ATEN_CPU_CAPABILITY=default)")
    config = SwitchHeadConfig.from_preset("tiny-switchhead-xl")
    ids = torch.randint(0, config.vocab_size, (2, 7))
    torch.manual_seed(0)
    reference = SwitchHeadForCausalLM(config).eval()
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).eval()
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
