"""SwitchHeadConfig: validation, presets, parameter counts of the paper's configurations, serialisation."""

import pytest
import torch

from switchhead import PRESETS, SwitchHeadConfig, SwitchHeadForCausalLM

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
            num_attention_experts=4, num_attention_experts_per_tok=2, intermediate_size=64)

# (overrides on TINY, the field name the error must mention)
INVALID = [
    (dict(num_attention_experts_per_tok=5), "num_attention_experts_per_tok"),  # k > E
    (dict(num_attention_experts=0), "num_attention_experts"),
    (dict(num_attention_heads=0), "num_attention_heads"),
    (dict(hidden_size=-8), "hidden_size"),
    (dict(head_dim=0), "head_dim"),
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(intermediate_size=0), "intermediate_size"),
    (dict(attention_type="linear"), "attention_type"),
    (dict(position_encoding="alibi"), "position_encoding"),
    (dict(mlp_type="swiglu"), "mlp_type"),
    (dict(attention_dropout=-0.1), "attention_dropout"),
    (dict(hidden_dropout=1.0), "hidden_dropout"),
    (dict(attention_expert_dropout=-0.5), "attention_expert_dropout"),
    (dict(mlp_expert_dropout=2.0), "mlp_expert_dropout"),
    (dict(mlp_type="sigma_moe", num_mlp_experts=4, num_mlp_experts_per_tok=8), "num_mlp_experts_per_tok"),
    (dict(mlp_expert_size=0), "mlp_expert_size"),
    (dict(partial_rotary_factor=0.0), "partial_rotary_factor"),
    (dict(partial_rotary_factor=0.1), "partial_rotary_factor"),  # 0.1 * 8 = 0 rotary channels
    (dict(xl_memory_length=16), "xl_memory_length"),  # memory without XL positions
    (dict(xl_memory_length=-1, position_encoding="xl"), "xl_memory_length"),
    (dict(layer_norm_eps=0.0), "layer_norm_eps"),
    (dict(init_scale=-1.0), "init_scale"),
    (dict(entropy_reg_coef=-0.01), "entropy_reg_coef"),
    (dict(hidden_act="tanhshrink"), "hidden_act"),
    (dict(num_attention_heads="2"), "num_attention_heads"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), "rope_theta"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}), "rope_theta"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}), "rope_theta"),
    (dict(rope_theta=float("nan")), "rope_theta"),
]


def test_invalid_config_table_is_large_enough():
    assert len(INVALID) >= 15


@pytest.mark.parametrize("overrides,field", INVALID, ids=[f for _, f in INVALID])
def test_invalid_config_raises_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        SwitchHeadConfig(**{**TINY, **overrides})


def test_k_greater_than_e_message_says_what_to_change():
    with pytest.raises(ValueError) as error:
        SwitchHeadConfig(**{**TINY, "num_attention_experts_per_tok": 5})
    assert "num_attention_experts_per_tok (5) must be <= num_attention_experts (4)" in str(error.value)


def test_defaults_fill_head_dim_and_init_scale():
    config = SwitchHeadConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=8)
    assert config.head_dim == 16
    assert config.init_scale == pytest.approx((2 / 8) ** 0.5)
    assert config.num_rotary_channels == 8


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="unknown preset 'nope'.*tiny-switchhead"):
        SwitchHeadConfig.from_preset("nope")


def test_preset_overrides_apply_and_validate():
    config = SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=100)
    assert config.vocab_size == 100 and config.attention_type == "switchhead"
    with pytest.raises(ValueError, match="num_attention_experts_per_tok"):
        SwitchHeadConfig.from_preset("tiny-switchhead", num_attention_experts_per_tok=9)


def test_config_round_trips_through_json(tmp_path):
    config = SwitchHeadConfig.from_preset("wt103-47m-switchall-xl")
    config.save_pretrained(tmp_path)
    loaded = SwitchHeadConfig.from_pretrained(tmp_path)
    for field in ("hidden_size", "num_attention_experts", "num_attention_experts_per_tok", "mlp_type",
                  "num_mlp_experts", "mlp_expert_size", "position_encoding", "xl_memory_length", "init_scale",
                  "rope_parameters", "entropy_reg_coef"):
        assert getattr(loaded, field) == getattr(config, field), field
    assert loaded.to_dict()["model_type"] == "switchhead"


def _parameter_count(preset: str) -> int:
    with torch.device("meta"):
        model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset))
    return sum(p.numel() for p in model.parameters())


# PAPER.md section 4: parameter counts of the authors' code for these configurations.
PAPER_PARAMETERS = {
    "c4-262m-switchhead-xl": 262.37e6,
    "wt103-262m-switchhead-xl": 262.48e6,
    "wt103-47m-switchhead-xl": 47.25e6,
    "c4-47m-switchhead-xl": 47.25e6,
    "enwik8-41m-switchhead-xl": 41.21e6,
    "wt103-243m-switchhead-rope": 243.35e6,
    "wt103-45m-switchhead-rope": 44.51e6,
    "wt103-259m-switchall-xl": 259.48e6,
    "c4-259m-switchall-xl": 259.48e6,
    "wt103-47m-switchall-xl": 46.89e6,
    # the dense baselines are parameter-matched to the SwitchHead models of the same size
    "wt103-47m-dense-xl": 47.25e6,
    "c4-262m-dense-xl": 262.37e6,
    "enwik8-41m-dense-xl": 41.21e6,
}


@pytest.mark.parametrize("preset", sorted(PAPER_PARAMETERS))
def test_paper_preset_parameter_count_matches_paper(preset):
    count = _parameter_count(preset)
    assert abs(count - PAPER_PARAMETERS[preset]) / PAPER_PARAMETERS[preset] < 0.005, count


def test_every_preset_builds():
    for name in PRESETS:
        config = SwitchHeadConfig.from_preset(name)
        assert config.model_type == "switchhead"
        assert _parameter_count(name) > 0
