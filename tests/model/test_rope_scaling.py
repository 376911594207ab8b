"""Scaled RoPE on SwitchHead's partial RoPE: every rope_type of Transformers' ROPE_INIT_FUNCTIONS but "proportional".

Our rotary module is held to Transformers' own (Llama's rotary embedding, built for a head as wide as our rotated
channels): the same cos/sin for every type, dynamic and longrope included, at short and long lengths.
"""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.modeling_switchhead import SwitchHeadRotaryEmbedding, apply_partial_rotary

ORIGINAL = 32  # the context the tiny models "were trained" with
ROPE_CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_options": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                     "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7, 2.0, 2.5],
                 "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0], "original_max_position_embeddings": ORIGINAL},
}


def _config(rope: dict, **overrides) -> SwitchHeadConfig:
    # head_dim 24, half rotated: 12 rotary channels (6 frequencies), 12 passed through
    fields = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=2, head_dim=24,
                  num_attention_experts=4, num_attention_experts_per_tok=2, intermediate_size=64,
                  max_position_embeddings=ORIGINAL, hidden_dropout=0.0, rope_parameters=dict(rope))
    fields.update(overrides)
    return SwitchHeadConfig(**fields)


def _transformers_rotary(config: SwitchHeadConfig) -> LlamaRotaryEmbedding:
    """Transformers' rotary embedding for a head as wide as our rotated channels, with the same rope_parameters."""
    params = {key: value for key, value in config.rope_parameters.items() if key != "partial_rotary_factor"}
    llama = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                        head_dim=config.num_rotary_channels, max_position_embeddings=config.max_position_embeddings,
                        rope_parameters=params)
    return LlamaRotaryEmbedding(llama)


@pytest.mark.parametrize("name", list(ROPE_CASES))
@pytest.mark.parametrize("length", [10, ORIGINAL, 3 * ORIGINAL])
def test_cos_sin_match_transformers_rotary_for_every_type(name, length):
    config = _config(ROPE_CASES[name])
    ours = SwitchHeadRotaryEmbedding(config)
    theirs = _transformers_rotary(config)
    x = torch.zeros(1, dtype=torch.float32)
    positions = torch.arange(length)[None]
    cos, sin = ours(x, positions)
    expected_cos, expected_sin = theirs(x, positions)
    assert cos.shape == (1, length, config.num_rotary_channels) == expected_cos.shape
    torch.testing.assert_close(cos, expected_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, expected_sin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in ROPE_CASES if n != "default"])
def test_scaling_changes_rotated_channels_only(name):
    config = _config(ROPE_CASES[name])
    default = SwitchHeadRotaryEmbedding(_config(ROPE_CASES["default"]))
    scaled = SwitchHeadRotaryEmbedding(config)
    positions = torch.arange(3 * ORIGINAL)[None]
    x = torch.randn(1, 2, 3 * ORIGINAL, config.head_dim)
    plain = apply_partial_rotary(x, *default(x, positions))
    rotated = apply_partial_rotary(x, *scaled(x, positions))
    rotary = config.num_rotary_channels
    torch.testing.assert_close(rotated[..., rotary:], x[..., rotary:], rtol=0, atol=0)  # passed through
    assert not torch.allclose(rotated[..., :rotary], plain[..., :rotary], atol=1e-4)  # scaled


