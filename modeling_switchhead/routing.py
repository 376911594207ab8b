"""Routing: the sigma-gated top-k router of SwitchHead's value and output sides and of SwitchAll's sigma-MoE MLP, and
the sigma-MoE's entropy regulariser over its routers' logits.

Part of the Hub-ready model: it imports only torch.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, hidden_states: torch.Tensor, logits: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states `[N, d]` -> (logits `[N, G*E]` float32, gates `[N, G*k]`, global expert index `[N, G*k]`).
        `logits`: `F.linear(hidden_states, self.weight)` where the caller made it already (in a fused GEMM)."""
        logits, gates, index = self.select(F.linear(hidden_states, self.weight) if logits is None else logits)
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


def mlp_router_logits(router_logits: tuple[torch.Tensor, ...], config) -> tuple[torch.Tensor, ...]:
    """The sigma-MoE routers' logits among a model's recorded ones (each block records its attention routers, then
    the MLP's: `config.routers_per_layer` per block); () when the MLP is dense."""
    if config.mlp_type != "sigma_moe" or not router_logits:
        return ()
    return tuple(router_logits[config.routers_per_layer - 1 :: config.routers_per_layer])


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


# ============================================================== MoEUT: the group-wide entropy regulariser
def regularised(config) -> bool:
    """Whether training adds an entropy regulariser to the loss."""
    mlp = config.mlp_type == "sigma_moe" and config.entropy_reg_coef > 0
    return mlp or (getattr(config, "entropy_reg_scope", "layer") == "group" and config.attention_entropy_reg_coef > 0)


def _sequence_entropy_term(logits: list[torch.Tensor], batch: int, num_experts: int,
                           attention_mask: torch.Tensor | None) -> torch.Tensor:
    """sum_e p_e log p_e of p = the mean, over one sequence's tokens in every given application, of
    softmax(logits) per group of experts (a head, or the MLP's one group); averaged over sequences and groups.
    `logits`: one `[B * T, groups * E]` tensor per application."""
    log_probs = torch.cat([F.log_softmax(l.float().view(batch, -1, l.shape[-1] // num_experts, num_experts), dim=-1)
                           for l in logits], dim=1)  # [B, applications * T, groups, E]
    length = logits[0].shape[0] // batch
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] == length:
        keep = attention_mask.bool().to(log_probs.device).repeat(1, len(logits))[..., None, None]  # [B, R*T, 1, 1]
        count = keep.sum(dim=1).clamp(min=1).to(log_probs.dtype)  # [B, 1, 1]
        log_mean = torch.logsumexp(log_probs.masked_fill(~keep, float("-inf")), dim=1) - count.log()
    else:
        log_mean = torch.logsumexp(log_probs, dim=1) - math.log(log_probs.shape[1])  # [B, groups, E]
    return (log_mean.exp() * log_mean).sum(-1).mean()


def group_entropy_loss(router_logits: tuple[torch.Tensor, ...], config, batch: int,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """MoEUT's regulariser (`entropy_reg_scope="group"`), weighted: for each distinct block and each of its routers,
    `_sequence_entropy_term` over all the block's applications; the sigma-MoE router's times `entropy_reg_coef`, each
    attention router's times `attention_entropy_reg_coef`, summed. `router_logits`: the model's recorded ones,
    `config.routers_per_layer` per application in application order."""
    per_block, group = config.routers_per_layer, config.num_distinct_layers
    if len(router_logits) != per_block * config.num_hidden_layers:
        raise ValueError(f"expected {per_block * config.num_hidden_layers} router logits ({per_block} per block "
                         f"application), got {len(router_logits)}")
    attention = len(config.attention_expert_routers)
    total = torch.zeros((), dtype=torch.float32, device=router_logits[0].device)
    for member in range(group):
        for slot in range(per_block):
            uses = [router_logits[(repeat * group + member) * per_block + slot]
                    for repeat in range(config.num_layer_groups)]
            if slot < attention:
                if config.attention_entropy_reg_coef > 0:
                    total = total + config.attention_entropy_reg_coef * _sequence_entropy_term(
                        uses, batch, config.num_attention_experts, attention_mask)
            elif config.entropy_reg_coef > 0:
                total = total + config.entropy_reg_coef * _sequence_entropy_term(
                    uses, batch, config.num_mlp_experts, attention_mask)
    return total
