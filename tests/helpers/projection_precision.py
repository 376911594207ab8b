"""One expert projection as SwitchHead and SwitchAll call it under autocast, and each experts implementation's error
on it against float64: shared by tests/model/test_autocast_precision.py and, for the Triton kernels,
tests/kernels/cvmm_interpret_suite.py (not a test module)."""

from __future__ import annotations

import torch

from switchhead.expert_ops import EXPERTS_IMPLEMENTATIONS, expert_projection, naive

NAMES = list(EXPERTS_IMPLEMENTATIONS)
SIDES = {  # R rows, out groups, d_in, d_out from (d, dh), grouped routing, the inputs' dtype under autocast
    "values": (lambda heads, k: 1, lambda heads: heads, True, torch.float32),  # LayerNorm's output: fp32
    "output": (lambda heads, k: heads, lambda heads: 1, True, None),  # attention's output: the autocast dtype
    "mlp_keys": (lambda heads, k: 1, None, False, torch.float32),
    "mlp_values": (lambda heads, k: k, lambda heads: 1, False, None),  # the activation of a 16-bit GEMM
}


def projection_call(side: str, heads: int, experts: int, k: int, dh: int, dtype: torch.dtype, tokens: int = 64,
                    d: int = 64) -> tuple:
    """(inputs, expert_index, weight, gates, out_groups, grouped_routing) of one side's call, seed 0: inputs in the
    dtype they have there under autocast in `dtype` (fp32 after a LayerNorm, else the autocast dtype)."""
    rows_of, groups_of, grouped, in_dtype = SIDES[side]
    generator = torch.Generator().manual_seed(0)
    if grouped:  # head h picks k of its own E experts
        choice = torch.rand(tokens, heads, experts, generator=generator).topk(k, -1).indices
        index = (choice + torch.arange(heads).view(1, heads, 1) * experts).view(tokens, heads * k)
        count = heads * experts
    else:  # one group of heads * E experts
        index = torch.rand(tokens, heads * experts, generator=generator).topk(k, -1).indices
        count = heads * experts
        heads = 1
    rows = rows_of(heads, k)
    d_in, d_out = (d, dh) if side in ("values", "mlp_keys") else (dh, d)
    inputs = torch.randn(tokens, rows, d_in, generator=generator).to(in_dtype or dtype)
    weight = torch.randn(count, d_in, d_out, generator=generator) / d_in**0.5
    gates = torch.rand(index.shape, generator=generator) if groups_of else None
    return inputs, index, weight, gates, groups_of(heads) if groups_of else 1, grouped


def relative_rms(out: torch.Tensor, reference: torch.Tensor) -> float:
    """|out - reference| / |reference| over the whole tensor (a stable statistic, unlike the largest error)."""
    return ((out.double() - reference).norm() / reference.norm()).item()


def errors_by_name(call: tuple, autocast_dtype: torch.dtype | None, names=NAMES) -> dict[str, float]:
    """{name: `relative_rms` of the call's result against float64 `naive`}, under autocast in `autocast_dtype` (None:
    without autocast)."""
    inputs, index, weight, gates, groups, grouped = call
    reference = naive(inputs.double(), index, weight.double(), None if gates is None else gates.double(), groups)
    errors = {}
    for name in names:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = expert_projection(inputs, index, weight, gates, groups, name, grouped)
        errors[name] = relative_rms(out, reference)
    return errors
