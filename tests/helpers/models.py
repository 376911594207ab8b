"""Tiny models of the presets and their logits, shared by the tests (not a test module)."""

from __future__ import annotations

import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM


def tiny_model(preset: str, attn_implementation: str | None = None, dtype: torch.dtype | None = None,
               **overrides) -> SwitchHeadForCausalLM:
    """The preset's model (config fields overridden by `overrides`) from seed 0, in train mode as built."""
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset(preset, **overrides)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model = SwitchHeadForCausalLM(config)
    return model if dtype is None else model.to(dtype)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for `ids` in eval mode, without a cache and without gradients."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits
