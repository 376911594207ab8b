"""What the GPU machine's Transformers (5.17, older than the 5.23 pinned here) lacks, and that we must not need.

Found by running `scripts/gpu/gpu_run.sh smoke` in a virtual environment with transformers==5.17.0: its
`@use_experts_implementation` sets `has_gate`, `has_bias`, `is_transposed` and `is_concatenated`, but not
`has_post_expert_norm` (added later), and our "cvmm" experts function read that flag unconditionally, so every
SwitchAll model failed on its first forward there.
"""

from __future__ import annotations

import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.modeling_switchhead import SigmaMoeMLP


def test_sigma_moe_runs_where_the_experts_decorator_sets_no_post_expert_norm_flag():
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchall")).eval()
    mlps = [m for m in model.modules() if isinstance(m, SigmaMoeMLP)]
    assert mlps
    ids = torch.randint(1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for mlp in mlps:  # as Transformers 5.17's decorator leaves the module (5.23's sets the flag to False)
            if hasattr(mlp, "has_post_expert_norm"):
                del mlp.has_post_expert_norm
            assert not hasattr(mlp, "has_post_expert_norm")
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tp_plan_can_be_assigned_as_older_transformers_do_and_is_never_saved(tmp_path):
    config = SwitchHeadConfig.from_preset("tiny-switchhead", tie_word_embeddings=True)
    computed = dict(config.base_model_tp_plan)
    assert computed["layers.*.self_attn"] == "switchhead_heads"
    # what Transformers 5.17's PreTrainedConfig.__post_init__ does for tied embeddings
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    assert config.base_model_tp_plan == {**computed, "embed_tokens": "embedding_rowwise"}
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.q_proj": "rowwise"}  # override
    assert config.base_model_tp_plan["layers.*.self_attn.q_proj"] == "rowwise"
    assert config.base_model_tp_plan["embed_tokens"] == "embedding_rowwise"
    config.position_encoding = "xl"  # the computed part still follows the configuration
    assert config.base_model_tp_plan["layers.*.self_attn.position_key_proj"] == "colwise"
    config.save_pretrained(tmp_path)
    assert "base_model_tp_plan" not in (tmp_path / "config.json").read_text()
    assert SwitchHeadConfig.from_pretrained(tmp_path).base_model_tp_plan == {
        **computed, "layers.*.self_attn.position_key_proj": "colwise"}
