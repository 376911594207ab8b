"""`SigmaMoE`: the authors' sigma-MoE feed-forward layer (RobertCsordas/moe_layer, `MoE`) on `SigmaMoeMLP`.

Constructor `(dmodel, n_experts, expert_size, k, ...)`, forward `x -> (output, reg_loss)` with their entropy
regulariser, their initialisation and tensor names (`keys [E, d, S]`, `values [E, S, d]`, `expert_sel [E, d]`).
The routing, the experts and the loss are the model's (`SigmaMoeMLP`, `sigma_moe_entropy_loss`): one code path.
Supported: the paper's setting (sigmoid selection, no biases, output width d_model); other options of theirs are a
ValueError rather than a silently different layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from switchhead.configuration_switchhead import SwitchHeadConfig
from switchhead.expert_ops import lookup
from switchhead.modeling_switchhead import SigmaMoeMLP
from switchhead.routing import sigma_moe_entropy_loss

from .names import use_authors_names

_ACTIVATIONS = {F.relu: "relu", F.gelu: "gelu", F.silu: "silu", torch.relu: "relu"}


class SigmaMoE(nn.Module):
    """y = sum_{e in topk(sigmoid(x W_sel^T))} s_e * act(x keys_e) values_e, and the entropy regulariser of the
    batch's mean selection distribution (sum_e p_e log p_e, p = mean over tokens of softmax(x W_sel^T)).

    Expert dropout (training) zeroes a dropped expert's score before the top-k, as the model's sigma-MoE does; the
    authors' layer sets it to -inf, which selects the same experts with the same gates unless more than
    `n_experts - k` experts of a token are dropped (where theirs gates with -inf).
    """

    def __init__(self, dmodel: int, n_experts: int, expert_size: int, k: int, dropout: float = 0,
                 selection_mode: str = "sigmoid", activation_after_topk: bool = False, activation=F.relu,
                 bias: bool = False, v_dim: int | None = None, sinkhorn_n_iters: int = 3,
                 expert_dropout: float = 0.0, weight_std_scale: float = 1.0, *,
                 experts_implementation: str | None = None):
        super().__init__()
        for name, value in (("dmodel", dmodel), ("n_experts", n_experts), ("expert_size", expert_size), ("k", k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if k > n_experts:
            raise ValueError(f"k={k} exceeds n_experts={n_experts}: each token picks k of the n_experts")
        if selection_mode != "sigmoid":
            raise ValueError(f"selection_mode={selection_mode!r}: only the sigma-MoE's 'sigmoid' is supported")
        if bias:
            raise ValueError("bias=True: the sigma-MoE here has no expert biases")
        if v_dim not in (None, dmodel):
            raise ValueError(f"v_dim={v_dim}: the output width is dmodel={dmodel}")
        if dropout:
            raise ValueError(f"dropout={dropout}: dropout on the experts' hidden units is not supported (use 0)")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: supported are F.relu, F.gelu and F.silu")
        if not 0.0 <= expert_dropout < 1.0:
            raise ValueError(f"expert_dropout must be in [0, 1), got {expert_dropout!r}")
        if experts_implementation is not None and experts_implementation != "eager":
            lookup(experts_implementation)  # a name outside the table: the ValueError that lists it
        # sigmoid is monotone: the top-k of the scores and of the logits agree, so activation_after_topk changes
        # nothing (accepted, as theirs)
        self.k_dim = self.v_dim = dmodel
        self.n_experts, self.expert_size, self.n_heads = n_experts, expert_size, k
        self.expert_dropout = expert_dropout
        self.config = SwitchHeadConfig(vocab_size=1, hidden_size=dmodel, num_hidden_layers=1, mlp_type="sigma_moe",
                                       num_mlp_experts=n_experts, mlp_expert_size=expert_size,
                                       num_mlp_experts_per_tok=k, mlp_expert_dropout=expert_dropout,
                                       hidden_act=_ACTIVATIONS[activation])
        self.config._experts_implementation = experts_implementation  # None: the default a model gets
        self.mlp = SigmaMoeMLP(self.config)
        use_authors_names(self, {"mlp.experts.expert_keys": "keys", "mlp.experts.expert_values": "values",
                                 "mlp.gate.weight": "expert_sel"})
        self.reset_parameters(weight_std_scale)

    @property
    def keys(self) -> torch.Tensor:
        return self.mlp.experts.expert_keys

    @property
    def values(self) -> torch.Tensor:
        return self.mlp.experts.expert_values

    @property
    def expert_sel(self) -> torch.Tensor:
        return self.mlp.gate.weight

    @torch.no_grad()
    def reset_parameters(self, weight_std_scale: float = 1.0) -> None:
        """The authors' initialisation in their order: keys (std dmodel^-1/2), values (std (E * S)^-1/2), the router
        (std dmodel^-1/2, rows brought to one norm with the tensor's std kept), each times weight_std_scale."""
        nn.init.normal_(self.keys, std=self.k_dim ** -0.5 * weight_std_scale)
        nn.init.normal_(self.values, std=(self.n_experts * self.expert_size) ** -0.5 * weight_std_scale)
        nn.init.normal_(self.expert_sel, std=self.k_dim ** -0.5 * weight_std_scale)
        drawn = self.expert_sel.std()
        self.expert_sel.div_(self.expert_sel.norm(dim=1, keepdim=True))
        self.expert_sel.mul_(drawn / self.expert_sel.std())

    def forward(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input `[..., dmodel]` -> (output `[..., dmodel]`, the entropy regulariser, a scalar)."""
        if input.shape[-1] != self.k_dim:
            raise ValueError(f"input has shape {tuple(input.shape)}; expected [..., dmodel={self.k_dim}]")
        logits = F.linear(input.reshape(-1, self.k_dim), self.expert_sel)
        return self.mlp(input), sigma_moe_entropy_loss((logits,))
