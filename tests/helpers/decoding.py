"""Decoding helpers shared by the model tests: one tiny model per variant, a cached prefill, a greedy step, and
the host synchronisations a call makes."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from helpers.padding import positions_from_mask
from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

MODEL_VARIANTS = {
    "switchhead-rope": ("tiny-switchhead", {}),
    "switchall-rope": ("tiny-switchall", {}),
    "dense-rope": ("tiny-dense", {}),
    "switchhead-xl": ("tiny-switchhead-xl", {}),
    "switchall-xl": ("tiny-switchall", {"position_encoding": "xl"}),
    "dense-xl": ("tiny-dense-xl", {}),
    "moeut": ("tiny-moeut", {}),  # shared layers, peri-LayerNorm
}


def variant_model(variant: str, seed: int = 0) -> SwitchHeadForCausalLM:
    preset, overrides = MODEL_VARIANTS[variant]
    torch.manual_seed(seed)
    return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset, **overrides)).eval()


def prefill(model, cache, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                     cache=cache, use_cache=True)


def next_step(out, ids, mask):
    token = out.logits[:, -1:].argmax(-1)
    return torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1), token


def host_syncs(fn) -> list[str]:
    """The sync ops (`aten::item` / `aten::_local_scalar_dense`) `fn` runs, each named by its outermost caller op.

    `aten::_grouped_mm`'s CPU kernel reads its group offsets with `item` inside ATen (a read of CPU memory, no
    device sync and no graph break); a sync anywhere inside `aten::_grouped_mm` is reported as "aten::_grouped_mm".
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    found = []
    for event in prof.events():
        if event.name == "aten::item" or (event.name == "aten::_local_scalar_dense" and (
                event.cpu_parent is None or event.cpu_parent.name != "aten::item")):
            outer, names = event, []
            while outer.cpu_parent is not None:
                outer = outer.cpu_parent
                names.append(outer.name)
            found.append("aten::_grouped_mm" if "aten::_grouped_mm" in names else outer.name)
    return found