def test_dynamic_follows_the_sequence_as_it_grows():
    config = _config(ROPE_CASES["dynamic"])
    dynamic, default = SwitchHeadRotaryEmbedding(config), SwitchHeadRotaryEmbedding(_config(ROPE_CASES["default"]))
    theirs = _transformers_rotary(config)
    x = torch.zeros(1)
    # up to the original context: the paper's RoPE
    for length in (5, ORIGINAL):
        positions = torch.arange(length)[None]
        torch.testing.assert_close(dynamic(x, positions), default(x, positions), rtol=0, atol=0)
    # decoding one position at a time past it: each step uses the frequencies of its own length
    previous = None
    for position in (ORIGINAL, ORIGINAL + 7, 2 * ORIGINAL, 3 * ORIGINAL):
        step = torch.tensor([[position]])
        cos, sin = dynamic(x, step)
        expected = theirs(x, torch.arange(position + 1)[None])  # Transformers: scaled for length position + 1
        torch.testing.assert_close(cos[0, 0], expected[0][0, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin[0, 0], expected[1][0, -1], rtol=1e-5, atol=1e-5)
        if previous is not None:  # the lowest frequency keeps shrinking as the sequence grows
            assert dynamic_lowest(config, position) < previous
        previous = dynamic_lowest(config, position)


def dynamic_lowest(config, position):
    rotary = SwitchHeadRotaryEmbedding(config)
    angle = torch.atan2(*reversed(rotary(torch.zeros(1), torch.tensor([[position]]))))[0, 0]
    return (angle[rotary.rotary // 2 - 1] / position).item()


def test_longrope_switches_to_long_factors_past_original_context():
    config = _config(ROPE_CASES["longrope"])
    rotary = SwitchHeadRotaryEmbedding(config)
    x = torch.zeros(1)
    short = rotary(x, torch.arange(ORIGINAL)[None])
    long = rotary(x, torch.arange(ORIGINAL + 1)[None])
    assert not torch.allclose(short[0], long[0][:, :ORIGINAL])
    torch.testing.assert_close(rotary(x, torch.arange(4)[None])[0], short[0][:, :4])


@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn"])
def test_rotary_traces_without_graph_breaks(name):
    rotary = SwitchHeadRotaryEmbedding(_config(ROPE_CASES[name]))
    compiled = torch.compile(rotary, fullgraph=True, backend="eager", dynamic=False)
    x = torch.zeros(1)
    for positions in (torch.arange(8)[None], torch.arange(3 * ORIGINAL - 8, 3 * ORIGINAL)[None]):
        for got, want in zip(compiled(x, positions), rotary(x, positions)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_frequency_tables_stay_float32_and_survive_save_and_load(tmp_path):
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(_config(ROPE_CASES["yarn"])).eval()
    table = model.model.rotary_emb.inv_freq.clone()
    ids = torch.randint(0, 97, (1, 3 * ORIGINAL))
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = SwitchHeadForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters["rope_type"] == "yarn"
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, table, rtol=0, atol=0)
    torch.testing.assert_close(loaded(ids).logits, logits, rtol=0, atol=0)
    model.to(torch.bfloat16)  # a cast must not round the frequency table
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, table, rtol=0, atol=0)


def test_yarn_factor_4_at_three_times_the_context_greedy_cache_matches_full_forward():
    """YaRN x4 on a model "trained" for 32 positions, decoding to 96 with the KV cache: every greedy token is the
    argmax of one full forward over the final sequence (no cache), so the cached path scales positions exactly
    as the full pass does."""
    torch.manual_seed(0)
    config = _config(ROPE_CASES["yarn"], max_position_embeddings=4 * ORIGINAL)
    model = SwitchHeadForCausalLM(config).to(torch.float64).eval()
    prompt = torch.randint(3, 97, (1, 8))
    total = 3 * ORIGINAL
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=total - prompt.shape[1],
                         do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    assert out.shape == (1, total)
    with torch.no_grad():
        full = model(out, use_cache=False).logits
    torch.testing.assert_close(out[0, prompt.shape[1]:], full[0, prompt.shape[1] - 1 : -1].argmax(-1), rtol=0, atol=0)
    # and the scaling is really on: the same weights with the paper's RoPE give other logits past the context
    plain = SwitchHeadForCausalLM(_config(ROPE_CASES["default"], max_position_embeddings=4 * ORIGINAL))
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain.to(torch.float64).eval()(out).logits[0, ORIGINAL:], full[0, ORIGINAL:],
                                  atol=1e-6)


def test_legacy_rope_scaling_argument_is_accepted():
    config = SwitchHeadConfig(**{**_config(ROPE_CASES["default"]).to_diff_dict(), "rope_parameters": None,
                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert config.rope_parameters["rope_type"] == "linear" and config.rope_parameters["factor"] == 2.0


INVALID_ROPE = [
    ({"rope_type": "linear"}, "needs 'factor'"),
    ({"rope_type": "yarn", "factor": 0.5}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "high_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}, "must be greater"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 5, "long_factor": [1.0] * 6}, "list of 6 positive numbers"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"rope_type": "proportional"}, "use partial_rotary_factor instead"),
    ({"rope_type": "ntk"}, "must be one of"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25}, "differs from partial_rotary_factor"),
]


@pytest.mark.parametrize("rope,message", INVALID_ROPE, ids=[m for _, m in INVALID_ROPE])
def test_invalid_rope_parameters_say_what_to_change(rope, message):
    with pytest.raises(ValueError, match=message):
        _config(rope)


def test_dynamic_needs_four_rotary_channels():
    with pytest.raises(ValueError, match="at least 4 rotary channels"):
        _config(ROPE_CASES["dynamic"], partial_rotary_factor=0.1)  # 0.1 * 24 -> 2 channels


@pytest.mark.parametrize("name", ["linear", "yarn", "dynamic"])
def test_xl_variant_rejects_rope_scaling(name):
    with pytest.raises(ValueError, match="needs position_encoding='rope'"):
        _config(ROPE_CASES[name], position_encoding="xl")
    config = _config(ROPE_CASES["default"], position_encoding="xl")
    config.rope_parameters = dict(ROPE_CASES[name], rope_theta=10000.0)  # edited after validation
    with pytest.raises(ValueError, match="needs position_encoding='rope'"):
        SwitchHeadForCausalLM(config)
