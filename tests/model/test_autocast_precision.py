"""Every experts implementation keeps eager's precision under autocast (bf16 and fp16) and in 16-bit weights.

Two levels, each against a higher-precision reference and with eager's own error on the same inputs as the yardstick:

- The whole model (benchmarks/autocast_precision.py's variants: both expert sides, value-only, output-only, head
  width 13, k = 1, k = E, more experts, the MLP alone; random and briefly trained weights): the largest logit error
  under CPU autocast against the fp32 logits, with every router held to the experts it chose in fp32 (its gates
  still the autocast run's own scores). Without that, a token whose best experts are nearly tied picks another one
  under autocast and moves a logit by O(1), for whichever name its last bits favour: a property of top-k routing
  shared by every name, not of a formulation. Factor 2: the largest of ~32k logit errors is a noisy statistic;
  formulations whose rounding points are eager's exactly (batched on the output side, the MLP alone) measured
  0.6-1.6 of eager's, while the dense layers every name shares set most of the error.
- One projection alone (SwitchHead's values and output, sigma-MoE's keys and values, k = 1..4, head widths 13, 16,
  64): the relative RMS error against float64 over a whole output, a stable statistic (names with eager's rounding
  points measure 0.95-1.05 of it). Factor 1.25: one more rounding of the result's size to the autocast dtype adds
  an error as large as eager's (1.41 in RMS), which this factor fails; "switchhead_grouped"'s fallback for head
  widths `_grouped_mm` cannot take, the all-experts mix (1.22, with the gates rounded once to the autocast dtype),
  is eager's own formulation for other routing and passes.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from helpers.projection_precision import SIDES, errors_by_name, projection_call
from switchhead.expert_ops import EXPERTS_IMPLEMENTATIONS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import autocast_precision as probe  # noqa: E402

NAMES = list(EXPERTS_IMPLEMENTATIONS)
MODEL_FACTOR = 2.0
PROJECTION_FACTOR = 1.25
SHAPES = [(2, 4, 2, 16), (2, 4, 1, 13), (8, 8, 4, 64), (4, 8, 2, 16)]  # heads, experts per head, k, head width
MODEL_VARIANTS = ["switchall", "value-only", "output-only", "head-width-13", "k=1", "k=E", "E=8/16",
                  "dense-attention"]


@functools.lru_cache(maxsize=None)
def _model_errors(variant: str, weights: str) -> dict:
    model = probe.model_of(variant)
    model.load_state_dict(probe.weights_of(variant, weights, 40))
    return probe.logit_errors(model)


@pytest.mark.parametrize("weights", probe.WEIGHTS)
@pytest.mark.parametrize("variant", MODEL_VARIANTS)
@pytest.mark.parametrize("name", NAMES[1:])
def test_model_logits_under_autocast_are_as_close_to_fp32_as_eagers(name, variant, weights):
    errors = _model_errors(variant, weights)
    for label in probe.DTYPES:
        eager = errors["eager", label, "fixed"]
        assert 0 < eager < 0.2, (label, eager)  # autocast's own rounding, no route flipped
        assert errors[name, label, "fixed"] <= MODEL_FACTOR * eager, (
            f"{name} {label}: largest logit error {errors[name, label, 'fixed']:.4f}, eager's {eager:.4f}")


def test_k_equal_to_e_has_no_route_to_flip_and_matches_eager_as_it_runs():
    """With every expert chosen there is no top-k boundary to cross: the model as it runs (no routes held) is as
    close to fp32 under autocast in every name as in eager."""
    errors = _model_errors("k=E", "random")
    for label in probe.DTYPES:
        eager = errors["eager", label, "free"]
        assert eager == errors["eager", label, "fixed"]
        for name in NAMES[1:]:
            assert errors[name, label, "free"] <= MODEL_FACTOR * eager, (name, label)


# ------------------------------------------------------------------------------------------------ one projection
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"H{h}-E{e}-k{k}-dh{dh}" for h, e, k, dh in SHAPES])
@pytest.mark.parametrize("side", list(SIDES))
def test_one_projection_under_autocast_rounds_as_eager_does(side, shape, dtype):
    errors = errors_by_name(projection_call(side, *shape, dtype), dtype)
    eager = errors["eager"]
    assert 0 < eager < 1e-2
    for name in NAMES[1:]:
        assert errors[name] <= PROJECTION_FACTOR * eager, f"{name}: {errors[name]:.3e}, eager's {eager:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("side", ["output", "mlp_values"])
def test_one_projection_in_16_bit_weights_sums_its_slots_as_eager_does(side, dtype):
    """A model in bf16 / fp16 (no autocast): 64 gated slots summed into one output row (SwitchHead's output over 16
    heads x 4 experts) or 4 (sigma-MoE's values), at sizes where eager runs a matmul (per head, all experts).
    "switchhead_grouped" gates and sums its slots in fp32 and rounds once, as a matmul's accumulator: at most eager's
    error (factor 1; summed slot by slot in the 16-bit dtype it measured 1.14-1.22); the others within 1.25."""
    inputs, index, weight, gates, groups, grouped = projection_call(side, 16, 8, 4, 16, dtype)
    errors = errors_by_name((inputs.to(dtype), index, weight.to(dtype), gates, groups, grouped), None)
    eager = errors["eager"]
    for name in NAMES[1:]:
        factor = 1.0 if name == "switchhead_grouped" else PROJECTION_FACTOR
        assert errors[name] <= factor * eager, f"{name}: {errors[name]:.3e}, eager's {eager:.3e}"
