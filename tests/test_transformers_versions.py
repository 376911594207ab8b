"""What the GPU machine's Transformers (5.17, older than the 5.23 pinned here) lacks, and that we must not need.

Found by running `benchmarks/gpu_run.sh smoke` in a virtual environment with transformers==5.17.0: its
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
