"""The expert projections as Transformers experts functions: from `config._experts_implementation` to the code that
runs, in one lookup, for SwitchHead's attention, its sigma-MoE MLP and every other Transformers MoE model.

Transformers runs the experts of its MoE models (Mixtral, Qwen3-MoE, OLMoE, ... and our sigma-MoE MLP) through
`transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`: its experts decorator reads the config and calls the function
registered under that name, `(experts_module, hidden_states [N, d], top_k_index [N, k], top_k_weights [N, k]) ->
[N, d]`. `register` (the model file calls it on import) puts every entry of `expert_ops.EXPERTS_IMPLEMENTATIONS` but
"eager" there under its own name, as `experts_forward` on that entry, so that

    model = AutoModelForCausalLM.from_pretrained(..., experts_implementation="cvmm")   # or
    model.set_experts_implementation("switchhead_batched")

runs a stock model's experts on our projections, and a SwitchAll model's MLP runs the function its attention runs
(which looks the name up in the same table, `expert_ops.lookup`). "eager" stays each module's own forward (ours
runs the same table's "eager").
This module imports the model's ops (which import the package's Triton kernels where installed) and Transformers;
nothing else hands it anything.

`experts_forward` reads the module's layout from the flags `@use_experts_implementation` sets: a fused gate/up
projection (`has_gate`, then the module's `_apply_gate`) or a plain up projection with `act_fn`, weights `[E, out,
in]` or `[E, in, out]` (`is_transposed`), optional per-expert biases and a post-expert norm. Under expert parallelism
(`local_routes`) the module holds its process's experts (`num_experts` of them) and a route to another process's
expert arrives as the sentinel id `num_experts` with gate 0: it runs on local expert 0 with gate 0 (adds nothing, no
gradient), as Transformers' own experts functions treat it.
"""

import functools
from collections.abc import Callable

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from .expert_ops import EXPERTS_IMPLEMENTATIONS, default_experts_implementation, lookup, sorting_once


def local_routes(module: torch.nn.Module, index: torch.Tensor, weights: torch.Tensor) -> tuple:
    """`(index, weights)` with every route to another process's expert (expert parallelism's sentinel id
    `module.num_experts`) sent to local expert 0 with gate 0; unchanged without expert parallelism."""
    if not getattr(module, "_is_expert_parallel", False):
        return index, weights
    off_process = index >= module.num_experts
    return index.masked_fill(off_process, 0), weights.masked_fill(off_process, 0.0)


def _as_in_out(weight: torch.Tensor, is_transposed: bool) -> torch.Tensor:
    """Expert weights as `[E, in, out]` (the projections' layout): a view for Transformers' `[E, out, in]`."""
    return weight if is_transposed else weight.transpose(1, 2)


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, project: Callable) -> torch.Tensor:
    """The experts of a Transformers MoE layer on the expert projection `project`: `[N, d]` -> `[N, d]`.

    Slot j of token n runs expert `top_k_index[n, j]`: up (or fused gate/up) projection, gate or activation, down
    projection, scaled by `top_k_weights[n, j]` and summed over the k slots (inside the projection when there is no
    bias or post-expert norm to apply per slot first).
    """
    num_tokens, hidden_dim = hidden_states.shape
    index, weights = local_routes(self, top_k_index.reshape(num_tokens, -1).long(),
                                  top_k_weights.reshape(num_tokens, -1))
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    # [N, 1, d]: every slot of a token reads its one row (the projection computes in the autocast dtype under
    # autocast, else in the promoted dtype of activations and weights)
    tokens = hidden_states.unsqueeze(1)
    project = sorting_once(project, tokens, index, up.shape[0])  # up and down route by one index: one sort

    inner = project(tokens, index, _as_in_out(up, self.is_transposed), None, 1)  # [N, k, (2 *) I]
    if up_bias is not None:
        inner = inner + up_bias[index]
    slots = index.shape[1]
    if self.has_gate:
        inner = self._apply_gate(inner.reshape(num_tokens * slots, -1)).view(num_tokens, slots, -1)
    else:
        inner = self.act_fn(inner)

    down = _as_in_out(self.down_proj, self.is_transposed)  # [E, I, d]
    post_norm = getattr(self, "has_post_expert_norm", False)  # set by Transformers >= 5.18's decorator only
    if not self.has_bias and not post_norm:
        out = project(inner, index, down, weights, 1)  # gated sum over the k slots in the projection
        return out.view(num_tokens, hidden_dim).to(hidden_states.dtype)
    per_slot = project(inner, index, down, None, 1)  # [N, k, d]
    if self.has_bias:
        per_slot = per_slot + self.down_proj_bias[index]
    if post_norm:
        per_slot = self.post_expert_norm(per_slot)
    out = (per_slot * weights.unsqueeze(-1)).sum(dim=1)
    return out.to(hidden_states.dtype)


def configured_implementation(config) -> str:
    """The experts implementation a layer runs: `config._experts_implementation`, or where no model dispatched the
    config (a layer built alone: None) the one a model would get by default. Transformers' own expert modules run
    eager then; ours run the model's default, so a layer alone computes what it computes inside a model."""
    name = config._experts_implementation
    return default_experts_implementation(ALL_EXPERTS_FUNCTIONS) if name is None else name


def register() -> None:
    """Register every table entry but "eager" as a Transformers experts function of the same name (idempotent)."""
    for name, project in EXPERTS_IMPLEMENTATIONS.items():
        if name != "eager":
            ALL_EXPERTS_FUNCTIONS.register(name, functools.partial(experts_forward, project=project))


class ExpertsChoiceMixin:
    """For the model classes: which experts implementation a model runs, as Transformers decides it, with our default
    ("switchhead_auto", rather than Transformers' "grouped_mm") and a refusal of names SwitchHead attention has no
    expert projection for (Transformers' MLP-only "batched_mm" / "grouped_mm"): a name runs one function, for the
    attention and the MLP alike."""

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        if requested_experts is None:
            requested_experts = default_experts_implementation(ALL_EXPERTS_FUNCTIONS)
        if self.config.attention_type == "switchhead" and requested_experts not in EXPERTS_IMPLEMENTATIONS:
            lookup(requested_experts)  # the ValueError that lists the table
        return super().get_correct_experts_implementation(requested_experts)


__all__ = ["ExpertsChoiceMixin", "configured_implementation", "experts_forward", "local_routes", "register"]
