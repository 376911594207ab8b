"""The mixture-of-experts parts of SwitchHead and SwitchAll outside attention: the sigma-gated top-k router (used by
SwitchHead's value and output sides and by the sigma-MoE MLP), the feed-forward blocks (the paper's dense MLP and
SwitchAll's sigma-MoE), and the sigma-MoE's entropy regulariser.

Part of the Hub-ready model: it imports only torch, transformers and its sibling files.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .transformers_compat import incompatible_release  # first: it checks the installed Transformers release

try:
    from transformers.integrations.moe import use_experts_implementation
except ImportError as error:  # a release too old (or too new) for this file: say which to install
    raise incompatible_release(error) from error

from .configuration_switchhead import SwitchHeadConfig
from .expert_ops import EXPERTS_IMPLEMENTATIONS, relu
from .experts_integration import local_routes


# ========================================================================================== routers
class ExpertSelection(nn.Module):
    """Sigma-gated top-k routing: `scores = sigmoid(x W^T)` in float32, top-k within each group of experts.

    Groups are attention heads (head h chooses among its own experts) or the single group of a
    sigma-MoE MLP. Gates are the raw sigmoid scores (no renormalisation) and receive gradients.

    Expert dropout (training only) either excludes a score from the top-k but keeps its value as the
    gate (`drop_to_zero=False`, SwitchHead) or zeroes it before the top-k (`drop_to_zero=True`,
    sigma-MoE).
    """

    def __init__(self, hidden_size: int, num_groups: int, num_experts: int, top_k: int, expert_dropout: float,
                 drop_to_zero: bool):
        super().__init__()
        self.num_groups, self.num_experts, self.top_k = num_groups, num_experts, top_k
        self.expert_dropout, self.drop_to_zero = expert_dropout, drop_to_zero
        self.weight = nn.Parameter(torch.empty(num_groups * num_experts, hidden_size))
        self.register_buffer("group_offsets", torch.arange(num_groups) * num_experts, persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states `[N, d]` -> (logits `[N, G*E]` float32, gates `[N, G*k]`, global expert index `[N, G*k]`)."""
        logits, gates, index = self.select(F.linear(hidden_states, self.weight))
        index = index + self.group_offsets.unsqueeze(-1)  # group g's experts are g * E .. g * E + E - 1
        return logits, gates.flatten(1), index.flatten(1)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routing of given logits `[N, groups * E]` (any number of groups, each choosing among its own E
        experts) -> (logits in at least float32, gates `[N, groups, k]`, index within the group `[N, groups, k]`)."""
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32, as in the paper
        scores = torch.sigmoid(logits).view(-1, logits.shape[-1] // self.num_experts, self.num_experts)
        if not (self.training and self.expert_dropout > 0):
            gates, index = scores.topk(self.top_k, dim=-1, sorted=False)  # the top-k values are the gates
            return logits, gates, index
        dropped = torch.rand_like(scores) < self.expert_dropout
        ranked = scores.masked_fill(dropped, 0.0 if self.drop_to_zero else float("-inf"))
        if self.drop_to_zero:
            scores = ranked
        _, index = ranked.topk(self.top_k, dim=-1, sorted=False)
        return logits, scores.gather(-1, index), index


# ============================================================================================= MLPs
class SwitchHeadMLP(nn.Module):
    """The paper's dense feed-forward block: Linear (bias) -> ReLU -> Linear (bias)."""

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = _ACTIVATIONS[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(hidden_states)))


