"""Our CVMM as a Transformers experts implementation: `experts_implementation="cvmm"` for every MoE model.

Transformers runs the experts of its MoE models (Mixtral, Qwen3-MoE, OLMoE, ... and our sigma-MoE MLP) through
`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`: a function `(experts_module, hidden_states [N, d],
top_k_index [N, k], top_k_weights [N, k]) -> [N, d]` chosen by `config._experts_implementation`. Importing
`switchhead` registers `cvmm_experts_forward` there as "cvmm", so that

    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="cvmm")   # or
    model.set_experts_implementation("cvmm")

runs a stock model's experts on our CVMM: the projection that `register` is given, the model's
`switchhead.expert_ops.expert_projection` (its "cvmm" entry: the Triton kernels of this folder on CUDA, forward and
backward, expert-sorted, no host sync; its sync-free PyTorch formulations on CPU, the ones SwitchHead's own layers
run). The projection is passed in because the kernels never import the model (the layout's arrows point one way). The function reads the module's layout
from the flags `@use_experts_implementation` sets: a fused gate/up projection (`has_gate`, then the module's
`_apply_gate`) or a plain up projection with `act_fn`, weights `[E, out, in]` or `[E, in, out]` (`is_transposed`),
optional per-expert biases and a post-expert norm. Under expert parallelism the module holds its process's experts
(`num_experts` of them) and a route to another process's expert arrives as the sentinel id `num_experts` with gate 0:
it runs on local expert 0 with gate 0 (adds nothing, no gradient), as Transformers' own experts functions treat it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

NAME = "cvmm"


def _as_in_out(weight: torch.Tensor, is_transposed: bool) -> torch.Tensor:
    """Expert weights as `[E, in, out]` (cvmm's layout): a transposed view for Transformers' `[E, out, in]`."""
    return weight if is_transposed else weight.transpose(1, 2)


def cvmm_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, cvmm: Callable) -> torch.Tensor:
    """The experts of a Transformers MoE layer on our CVMM (`cvmm`, the expert projection): `[N, d]` -> `[N, d]`.

    Slot j of token n runs expert `top_k_index[n, j]`: up (or fused gate/up) projection, gate or activation, down
    projection, scaled by `top_k_weights[n, j]` and summed over the k slots (inside the kernel when there is no
    bias or post-expert norm to apply per slot first).
    """
    num_tokens, hidden_dim = hidden_states.shape
    index = top_k_index.reshape(num_tokens, -1).long()
    if getattr(self, "_is_expert_parallel", False):  # another process's expert (the sentinel): local row 0, gate 0
        off_process = index >= self.num_experts
        index = index.masked_fill(off_process, 0)
        top_k_weights = top_k_weights.reshape(num_tokens, -1).masked_fill(off_process, 0.0)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    # [N, 1, d]: every slot of a token reads its one row (cvmm computes in the autocast dtype under autocast, else
    # in the promoted dtype of activations and weights)
    tokens = hidden_states.unsqueeze(1)

    inner = cvmm(tokens, index, _as_in_out(up, self.is_transposed))  # [N, k, (2 *) I]
    if up_bias is not None:
        inner = inner + up_bias[index]
    slots = index.shape[1]
    if self.has_gate:
        inner = self._apply_gate(inner.reshape(num_tokens * slots, -1)).view(num_tokens, slots, -1)
    else:
        inner = self.act_fn(inner)

    down = _as_in_out(self.down_proj, self.is_transposed)  # [E, I, d]
    weights = top_k_weights.reshape(num_tokens, slots)
    post_norm = getattr(self, "has_post_expert_norm", False)  # set by Transformers >= 5.18's decorator only
    if not self.has_bias and not post_norm:
        out = cvmm(inner, index, down, weights, out_groups=1)  # gated sum over the k slots in the kernel
        return out.view(num_tokens, hidden_dim).to(hidden_states.dtype)
    per_slot = cvmm(inner, index, down)  # [N, k, d]
    if self.has_bias:
        per_slot = per_slot + self.down_proj_bias[index]
    if post_norm:
        per_slot = self.post_expert_norm(per_slot)
    out = (per_slot * weights.unsqueeze(-1)).sum(dim=1)
    return out.to(hidden_states.dtype)


def register(project: Callable) -> None:
    """Register `cvmm_experts_forward` on the expert projection `project` as the experts implementation "cvmm"
    (idempotent)."""
    ALL_EXPERTS_FUNCTIONS.register(NAME, functools.partial(cvmm_experts_forward, cvmm=project))


__all__ = ["NAME", "cvmm_experts_forward", "register"]
