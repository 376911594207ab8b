"""Every SwitchHeadConfig field against hostile values: NaN, +-inf, 0, negative, wrong types and out-of-range values.

Each trial either raises a ValueError that names the field (or, for a cross-field rule, the other field it
involves), or builds a model whose forward pass is finite. `rope_parameters` is checked in test_config /
the RoPE tests (its validation belongs to the scaled-RoPE work); everything else is enumerated from the class.
"""

import math

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

NAN, INF = float("nan"), float("inf")
GENERIC = [NAN, INF, -INF, 0, -1, 2.5, "x", True, None, [1]]
# values outside the valid range of fields that have one (below-minimum values are in GENERIC)
OUT_OF_RANGE = {
    "pad_token_id": [512, 10**6], "bos_token_id": [512], "eos_token_id": [512, [0, 512]],
    "attention_expert_dropout": [1.0, 1.5], "mlp_expert_dropout": [1.0, 1.5], "attention_dropout": [1.0, 1.5],
    "hidden_dropout": [1.0, 1.5], "partial_rotary_factor": [1.5, 0.01], "num_attention_experts_per_tok": [5],
    "num_mlp_experts_per_tok": [17], "num_attention_experts": [1], "hidden_act": ["tanh"],
    "attention_type": ["moe"], "position_encoding": ["alibi"], "mlp_type": ["moe"], "xl_memory_length": [16],
    "attention_output_gate": [True], "head_dim": [1],
    "attention_expert_projections": ["value_only", "VALUE", "v", "values_outputs"],
}
# a ValueError for these fields may name the other field of the rule it breaks
RELATED = {
    "num_attention_experts": ("num_attention_experts_per_tok",),
    "num_mlp_experts": ("num_mlp_experts_per_tok",),
    "head_dim": ("partial_rotary_factor",),
    "num_attention_heads": ("head_dim",),
    "hidden_size": ("head_dim",),
    "vocab_size": ("pad_token_id", "bos_token_id", "eos_token_id"),
    "partial_rotary_factor": ("partial_rotary_factor",),
    "position_encoding": ("xl_memory_length",),
}
FIELDS = [name for name in SwitchHeadConfig.__annotations__ if name != "rope_parameters"]
BASE = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
            num_attention_experts=4, num_attention_experts_per_tok=2, intermediate_size=128, num_mlp_experts=16,
            mlp_expert_size=16, num_mlp_experts_per_tok=2, max_position_embeddings=128, hidden_dropout=0.0,
            pad_token_id=0, bos_token_id=1, eos_token_id=1)


def trials():
    for name in FIELDS:
        for value in GENERIC + OUT_OF_RANGE.get(name, []):
            yield name, value


TRIALS = list(trials())


def _finite_forward(config: SwitchHeadConfig) -> bool:
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).eval()
    ids = (torch.arange(12) % config.vocab_size)[None]
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return bool(torch.isfinite(out.logits).all()) and math.isfinite(float(out.loss))


def test_the_enumeration_covers_every_field_with_many_hostile_values():
    assert len(FIELDS) >= 35 and {"layer_norm_eps", "init_scale", "pad_token_id", "tie_word_embeddings"} <= set(FIELDS)
    assert len(TRIALS) >= 10 * len(FIELDS)


@pytest.mark.parametrize("name", FIELDS)
def test_every_hostile_value_is_refused_naming_the_field_or_gives_a_finite_model(name):
    refused = accepted = 0
    for field, value in TRIALS:
        if field != name:
            continue
        try:
            config = SwitchHeadConfig(**{**BASE, name: value})
        except ValueError as error:
            names = (name,) + RELATED.get(name, ())
            assert any(n in str(error) for n in names), (name, value, str(error))
            refused += 1
            continue
        except Exception as error:  # noqa: BLE001 - anything but a ValueError is a bug
            pytest.fail(f"{name}={value!r} raised {type(error).__name__}: {error}")
        accepted += 1
        if isinstance(value, float) and not math.isfinite(value):
            pytest.fail(f"{name}={value!r} was accepted")
        assert _finite_forward(config), (name, value)
    assert refused >= 5, (name, refused, accepted)  # NaN, inf, -inf, a string and a list at least


@pytest.mark.parametrize("overrides, field", [
    (dict(layer_norm_eps=NAN), "layer_norm_eps"), (dict(init_scale=INF), "init_scale"),
    (dict(initializer_range=NAN), "initializer_range"), (dict(pad_token_id=-5), "pad_token_id"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings"), (dict(pad_token_id=512), "pad_token_id"),
    (dict(hidden_size=30, num_attention_heads=4, head_dim=None), "head_dim"),
    (dict(attention_expert_projections="value_and_output"), "attention_expert_projections"),
    (dict(attention_type="dense", attention_expert_projections="output"), "attention_expert_projections"),
])
def test_the_reported_cases_are_refused(overrides, field):
    with pytest.raises(ValueError, match=field):
        SwitchHeadConfig(**{**BASE, **overrides})


def test_head_dim_is_derived_only_when_it_divides_exactly():
    assert SwitchHeadConfig(**{**BASE, "hidden_size": 32, "num_attention_heads": 4, "head_dim": None}).head_dim == 8
    with pytest.raises(ValueError, match="not divisible"):
        SwitchHeadConfig(**{**BASE, "hidden_size": 30, "num_attention_heads": 4, "head_dim": None})
    # an explicit head_dim need not divide (the paper's presets: d=412, H=2, dh=76)
    assert SwitchHeadConfig(**{**BASE, "hidden_size": 30, "num_attention_heads": 4, "head_dim": 8}).head_dim == 8


def config_trial_counts() -> tuple[int, int]:
    """(refused, accepted) over every trial; docs/reliability.md quotes these numbers."""
    refused = accepted = 0
    for name, value in TRIALS:
        try:
            SwitchHeadConfig(**{**BASE, name: value})
            accepted += 1
        except ValueError:
            refused += 1
    return refused, accepted