@use_experts_implementation(has_gate=False, is_transposed=True, has_bias=False)
class SigmaMoeExperts(nn.Module):
    """The sigma-MoE experts as a Transformers experts module: `act(x keys_e) values_e`, gated and summed.

    `config._experts_implementation` picks how they run (`from_pretrained(..., experts_implementation=...)`,
    `model.set_experts_implementation(...)`): "eager" is this forward (the "eager" entry of
    `expert_ops.EXPERTS_IMPLEMENTATIONS`), any other name the function Transformers registered under it: "cvmm",
    "switchhead_batched", "switchhead_grouped" the same entries of that table as SwitchHead attention runs
    (`experts_integration.py`), "batched_mm" / "grouped_mm" Transformers' own (with dense attention only: SwitchHead
    attention has no such function). The flags say what those functions need to know: no gated (GLU) projection, no
    biases, and weights stored `[experts, in, out]` (is_transposed): `expert_keys` `[E, d, S]` is their up projection,
    `expert_values` `[E, S, d]` their down projection. Checkpoints name them `mlp.keys` / `mlp.values`, as every
    release has (`checkpoint_format.py`).

    Under expert parallelism (`base_model_ep_plan`) the module holds `num_experts` local experts, and a route to another
    process's expert arrives as the id `num_experts` with gate 0 (Transformers' sentinel): it adds nothing and receives
    no gradient.
    """

    is_transposed = True  # expert_keys [E, d, S] and expert_values [E, S, d] are [experts, in, out]

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        d, experts, size = config.hidden_size, config.num_mlp_experts, config.mlp_expert_size
        self.num_experts = experts
        self.expert_keys = nn.Parameter(torch.empty(experts, d, size))  # [E, d, S]
        self.expert_values = nn.Parameter(torch.empty(experts, size, d))  # [E, S, d]
        self.act_fn = _ACTIVATIONS[config.hidden_act]

    @property
    def up_proj(self) -> torch.Tensor:  # the name Transformers' experts functions read
        return self.expert_keys

    @property
    def down_proj(self) -> torch.Tensor:
        return self.expert_values

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """hidden_states `[N, d]`, top_k_index `[N, k]` (experts), top_k_weights `[N, k]` (gates) -> `[N, d]`."""
        index, weights = local_routes(self, top_k_index.long(), top_k_weights)  # expert parallelism's sentinels
        eager = EXPERTS_IMPLEMENTATIONS["eager"]
        inner = self.act_fn(eager(hidden_states.unsqueeze(1), index, self.expert_keys, None, 1))
        return eager(inner, index, self.expert_values, weights, 1).view(hidden_states.shape)


class SigmaMoeMLP(nn.Module):
    """SwitchAll's sigma-MoE: y = sum_{e in topk(s)} s_e * act(x keys_e) values_e, s = sigmoid(x W_sel^T).

    The router (`gate`, an `ExpertSelection`) picks each token's experts; the experts (`experts`, a
    `SigmaMoeExperts`) run them, as in Transformers' MoE blocks (Mixtral's `gate` / `experts`), which is the
    structure its tensor- and expert-parallel styles expect. Checkpoints keep the names `mlp.keys`,
    `mlp.values` and `mlp.expert_selection.weight` (`checkpoint_format.py`).
    """

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        self.top_k = config.num_mlp_experts_per_tok
        # experts first: their weights are drawn before the router's (`_init_weights` visits children in order)
        self.experts = SigmaMoeExperts(config)
        self.gate = ExpertSelection(config.hidden_size, 1, config.num_mlp_experts, self.top_k,
                                    config.mlp_expert_dropout, True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `[..., d]` -> `[..., d]`."""
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])  # [N, d]
        _, gates, index = self.gate(tokens)  # [N, k] each
        return self.experts(tokens, index, gates).view(shape)


_ACTIVATIONS = {"relu": relu, "gelu": F.gelu, "silu": F.silu}
MLP_CLASSES = {"dense": SwitchHeadMLP, "sigma_moe": SigmaMoeMLP}


def sigma_moe_entropy_loss(
    mlp_router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The sigma-MoE regulariser: sum over layers of sum_e p_e log p_e, p = mean over tokens of softmax(logits).

    Minimising it maximises the entropy of the batch's average expert distribution (balanced usage).
    Padding tokens (attention_mask == 0) are left out of the mean.
    """
    total = 0.0
    for logits in mlp_router_logits:
        log_probs = F.log_softmax(logits.float(), dim=-1)  # [N, E]
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.numel() == logits.shape[0]:
            # padding drops out of the mean by masking, not indexing: no data-dependent shape (torch.compile)
            keep = attention_mask.reshape(-1, 1).bool().to(log_probs.device)
            count = keep.sum().clamp(min=1).to(log_probs.dtype)
            log_mean = torch.logsumexp(log_probs.masked_fill(~keep, float("-inf")), dim=0) - count.log()
        else:
            log_mean = torch.logsumexp(log_probs, dim=0) - math.log(max(log_probs.shape[0], 1))
        total = total + (log_mean.exp() * log_mean).sum()
    return torch.as_tensor(total, dtype=torch.float32)
