"""SwitchHead for any Transformer: the authors' drop-in layers (`SwitchHeadRope`, `SwitchHeadXL`, `SigmaMoE`,
`AttentionMask`), run by this package's layers and expert projections.

Same constructor arguments, forward, initialisation and parameter names as the authors' `switchhead` package and
sigma-MoE layer, so their state dicts load strictly; the differences (an exact KV cache, `experts_implementation=`,
torch.compile and export) are listed in docs/own-model.md.
"""

from .attention import AttentionMask, KVCache, SwitchHeadRope, SwitchHeadXL
from .sigma_moe import SigmaMoE

__all__ = ["AttentionMask", "KVCache", "SigmaMoE", "SwitchHeadRope", "SwitchHeadXL"]
