"""SwitchHead and SwitchAll language models for Hugging Face Transformers.

SwitchHead ("SwitchHead: Accelerating Transformers with Mixture-of-Experts Attention", Csordás, Piękos, Irie,
Schmidhuber, NeurIPS 2024) keeps the query and key projections of each head dense and turns its value and output
projections into sigma-gated mixtures of experts:

    s_S = sigmoid(x_src W_S^T)  per head, top-k                      (value side, from the attended-to token)
    s_D = sigmoid(x_dst W_D^T)  per head, top-k                      (output side, from the attending token)
    V_h = sum_{e in topk(s_S, h)} s_S[h, e] * x W_V[h, e]
    A_h = softmax(Q_h K_h^T / sqrt(dh))                              (causal)
    y   = sum_h sum_{e in topk(s_D, h)} s_D[h, e] * (A_h V_h) W_O[h, e]

so a layer with few heads (and few attention matrices) matches a dense model with many. SwitchAll also replaces
the feed-forward block by a sigma-MoE. `attention_type="dense"` gives the paper's multi-head baseline.

The file is Hub-ready: it imports only torch, transformers and its sibling files (the configuration, and
`transformers_compat.py`, which holds what differs between the supported Transformers releases). When the
`switchhead` package is installed, the expert projections run through its kernels (`switchhead.kernels`), else
through the pure-PyTorch implementation below, which gives the same results.
"""

# No `from __future__ import annotations` here: Transformers reads the `**kwargs: Unpack[TransformersKwargs]`
# annotations at run time (e.g. to know that forward accepts output_attentions), which needs real objects.
import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .transformers_compat import (  # first: it checks the installed Transformers release
    accepts_past_key_values,
    cache_kwarg,
    incompatible_release,
    is_paged,
    is_paged_call,
    output_cache,
    route_paged_cache,
    update_cache,
)

try:
    from transformers import initialization as init
    from transformers.cache_utils import Cache, DynamicCache
    from transformers.generation import GenerationMixin
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, use_experts_implementation
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, create_causal_mask
    from transformers.modeling_layers import GradientCheckpointingLayer
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
    from transformers.processing_utils import Unpack
    from transformers.utils import TransformersKwargs, can_return_tuple, output_capturing
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs
except ImportError as error:  # a release too old (or too new) for this file: say which to install
    raise incompatible_release(error) from error

from .configuration_switchhead import SwitchHeadConfig

try:  # our fused kernels, when the package is installed; the Hub copy of this file runs without them
    _kernels = importlib.import_module("switchhead.kernels")
    if not (hasattr(_kernels, "cvmm") and hasattr(_kernels, "resolve_backend")):
        _kernels = None
except Exception:  # noqa: BLE001 - any failure means "use the PyTorch path"
    _kernels = None
# Triton runs CPU tensors only in its interpreter, which it reads from the environment when the kernels are defined
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_UNSET = object()


# ==================================================================================================== expert op
EXPERT_IMPLEMENTATIONS = ("auto", "reference", "batched", "all_experts", "grouped")
_FEW_SLOTS = 4  # "auto": gather the selected matrices while N * S (selected matrices in the call) is at most this
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_usable(inputs: torch.Tensor, weight: torch.Tensor) -> bool:
    """`torch._grouped_mm` on CPU for float32 / bfloat16 / float16 with 16-byte aligned rows (GPUs: see below)."""
    if _GROUPED_MM is None or inputs.dtype != weight.dtype or weight.device.type != "cpu":
        return False
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if torch.compiler.is_compiling():
        return False  # torch 2.13's fake (meta) kernel of _grouped_mm accepts bf16 only; inductor fuses the rest
    per_16_bytes = 16 // weight.element_size()
    return weight.shape[1] % per_16_bytes == 0 and weight.shape[2] % per_16_bytes == 0


def choose_expert_implementation(tokens: int, slots: int, rows: int, out_groups: int | None, num_experts: int,
                                 inputs: torch.Tensor, weight: torch.Tensor, implementation: str = "auto") -> str:
    """The formulation `expert_projection_torch` runs: `implementation`, with "auto" resolved by problem size.

    "auto": "batched" for a handful of selected matrices (N * S <= 4: decoding one sequence, the weight copy is
    small); "all_experts" while its extra work is small: it multiplies by every expert, i.e. min(R, out groups) * G
    matrix products per token where S are needed, so it is taken when that is at most twice S, or for few tokens
    (N * S <= 512, where the grouped path's sorting and copying cost more than the extra products); else
    "grouped". "grouped" needs `torch._grouped_mm` (`_grouped_mm_usable`) and runs as "all_experts" otherwise.
    """
    if implementation not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(EXPERT_IMPLEMENTATIONS)}; got {implementation!r}")
    if implementation == "auto":
        mixed = min(rows, out_groups or slots) * num_experts  # products per token of "all_experts"
        if tokens * slots <= _FEW_SLOTS:
            implementation = "batched"
        elif mixed <= 2 * slots or tokens * slots <= 512:
            implementation = "all_experts"
        else:
            implementation = "grouped"
    if implementation == "grouped" and (tokens == 0 or not _grouped_mm_usable(inputs, weight)):
        implementation = "all_experts"
    return implementation


def _expert_gated_sum(per_slot: torch.Tensor, gates: torch.Tensor | None, out_groups: int) -> torch.Tensor:
    if gates is None:
        return per_slot
    n, s, d_out = per_slot.shape
    weighted = per_slot * gates.unsqueeze(-1).to(per_slot.dtype)
    return weighted.view(n, out_groups, s // out_groups, d_out).sum(2)


def _mixing_matrix(expert_index: torch.Tensor, gates: torch.Tensor, rows: int, num_experts: int, out_groups: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """`[N, out_groups * G * R]`: entry (o, g, r) sums the gates of the slots of output group o that multiply input
    row r by expert g (zero where no slot does). The gated sum is linear, so out[o] = sum_{g,r} M[o,g,r] x_r W_g."""
    n, s = expert_index.shape
    slot = torch.arange(s, device=expert_index.device)
    column = ((slot // (s // out_groups)) * num_experts + expert_index) * rows + slot // (s // rows)
    mixing = torch.zeros(n, out_groups * num_experts * rows, dtype=dtype, device=expert_index.device)
    return mixing.scatter_add_(1, column, gates.to(dtype))


def _grouped_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as `_grouped_mm` takes it: packed experts, each row- or column-major (Transformers' `[E, out, in]`
    experts seen as `[E, in, out]` are used as they are, with no copy); any other layout is copied."""
    _, rows, cols = weight.shape
    if weight.stride(0) == rows * cols and weight.stride()[1:] in ((cols, 1), (1, rows)):
        return weight
    return weight.contiguous()


class _GroupedExperts(torch.autograd.Function):
    """The "grouped" formulation with a lean backward: slots sorted by expert, one grouped matmul per direction.

    It saves only its arguments and the sort (the sorted input rows are gathered again in the backward, and no
    per-slot output is kept), and takes three grouped matmuls in all: the gate gradient comes from the input-side
    product, d gate_s = <dy_s W_e^T, x_s>, which the input gradient needs anyway.
    """

    @staticmethod
    def forward(ctx, inputs, weight, gates, expert_index, out_groups):
        n, s = expert_index.shape
        r, d_in = inputs.shape[1], inputs.shape[2]
        g, _, d_out = weight.shape
        flat = torch.arange(g, device=inputs.device).index_select(0, expert_index.reshape(-1))  # bounds-checked
        sorted_expert, order = torch.sort(flat, stable=True)
        ends = torch.searchsorted(sorted_expert, torch.arange(1, g + 1, device=inputs.device)).to(torch.int32)
        weight = _grouped_weight(weight)
        sorted_rows = inputs.reshape(n * r, d_in).index_select(0, order // (s // r))
        sorted_out = _GROUPED_MM(sorted_rows, weight, offs=ends)  # [N * S, d_out]
        ctx.save_for_backward(inputs, weight, gates, order, ends)
        ctx.shape = (n, s, r, out_groups)
        if gates is None:
            return sorted_out.new_empty(n * s, d_out).index_copy_(0, order, sorted_out).view(n, s, d_out)
        sorted_out.mul_(gates.reshape(-1).index_select(0, order).to(sorted_out.dtype).unsqueeze(-1))
        out = sorted_out.new_zeros(n * out_groups, d_out).index_add_(0, order // (s // out_groups), sorted_out)
        return out.view(n, out_groups, d_out)

    @staticmethod
    def backward(ctx, grad):
        inputs, weight, gates, order, ends = ctx.saved_tensors
        n, s, r, out_groups = ctx.shape
        d_in, d_out = inputs.shape[2], weight.shape[2]
        grad = grad.contiguous().reshape(-1, d_out)
        sorted_rows = inputs.reshape(n * r, d_in).index_select(0, order // (s // r))
        grad_inputs = grad_weight = grad_gates = None
        if gates is None:
            sorted_grad = grad.index_select(0, order)  # [N * S, d_out]
        else:
            sorted_grad = grad.index_select(0, order // (s // out_groups))  # d (gated slot output), ungated
            sorted_gates = gates.reshape(-1).index_select(0, order).to(grad.dtype).unsqueeze(-1)
        need_inputs = ctx.needs_input_grad[0] or (gates is not None and ctx.needs_input_grad[2])
        if need_inputs:
            row_grad = _GROUPED_MM(sorted_grad, weight.transpose(1, 2), offs=ends)  # dy W_e^T, [N * S, d_in]
            if gates is not None and ctx.needs_input_grad[2]:
                sorted_gate_grad = (row_grad * sorted_rows).sum(-1)
                grad_gates = torch.empty_like(sorted_gate_grad).scatter_(0, order, sorted_gate_grad)
                grad_gates = grad_gates.view(n, s).to(gates.dtype)
            if ctx.needs_input_grad[0]:
                if gates is not None:
                    row_grad = row_grad * sorted_gates
                grad_inputs = row_grad.new_zeros(n * r, d_in).index_add_(0, order // (s // r), row_grad)
                grad_inputs = grad_inputs.view(n, r, d_in)
        if ctx.needs_input_grad[1]:
            scaled = sorted_grad if gates is None else sorted_grad * sorted_gates
            grad_weight = _GROUPED_MM(sorted_rows.t(), scaled, offs=ends)  # [G, d_in, d_out]
        return grad_inputs, grad_weight, grad_gates, None, None


def expert_projection_torch(
    inputs: torch.Tensor,
    expert_index: torch.Tensor,
    weight: torch.Tensor,
    gates: torch.Tensor | None = None,
    out_groups: int = 1,
    implementation: str = "auto",
) -> torch.Tensor:
    """The CVMM contract in plain PyTorch: rows times their selected expert, with an optional gated sum.

    Args:
        inputs: `[N, R, d_in]`, R input rows per token. Slot `s` of a token reads row `s // (S // R)`.
        expert_index: `[N, S]` integer indices into `weight`'s first dimension (S = R * slots per row).
        weight: `[G, d_in, d_out]`, one matrix per expert (all heads' experts together).
        gates: `[N, S]` or None. With gates, slot `s` is scaled by its gate and summed into output group
            `s // (S // out_groups)`.
        out_groups: output rows per token when `gates` is given.
        implementation: the formulation (`EXPERT_IMPLEMENTATIONS`), all giving the same result:
            "reference" gathers every slot's matrix (`[N, S, d_in, d_out]`) and takes one einsum (the simple twin);
            "batched" gathers the selected matrices and takes one bmm with the gated sum inside;
            "all_experts" uses every expert in dense matmuls, no weight copy: without gates it multiplies every row
            by every expert and picks the selected results; with gates it scatters them into a mixing matrix
            (`_mixing_matrix`) and either multiplies each row by every expert and mixes the results (R <= out
            groups: SwitchHead's values), or mixes the rows per expert and takes one matmul with all experts
            stacked (R > out groups: SwitchHead's output);
            "grouped" sorts the slots by expert and takes one grouped matmul (`torch._grouped_mm`, CPU tensors in
            float32 / bfloat16 / float16 with 16-byte aligned rows, not under torch.compile; elsewhere it runs as
            "all_experts") with a hand-written backward that saves no per-slot tensor (`_GroupedExperts`);
            "auto" (default): by problem size, see `choose_expert_implementation`.

    Returns:
        `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them.

    No formulation syncs with the host (no `.item()` / `.tolist()`, no data-dependent shapes), so the op compiles
    with `torch.compile(fullgraph=True)`. An expert id outside `[0, G)` raises IndexError from an `index_select`.
    """
    n, s = expert_index.shape
    r, d_in = inputs.shape[1], inputs.shape[2]
    g, _, d_out = weight.shape
    expert_index = expert_index.long()
    implementation = choose_expert_implementation(n, s, r, out_groups if gates is not None else None, g, inputs,
                                                  weight, implementation)
    device = inputs.device
    if implementation == "reference":
        rows = inputs.unsqueeze(2).expand(n, r, s // r, d_in).reshape(n, s, d_in)
        matrices = weight.index_select(0, expert_index.reshape(-1)).view(n, s, d_in, d_out)  # each slot's matrix
        per_slot = torch.einsum("nsi,nsio->nso", rows, matrices)
        return _expert_gated_sum(per_slot, gates, out_groups)
    if implementation == "batched":
        matrices = weight.index_select(0, expert_index.reshape(-1))  # [M, d_in, d_out]
        rows = inputs.unsqueeze(2).expand(n, r, s // r, d_in).reshape(n, s, d_in)
        if gates is None:
            return torch.bmm(rows.reshape(n * s, 1, d_in), matrices).view(n, s, d_out)
        rows = rows * gates.unsqueeze(-1).to(rows.dtype)  # the gated sum inside the matmul, per output group
        per_group = s // out_groups
        out = torch.bmm(rows.reshape(n * out_groups, 1, per_group * d_in),
                        matrices.view(n * out_groups, per_group * d_in, d_out))
        return out.view(n, out_groups, d_out)
    if implementation == "grouped":
        return _GroupedExperts.apply(inputs, weight, gates, expert_index, out_groups)
    # "all_experts"
    if gates is None:  # every row times every expert, then each slot's result picked
        every = torch.matmul(inputs.reshape(1, n * r, d_in), weight)  # [G, N * R, d_out]
        slot_row = torch.arange(s, device=device)[None, :] // (s // r)
        row_of_slot = torch.arange(n, device=device)[:, None] * r + slot_row
        pick = (expert_index * (n * r) + row_of_slot).reshape(-1)  # out of range iff an expert id is
        return every.reshape(g * n * r, d_out).index_select(0, pick).view(n, s, d_out)
    checked = torch.arange(g, device=device).index_select(0, expert_index.reshape(-1)).view(n, s)  # bounds check
    mixing = _mixing_matrix(checked, gates, r, g, out_groups, inputs.dtype)  # [N, O * G * R]
    if r <= out_groups:  # project every row by every expert, then mix the results
        every = torch.matmul(inputs.reshape(1, n * r, d_in), weight)  # [G, N * R, d_out]
        every = every.view(g, n, r, d_out).permute(1, 0, 2, 3).reshape(n, g * r, d_out)
        return torch.bmm(mixing.view(n, out_groups, g * r), every)
    mixed = torch.bmm(mixing.view(n, out_groups * g, r), inputs)  # [N, O * G, d_in]: each expert's gated input
    out = torch.matmul(mixed.view(n * out_groups, g * d_in), weight.reshape(g * d_in, d_out))
    return out.view(n, out_groups, d_out)


def expert_projection(inputs, expert_index, weight, gates=None, out_groups=1, implementation="auto"):
    """Dispatch point of the CVMM op: the Triton kernels of `switchhead.kernels` where they run (CUDA tensors, or
    `TRITON_INTERPRET=1`; they ignore `implementation`), else `expert_projection_torch` (the CPU path, the same
    with or without the package installed)."""
    if _kernels is not None and _kernels.resolve_backend(inputs.device, inputs.dtype) == "triton":
        return _kernels.cvmm(inputs, expert_index, weight, gates, out_groups, implementation=implementation)
    return expert_projection_torch(inputs, expert_index, weight, gates, out_groups, implementation=implementation)


# Transformers' experts implementations -> our formulation of the same choice for the attention's V/O experts (and
# the sigma-MoE MLP's "eager"): the PyTorch formulations above. "cvmm" (registered by the switchhead package), None
# (a module used on its own) and other registered ones (deepgemm, sonicmoe: MLP-shaped kernels) take
# `expert_projection`, i.e. our kernels when the package is installed.
EXPERTS_FORMULATIONS = {"eager": "auto", "batched_mm": "batched", "grouped_mm": "grouped"}


def expert_projection_for(experts_implementation: str | None) -> Callable:
    """The expert projection (the CVMM contract) that `config._experts_implementation` asks for."""
    formulation = EXPERTS_FORMULATIONS.get(experts_implementation)
    if formulation is None:
        return expert_projection
    return lambda inputs, expert_index, weight, gates=None, out_groups=1: expert_projection_torch(
        inputs, expert_index, weight, gates, out_groups, implementation=formulation)


# ==================================================================================================== head experts
# SwitchHead's own case of the op: the routing is per head (head h's slots pick among head h's experts, global ids
# h * E + e, which `ExpertSelection` guarantees), so the top-k can be held as dense gates `[N, H, E]` (zero for the
# experts not chosen, summed where an id repeats) and both projections run against every expert of a head with no
# index arithmetic: a handful of ops per call, which is what decoding pays for (a few tokens; the generic
# formulations spend their time in index and mixing-matrix ops there). It does the work of "all_experts" (E / k
# times the products of the selected slots), so `SwitchHeadAttention` takes it only where "auto" would pick
# "all_experts" or "batched". Under autograd, custom functions keep what the backward needs and no more: the value
# side its arguments and the products of every expert `[N, H * E, dh]` (the gates' gradient reads them; recomputing
# them instead would save another 40 MiB of the 47M model's training step at context 512, for about 5% more step
# time), the output side only its arguments (the gated input rows `[N, H * E * dh]` are recomputed: elementwise).
def dense_head_gates(expert_index: torch.Tensor, gates: torch.Tensor, num_groups: int, num_experts: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """`[N, S]` global expert ids (group h's slots pick ids in `[h * E, (h + 1) * E)`) and their gates -> the dense
    gates `[N, groups, E]` in `dtype` (summed where an id repeats, zero where no slot picked the expert)."""
    dense = gates.new_zeros(gates.shape[0], num_groups * num_experts)
    return dense.scatter_add_(1, expert_index, gates).view(-1, num_groups, num_experts).to(dtype)


def _scatter_group_gates(gates: torch.Tensor, index: torch.Tensor, num_experts: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """`ExpertSelection.select`'s gates and within-group ids `[N, groups, k]` (distinct per group, from a top-k) ->
    dense gates `[N, groups, E]` in `dtype`."""
    dense = gates.new_zeros(*index.shape[:2], num_experts).scatter_(-1, index, gates)
    return dense if dense.dtype == dtype else dense.to(dtype)


def _every_expert_values(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """inputs `[N, d]`, weight `[H * E, d, dh]` -> every expert's projection `[H * E, N, dh]`."""
    if inputs.shape[0] == 1:  # decoding one token: one batched matrix-vector product (no broadcasting matmul)
        return torch.bmm(inputs.expand(weight.shape[0], 1, inputs.shape[1]), weight)
    return torch.matmul(inputs.unsqueeze(0), weight)


def _head_values_forward(inputs: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    n, heads, experts = gates.shape
    if n == 1 and torch.compiler.is_compiling():
        # decoding one token, compiled: inductor turns the batched matrix-vector products into a generated loop
        # (about 130 us a layer here, 1 MB of weights); mixing each head's expert matrices by their gates first (one
        # generated pass over the weights, into [d, H * dh]) and then one matrix product (ATen's) takes about 90 us
        d, dh = weight.shape[1], weight.shape[2]
        mixed = (gates.view(heads, experts, 1, 1) * weight.view(heads, experts, d, dh)).sum(1)  # [H, d, dh]
        return torch.mm(inputs, mixed.permute(1, 0, 2).reshape(d, heads * dh)).view(1, heads, dh)
    every = _every_expert_values(inputs, weight)  # [H * E, N, dh]
    if n == 1:  # [H, 1, E] x [H, E, dh]
        return torch.bmm(gates.view(heads, 1, experts), every.view(heads, experts, -1)).view(1, heads, -1)
    return _mix_values(every, gates)


def _mix_values(every: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """every expert's values `[H * E, N, dh]` and dense gates `[N, H, E]` -> `[N, H, dh]` (sum over each head's E)."""
    n, heads, experts = gates.shape
    mixed = every.view(heads, experts, n, every.shape[-1]) * gates.permute(1, 2, 0).unsqueeze(-1)
    return mixed.sum(1).transpose(0, 1)


def _head_output_mixed(rows: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """rows `[N, H, dh]`, gates `[N, H, E]` -> every expert's gated input row, `[N, H * E * dh]`."""
    n, heads, experts = gates.shape
    return (gates.unsqueeze(-1) * rows.unsqueeze(2)).view(n, heads * experts * rows.shape[2])


class _HeadExpertValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, gates, weight):
        every = _every_expert_values(inputs, weight)  # [H * E, N, dh]
        ctx.save_for_backward(inputs, gates, weight, every)
        return _mix_values(every, gates)

    @staticmethod
    def backward(ctx, grad):  # grad [N, H, dh]
        inputs, gates, weight, every = ctx.saved_tensors
        n, heads, experts = gates.shape
        d, dh = weight.shape[1], weight.shape[2]
        grad_inputs = grad_gates = grad_weight = None
        if ctx.needs_input_grad[1]:  # d gate[n, h, e] = <dy[n, h], x_n W_he>
            grad_gates = (every.view(heads, experts, n, dh) * grad.transpose(0, 1).unsqueeze(1)).sum(-1)
            grad_gates = grad_gates.permute(2, 0, 1)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            scaled = (gates.unsqueeze(-1) * grad.unsqueeze(2)).reshape(n, heads * experts * dh)  # [N, H*E*dh]
            if ctx.needs_input_grad[0]:
                grad_inputs = scaled @ weight.transpose(1, 2).reshape(heads * experts * dh, d)
            if ctx.needs_input_grad[2]:
                grad_weight = (inputs.t() @ scaled).view(d, heads * experts, dh).transpose(0, 1).contiguous()
        return grad_inputs, grad_gates, grad_weight


class _HeadExpertOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, gates, weight):
        ctx.save_for_backward(rows, gates, weight)
        return _head_output_mixed(rows, gates) @ weight.reshape(-1, weight.shape[2])

    @staticmethod
    def backward(ctx, grad):  # grad [N, d]
        rows, gates, weight = ctx.saved_tensors
        n, heads, experts = gates.shape
        grad_rows = grad_gates = grad_weight = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_mixed = (grad @ weight.reshape(-1, weight.shape[2]).t()).view(n, heads, experts, weight.shape[1])
            if ctx.needs_input_grad[0]:
                grad_rows = (grad_mixed * gates.unsqueeze(-1)).sum(2)
            if ctx.needs_input_grad[1]:
                grad_gates = (grad_mixed * rows.unsqueeze(2)).sum(-1)
        if ctx.needs_input_grad[2]:  # the gated input rows, recomputed
            grad_weight = (_head_output_mixed(rows, gates).t() @ grad).view(weight.shape)
        return grad_rows, grad_gates, grad_weight


def _lean_autograd(*tensors: torch.Tensor) -> bool:
    """Whether to run the custom functions above: autograd records the call, and no autocast (whose casts the
    hand-written backwards do not replay; under autocast the plain ops run, and autograd saves what they need)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors) \
        and not torch.is_autocast_enabled(tensors[0].device.type)


def head_expert_values(inputs: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head expert values: inputs `[N, d]`, dense gates `[N, H, E]` (`dense_head_gates`), weight
    `[H * E, d, dh]` (head h's experts in rows h * E .. h * E + E - 1) -> `[N, H, dh]`,
    out[n, h] = sum_e gates[n, h, e] * inputs[n] @ weight[h * E + e]."""
    if _lean_autograd(inputs, gates, weight):
        return _HeadExpertValues.apply(inputs, gates, weight)
    return _head_values_forward(inputs, gates, weight)


def head_expert_output(rows: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head expert outputs summed over heads: rows `[N, H, dh]`, dense gates `[N, H, E]`, weight
    `[H * E, dh, d]` -> `[N, d]`, out[n] = sum_{h, e} gates[n, h, e] * rows[n, h] @ weight[h * E + e]."""
    if _lean_autograd(rows, gates, weight):
        return _HeadExpertOutput.apply(rows, gates, weight)
    return _head_output_mixed(rows, gates) @ weight.reshape(-1, weight.shape[2])


# ==================================================================================================== routers
class ExpertSelection(nn.Module):
    """Sigma-gated top-k routing: `scores = sigmoid(x W^T)` in float32, top-k within each group of experts.

    Groups are attention heads (head h chooses among its own experts) or the single group of a sigma-MoE MLP.
    Gates are the raw sigmoid scores (no renormalisation) and receive gradients.

    Expert dropout (training only) either excludes a score from the top-k but keeps its value as the gate
    (`drop_to_zero=False`, SwitchHead) or zeroes it before the top-k (`drop_to_zero=True`, sigma-MoE).
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
        # groups from the logits' width: under tensor parallelism this process holds only its heads' rows
        offsets = self.group_offsets if gates.shape[1] == self.num_groups else self.group_offsets[:gates.shape[1]]
        index = index + offsets.to(index.device).unsqueeze(-1)
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

    def needs_call(self) -> bool:
        """Whether routing must go through the module call rather than `select` on the logits directly: where the
        call runs hooks (Transformers' output recording: `router_logits`) or a forward replaced on the instance
        (tensor parallelism's local forward)."""
        return bool(self._forward_hooks or self._forward_pre_hooks or "forward" in self.__dict__
                    or nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


# ==================================================================================================== positions
class _RotatedChannels:
    """The config fields Transformers' `ROPE_INIT_FUNCTIONS` read, describing only the rotated channels.

    Those functions derive the rotary width as `int(head_dim * partial_rotary_factor)`; ours rounds down to an even
    count (`num_rotary_channels`), so they get head_dim = num_rotary_channels and a factor of 1.
    """

    def __init__(self, config: SwitchHeadConfig):
        self.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 1.0}
        self.rope_parameters.setdefault("rope_theta", config.default_theta)
        self.rope_parameters.setdefault("original_max_position_embeddings", config.max_position_embeddings)
        self.head_dim = config.num_rotary_channels
        self.hidden_size, self.num_attention_heads = config.hidden_size, config.num_attention_heads
        self.max_position_embeddings = config.max_position_embeddings

    def standardize_rope_params(self) -> None:  # already standard (see __init__)
        pass


class SwitchHeadRotaryEmbedding(nn.Module):
    """NeoX-style RoPE on the first `num_rotary_channels` channels of each head (the paper rotates half).

    `config.rope_parameters["rope_type"]` picks the frequencies of the rotated channels (the others pass through):
    - "default" (the paper's) and "dynamic" (NTK-aware: the base grows once a forward's longest position exceeds
      `max_position_embeddings`, from that forward's `position_ids`, so it follows the sequence as it grows) are
      computed in every forward in at least fp32, in fp64 for an fp64 model, with tensor ops only (no host sync,
      so `torch.compile(fullgraph=True)` traces them);
    - "linear", "yarn", "llama3" and "longrope" come from Transformers' `ROPE_INIT_FUNCTIONS` (float32), with the
      attention factor (yarn, longrope) applied to cos and sin. longrope switches from its short to its long
      factors (`torch.where`, no sync) when the longest position exceeds `original_max_position_embeddings`.

    `inv_freq` holds the float32 frequencies at the original context (`long_inv_freq` longrope's long ones): buffers
    that are not saved, rebuilt from the config after loading (`_init_weights`) and after every `.to()` (so a cast
    to half precision never rounds them).
    """

    def __init__(self, config: SwitchHeadConfig, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        params = config.rope_parameters
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        if self.rope_type != "default" and self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_parameters['rope_type']={self.rope_type!r} is not a RoPE type of this "
                             f"Transformers version; use 'default' or one of {sorted(ROPE_INIT_FUNCTIONS)}")
        self.rotary = config.num_rotary_channels
        self.base = float(params.get("rope_theta", config.default_theta))
        self.factor = float(params.get("factor") or 1.0)
        # the context the frequencies were made for: dynamic scales past max_position_embeddings (as Transformers
        # does), longrope switches past original_max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        if self.rope_type == "longrope":
            self.original_max_seq_len = int(params.get("original_max_position_embeddings",
                                                       config.max_position_embeddings))
        self.attention_scaling = 1.0
        self.reset_frequencies(device)

    def _default_frequencies(self, device, dtype) -> torch.Tensor:
        return self.base ** (-torch.arange(0, self.rotary, 2, device=device, dtype=dtype) / self.rotary)

    @torch.no_grad()
    def reset_frequencies(self, device: torch.device | str | None = None) -> None:
        """(Re)build the float32 frequency buffers from the config on `device` (default: where they are now, or the
        default device when there are none yet, e.g. meta while `from_pretrained` builds the model)."""
        if device is None:
            device = self.inv_freq.device if "inv_freq" in self._buffers else torch.get_default_device()
        if self.rope_type in ("default", "dynamic"):
            inv_freq = self._default_frequencies(device, torch.float32)
        else:
            fraction = _RotatedChannels(self.config)
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](fraction, device)
            if self.rope_type == "longrope":
                long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](fraction, device,
                                                                   seq_len=self.original_max_seq_len + 1)
                self.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.reset_frequencies()  # rebuilt in float32 wherever they went (a cast would round them)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids `[B, T]` -> (cos, sin), each `[B, T, num_rotary_channels]` in x's dtype."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        if self.rope_type == "default":
            inv_freq = self._default_frequencies(x.device, dtype)
        elif self.rope_type == "dynamic":
            # NTK-aware base for this forward's length L = max(longest position + 1, original), as a tensor
            length = (position_ids.max() + 1).to(dtype).clamp(min=self.original_max_seq_len)
            growth = self.factor * length / self.original_max_seq_len - (self.factor - 1)
            base = self.base * growth ** (self.rotary / (self.rotary - 2))
            inv_freq = base ** (-torch.arange(0, self.rotary, 2, device=x.device, dtype=dtype) / self.rotary)
        else:
            inv_freq = self.inv_freq.to(device=x.device, dtype=dtype)
            if self.rope_type == "longrope":
                beyond = position_ids.max() + 1 > self.original_max_seq_len
                inv_freq = torch.where(beyond, self.long_inv_freq.to(device=x.device, dtype=dtype), inv_freq)
        freqs = position_ids[..., None].to(dtype) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, dh]`; rotates its first `cos.shape[-1]` channels, passes the rest through."""
    rotary = cos.shape[-1]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated, passed = x[..., :rotary], x[..., rotary:]
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


def sinusoidal_embedding(positions: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sinusoidal encoding of (relative) positions `[P]` -> `[P, dim]`, the authors' layout (interleaved).

    Channel 2f holds sin(p * w_f) and channel 2f + 1 holds cos(p * w_f), w_f = 10000^(-2f / dim): the layout of
    `sinusoidal_pos_embedding` in the authors' code, which their `pos_to_pk` weights were trained against.
    `dtype` is the computation dtype (at least float32; float64 for float64 models).
    """
    dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = torch.exp(torch.arange(0, dim, 2, device=positions.device, dtype=dtype) * (-math.log(10000.0) / dim))
    angles = positions.to(dtype)[:, None] * inv_freq[None, :]  # [P, ceil(dim / 2)]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[:, :dim]


_PAST_ENCODINGS: dict[tuple, torch.Tensor] = {}  # (dim, computation dtype, device) -> rows for p = 0, -1, -2, ...


def past_sinusoidal_encoding(num_distances: int, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`sinusoidal_embedding` of the relative positions 0, -1, ..., -(num_distances - 1): `[num_distances, dim]`.

    Input-independent, so calls read it from one table per (dim, dtype, device), grown by doubling and sliced
    (row p is the same value however long the table is): a decoding step does not recompute the encoding of every
    distance in every layer. Eager calls build and grow the table. Under torch.compile an existing table that is
    long enough is read (dynamo lifts it as a graph input and guards on it: a table grown later recompiles once);
    otherwise the encoding is computed in the graph (no Python-side state is written while tracing). Computed in
    the graph, inductor fuses the sines and cosines into the product that reads them, once per layer: about 7 ms of
    a 24 ms compiled XL decoding step of the 47M models on one CPU thread, which the table removes.
    """
    dtype = torch.promote_types(dtype, torch.float32)
    key = (dim, dtype, device)
    table = _PAST_ENCODINGS.get(key)
    if torch.compiler.is_compiling() or device.type == "meta":  # read a table, never write one
        if table is not None and table.shape[0] >= num_distances:
            return table[:num_distances]
        return sinusoidal_embedding(-torch.arange(num_distances, device=device), dim, dtype)
    if table is None or table.shape[0] < num_distances:
        rows = max(num_distances, 256, 2 * table.shape[0] if table is not None else 0)
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, usable later with autograd on
            table = sinusoidal_embedding(-torch.arange(rows, device=device), dim, dtype)
        _PAST_ENCODINGS[key] = table
    return table[:num_distances]


# ==================================================================================================== attention
def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention: query `[B, H, Tq, dh]`, key/value `[B, H, Tk, dh]` -> (`[B, Tq, H, dh]`, probs)."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    elif query.shape[2] > 1:  # no mask given: plain causal, queries aligned to the end of the keys
        causal = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
        causal = causal.tril(key.shape[2] - query.shape[2])
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    probs = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def paged_key_distances(kwargs: dict, query_length: int, key_length: int, device,
                        paged: bool | None = None) -> torch.Tensor | None:
    """Continuous batching (paged cache): relative distance query - key for the packed batch, `[Tq, Tk]`, or None.

    Transformers' continuous batching calls the model with every scheduled request packed into one row: queries
    `[cu_seq_lens_q[r], cu_seq_lens_q[r+1])` belong to request r, and the attention function reads request r's keys
    back from the paged cache as `[cu_seq_lens_k[r], cu_seq_lens_k[r+1])`, in position order (cached ones first, then
    this step's). So key j of request r sits at position j - cu_seq_lens_k[r], and query i at position
    (i - cu_seq_lens_q[r]) + (keys of r) - (queries of r). Entries between different requests get a distance too;
    the block-diagonal mask removes them. Padding rows or columns past the last request count as the last request.
    None when the call is not a paged one: `paged` false (by default: no `cache` in the kwargs, where Transformers
    before 5.24 passes the paged cache), or no `cu_seq_lens_k` in the kwargs.
    """
    if paged is None:
        paged = kwargs.get("cache") is not None
    if not paged or kwargs.get("cu_seq_lens_k") is None or kwargs.get("cu_seq_lens_q") is None:
        return None
    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):  # one entry per attention type; SwitchHead layers are all full attention
        cu_k = cu_k.get("full_attention", next(iter(cu_k.values())))
    cu_q = kwargs["cu_seq_lens_q"].to(device=device, dtype=torch.long)
    cu_k = cu_k.to(device=device, dtype=torch.long)
    last = cu_q.numel() - 2
    query_index, key_index = torch.arange(query_length, device=device), torch.arange(key_length, device=device)
    query_request = (torch.searchsorted(cu_q, query_index, right=True) - 1).clamp(0, last)
    key_request = (torch.searchsorted(cu_k, key_index, right=True) - 1).clamp(0, last)
    keys_of, queries_of = cu_k[1:] - cu_k[:-1], cu_q[1:] - cu_q[:-1]
    query_position = query_index - cu_q[query_request] + keys_of[query_request] - queries_of[query_request]
    key_position = key_index - cu_k[key_request]
    return query_position[:, None] - key_position[None, :]


class SwitchHeadAttentionBase(nn.Module):
    """What SwitchHead and dense attention share: dense per-head Q/K, positions, cache and attention backend.

    Subclasses say how values are made from the source tokens (`project_values`) and how the per-head attention
    results become the layer output (`project_output`).

    Backends: `config._attn_implementation` picks eager (this file, the reference), sdpa or flex from
    `ALL_ATTENTION_FUNCTIONS`. With RoPE and no padding the sdpa path gets no mask (flash-eligible). With XL
    positions the relative-position term (`xl_position_bias`, `[B, H, Tq, Tk]`) is passed as `position_bias`:
    eager adds it to the scores; sdpa folds it into a float `attn_mask` (memory-efficient or math kernel, never
    flash); flex adds it in its `score_mod` and masks with a BlockMask (compiled FlexAttention, the fast path on
    GPU). All three give the same results (tests/test_xl.py). Keys are indexed cache (or XL memory) first, and
    query t of a call sits at key index `query_offset + t`, so relative distances are the same in one pass, in
    chunks through the cache, and across the XL memory boundary. With XL memory the mask is always materialised
    (see `create_xl_memory_mask`), so sdpa never substitutes its top-left-aligned `is_causal` mask.

    Deviations from the authors' code, on purpose: attention dropout acts on the probabilities (theirs drops
    entries of k and of the projected positions; the paper's runs use 0), and the dense XL baseline has no u/v
    biases and a fixed 1/sqrt(dh) scale (their `preln_relative` baseline layer learns both).
    """

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.num_key_value_groups = 1
        self.attention_dropout = config.attention_dropout
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.position_encoding = config.position_encoding
        if self.position_encoding == "xl":
            # W_pk: projects the sinusoidal encoding of the relative position into each head's key space.
            self.position_key_proj = nn.Linear(config.hidden_size, inner, bias=False)

    def project_values(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states `[B, T, d]` -> values `[B, T, H, dh]`."""
        raise NotImplementedError

    def project_output(self, attended: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """attended `[B, T, H, dh]`, hidden_states `[B, T, d]` (the destination tokens) -> `[B, T, d]`."""
        raise NotImplementedError

    def joint_gates(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Routing that the value and output sides share when both read the same tokens (no XL memory), passed to
        `project_values` / `project_output` as their last argument; None (the default): each side routes itself."""
        return None

    def xl_position_bias(self, query: torch.Tensor, key_length: int, query_offset: int = 0) -> torch.Tensor:
        """The Transformer-XL position term for query i and key j, as an additive score bias `[B, H, Tq, Tk]`.

        bias[b, h, i, j] = scaling * q_i . (W_pk PE(j - i))_h, where i and j are indices into the key sequence
        (XL memory or cache first, then the current tokens; query t of this call sits at index query_offset + t).
        PE is `sinusoidal_embedding` of the signed relative position j - i (<= 0 for the visible past), W_pk is
        `position_key_proj` applied to PE and then split into heads, and `scaling = head_dim**-0.5` multiplies the
        term exactly as it multiplies q . k. This is the authors' convention (their code scales q and PE by
        head_dim**-0.25 each and takes `shift(q @ (PE W_pk^T)^T)`), without the u/v biases. Future keys (j > i)
        get the value of distance 0; the causal mask removes them.
        """
        query_length = query.shape[2]
        num_distances = key_length  # the largest distance seen is (last query) - (first key) <= key_length - 1
        by_distance = self.xl_distance_scores(query, num_distances)  # [B, H, Tq, distance]
        query_index = torch.arange(query_length, device=query.device) + query_offset
        key_index = torch.arange(key_length, device=query.device)
        distance = (query_index[:, None] - key_index[None, :]).clamp(0, num_distances - 1)  # [Tq, Tk]
        return by_distance.gather(-1, distance.expand(*by_distance.shape[:2], -1, -1))

    def xl_distance_scores(self, query: torch.Tensor, num_distances: int) -> torch.Tensor:
        """scaling * q . (W_pk PE(-r))_h for the distances r = 0 .. num_distances - 1: `[B, H, Tq, num_distances]`.

        Two orders of the same product: project every distance's encoding into key space (`W_pk PE`, right for
        many queries: training, prefill), or project the queries back into model space (`W_pk^T q`, then one
        matmul with the encodings: right for a few queries, i.e. decoding, where it skips the `num_distances x d x
        H*dh` projection of every step and layer). The encodings come from `past_sinusoidal_encoding`.
        """
        batch, heads, query_length, head_dim = query.shape
        encoding = past_sinusoidal_encoding(num_distances, self.config.hidden_size, query.dtype, query.device)
        encoding = encoding.to(query.dtype)  # [K, d]
        plain = type(self.position_key_proj) is nn.Linear  # not wrapped (an adapter's delta lives in its forward)
        if plain and batch * query_length * (head_dim + num_distances) < num_distances * head_dim:
            weight = self.position_key_proj.weight
            if hasattr(weight, "to_local"):  # tensor parallelism (colwise DTensor): this process's heads' rows
                weight = weight.to_local()
            weight = weight.view(heads, head_dim, -1)  # W_pk split into heads [H, dh, d]
            back = torch.einsum("bhqc,hcd->bhqd", query, weight)  # [B, H, Tq, d]
            return torch.matmul(back, encoding.t()) * self.scaling
        position_keys = self.position_key_proj(encoding).view(num_distances, heads, head_dim)
        return torch.einsum("bhqd,khd->bhqk", query, position_keys) * self.scaling

    def xl_paged_attention_mask(self, query: torch.Tensor, attention_mask: torch.Tensor | None,
                                distance: torch.Tensor) -> torch.Tensor:
        """Continuous batching with XL positions: the paged call's mask `[1, 1, Tq, Tk]` plus the XL bias.

        `distance` `[Tq, Tk]` comes from `paged_key_distances` (each request's own key positions in the paged
        cache). The bias is the one `xl_position_bias` defines, gathered at those distances, and it is folded into
        the additive mask so that every paged attention function (sdpa, eager) applies it. No host sync: the
        distances are bounded statically by the mask's key length Tk (a query of request r sits at most at
        position keys_of[r] - 1 <= Tk - 1, a key at position >= 0), so `xl_distance_scores` is asked for Tk
        distances whatever the packed requests are; entries beyond a request's own keys are masked anyway.
        """
        if attention_mask is None:
            raise ValueError(
                "position_encoding='xl' under continuous batching needs the materialised paged attention mask "
                "(attn_implementation 'sdpa' or 'eager'); flash/block-table paged attention cannot add the XL "
                "relative-position bias")
        num_distances = attention_mask.shape[-1]  # static bound (see above)
        by_distance = self.xl_distance_scores(query, num_distances)  # [1, H, Tq, distance]
        index = distance.clamp(0, num_distances - 1).expand(*by_distance.shape[:2], -1, -1)
        bias = by_distance.gather(-1, index)  # [1, H, Tq, Tk]
        if attention_mask.dtype == torch.bool:
            return torch.where(attention_mask, bias, torch.finfo(bias.dtype).min)
        return bias + attention_mask.to(bias.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        memory: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states `[B, T, d]` (normalised); memory `[B, M, d]` (normalised XL memory, or None) -> `[B, T, d]`.

        Memory tokens are extra sources: they give keys and (expert-mixed) values, never queries.
        """
        cache, kwargs = route_paged_cache(cache, kwargs)  # before 5.24 the paged attention function updates it
        batch, length, _ = hidden_states.shape
        heads_shape = (batch, length, -1, self.head_dim)  # -1: this process's heads under tensor parallelism
        sources = hidden_states if memory is None else torch.cat((memory, hidden_states), dim=1)  # [B, M + T, d]
        query = self.q_proj(hidden_states).view(heads_shape).transpose(1, 2)  # [B, H, T, dh]
        key = self.k_proj(sources).view(batch, sources.shape[1], -1, self.head_dim).transpose(1, 2)  # [B, H, M+T, dh]
        routed = self.joint_gates(hidden_states) if memory is None else None  # both routers in one matmul
        value = self.project_values(sources) if routed is None else self.project_values(sources, routed[0])
        value = value.transpose(1, 2)  # [B, H, M+T, dh], already expert-mixed
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query, key = apply_partial_rotary(query, cos, sin), apply_partial_rotary(key, cos, sin)

        query_offset = key.shape[2] - length  # index of the first query among the keys: the memory length
        if cache is not None:
            if not is_paged(cache):  # a paged cache's queries get their positions from the packed layout below
                query_offset = cache.get_seq_length(self.layer_idx)  # before the update: what it held
                if isinstance(query_offset, torch.Tensor):  # a static cache's counter, which `update` bumps in place
                    query_offset = query_offset.clone()
            key, value = update_cache(cache, key, value, self.layer_idx, kwargs)

        extra = {}
        paged_distance = None
        if self.position_encoding == "xl" and attention_mask is not None:
            paged_distance = paged_key_distances(kwargs, query.shape[2], attention_mask.shape[-1], query.device,
                                                 paged=is_paged_call(cache, kwargs))
        if paged_distance is not None:  # continuous batching: requests packed, keys read from the paged cache
            attention_mask = self.xl_paged_attention_mask(query, attention_mask, paged_distance)
        elif self.position_encoding == "xl":
            extra["position_bias"] = self.xl_position_bias(query, key.shape[2], query_offset)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attended, probs = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **extra,
            **kwargs,
        )  # attended: [B, T, H, dh]
        if routed is None:
            return self.project_output(attended.view(heads_shape), hidden_states), probs
        return self.project_output(attended.view(heads_shape), hidden_states, routed[1]), probs


class SwitchHeadAttention(SwitchHeadAttentionBase):
    """SwitchHead: sigma-MoE value and output projections, E experts per head, k active per head.

    `config.attention_expert_projections` ("value_output", the default) can make only one side a mixture of
    experts (the paper's Table 6 ablation): "value" keeps expert values and uses a dense, ungated output
    projection `o_proj` (H*dh -> d); "output" uses a dense value projection `v_proj` (d -> H*dh) and expert
    outputs. The dense side has no router.
    """

    is_transposed = True  # expert tensors are [experts, in, out] (Transformers' / PEFT's flag for that layout)

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        heads, experts, d = self.num_heads, config.num_attention_experts, config.hidden_size
        self.num_experts = experts
        self.top_k = config.num_attention_experts_per_tok
        projections = getattr(config, "attention_expert_projections", "value_output")
        self.expert_values = projections in ("value_output", "value")
        self.expert_output = projections in ("value_output", "output")
        selection_args = (d, heads, experts, self.top_k, config.attention_expert_dropout, False)
        if self.expert_values:
            self.value_selection = ExpertSelection(*selection_args)  # W_S: source side
        if self.expert_output:
            self.output_selection = ExpertSelection(*selection_args)  # W_D: destination side
        if self.expert_values:
            self.value_experts = nn.Parameter(torch.empty(heads * experts, d, self.head_dim))  # W_V [H*E, d, dh]
        else:
            self.v_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        if self.expert_output:
            self.output_experts = nn.Parameter(torch.empty(heads * experts, self.head_dim, d))  # W_O [H*E, dh, d]
        else:
            self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)
        self._both_experts = self.expert_values and self.expert_output
        self._by_size: dict[tuple, bool] = {}  # `per_head_experts`' choice by problem size
        self._config_attributes = vars(config)  # read by `per_head_experts` (the live attributes, not a copy)

    def per_head_experts(self, tokens: int, inputs: torch.Tensor, sides: tuple[str, ...]) -> bool:
        """Whether the projections of `sides` ("values", "output") over `tokens` tokens run as `head_expert_values`
        / `head_expert_output` (dense per-head gates, every expert of a head): where the configured experts
        implementation resolves to this file's "auto" choice and that choice is "all_experts" or "batched" (few
        tokens, or few experts per head); not for the explicit "batched_mm" / "grouped_mm", nor where the
        package's Triton kernels run. Called once or twice per layer and decoding step, so it is kept cheap: the
        choice by size is remembered per shape, and the configured implementation is read from the configuration's
        attributes directly (the property behind `config._experts_implementation` costs more than the decision)."""
        key = (tokens, sides, self.num_heads, inputs.dtype)
        # traced: worked out in the trace, the dict not read (dynamo would guard on its contents, and an eager call
        # that fills it later would make the compiled graph recompile)
        by_size = None if torch.compiler.is_compiling() else self._by_size.get(key)
        if by_size is None:  # a function of shapes and dtypes only: worked out once per key
            by_size = True
            heads, slots = self.num_heads, self.num_heads * self.top_k
            for side in sides:
                weight = self.value_experts if side == "values" else self.output_experts
                rows, out_groups = (1, heads) if side == "values" else (heads, 1)
                by_size &= choose_expert_implementation(tokens, slots, rows, out_groups, weight.shape[0], inputs,
                                                        weight) != "grouped"
            if not torch.compiler.is_compiling():
                self._by_size[key] = by_size
        if not by_size:
            return False
        requested = self._config_attributes.get("_experts_implementation_internal", _UNSET)
        if requested is _UNSET:
            requested = self.config._experts_implementation
        if EXPERTS_FORMULATIONS.get(requested, "auto") != "auto":
            return False
        if requested in EXPERTS_FORMULATIONS or _kernels is None:
            return True
        if inputs.device.type == "cpu" and not _TRITON_INTERPRET:  # no Triton on CPU: skip the (slow) look-up
            return True
        return _kernels.resolve_backend(inputs.device, inputs.dtype) != "triton"

    def joint_gates(self, hidden_states):
        """Dense per-head gates `[N, H, E]` of both sides from one router matmul (the two routers' weights stacked
        at call time), or None where the sides route themselves: one side dense, expert dropout active (its random
        draws keep their order), a router that needs its module call (hooks: recorded `router_logits` come from the
        routers' own calls; tensor parallelism's forward), `project_values` / `project_output` replaced on the
        instance (tensor parallelism), not the per-head formulation (`per_head_experts`), or more than one token.
        One token (batch-1 decoding) is where the saved matmul counts; for more rows the stacked matmul is not
        bitwise the two per-side ones, and a training step must not depend on how its batch is split over
        processes (FSDP: 128 rows per process against 256 in one flipped a near-tie in a top-k, test_fsdp.py)."""
        if hidden_states.shape[:-1].numel() != 1:
            return None
        if not self._both_experts or "project_values" in self.__dict__ or "project_output" in self.__dict__:
            return None
        values, output = self._modules["value_selection"], self._modules["output_selection"]
        if (self.training and values.expert_dropout > 0) or values.needs_call() or output.needs_call():
            return None
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        if not self.per_head_experts(tokens.shape[0], tokens, ("values", "output")):
            return None
        _, gates, index = values.select(F.linear(tokens, torch.cat((values.weight, output.weight))))
        dense = _scatter_group_gates(gates, index, self.num_experts, tokens.dtype)
        return dense[:, :self.num_heads], dense[:, self.num_heads:]

    def _dense_gates(self, selection: ExpertSelection, tokens: torch.Tensor) -> torch.Tensor:
        """One side's dense per-head gates `[N, H, E]`, through the module call where it needs one."""
        if selection.needs_call():
            _, gates, index = selection(tokens)
            return dense_head_gates(index, gates, self.num_heads, self.num_experts, tokens.dtype)
        _, gates, index = selection.select(F.linear(tokens, selection.weight))
        return _scatter_group_gates(gates, index, self.num_experts, tokens.dtype)

    def project_values(self, hidden_states, gates=None):
        """`gates`: dense per-head gates `[N, H, E]` from `joint_gates`, or None (route here)."""
        batch, length, d = hidden_states.shape
        if not self.expert_values:
            return self.v_proj(hidden_states).view(batch, length, -1, self.head_dim)
        tokens = hidden_states.reshape(-1, d)
        if gates is None and self.per_head_experts(tokens.shape[0], tokens, ("values",)):
            gates = self._dense_gates(self.value_selection, tokens)
        if gates is not None:
            values = head_expert_values(tokens, gates, self.value_experts)
            return values.reshape(batch, length, self.num_heads, self.head_dim)
        _, gates, index = self.value_selection(tokens)
        project = expert_projection_for(self.config._experts_implementation)
        values = project(tokens.unsqueeze(1), index, self.value_experts, gates, out_groups=self.num_heads)
        return values.view(batch, length, self.num_heads, self.head_dim)

    def project_output(self, attended, hidden_states, gates=None):
        """`gates`: dense per-head gates `[N, H, E]` from `joint_gates`, or None (route here)."""
        batch, length, d = hidden_states.shape
        if not self.expert_output:
            return self.o_proj(attended.reshape(batch, length, -1))
        tokens = hidden_states.reshape(-1, d)
        rows = attended.reshape(-1, self.num_heads, self.head_dim)
        if gates is None and self.per_head_experts(rows.shape[0], rows, ("output",)):
            gates = self._dense_gates(self.output_selection, tokens)
        if gates is not None:
            return head_expert_output(rows, gates, self.output_experts).view(batch, length, -1)
        _, gates, index = self.output_selection(tokens)
        # one weighted sum over all heads and their selected experts
        project = expert_projection_for(self.config._experts_implementation)
        return project(rows, index, self.output_experts, gates, out_groups=1).view(batch, length, -1)


class MultiHeadAttention(SwitchHeadAttentionBase):
    """The dense baseline: plain multi-head attention with dense value and output projections.

    With `config.attention_output_gate`, each head's result is scaled by `sigmoid(x_dst W_gate^T)[h]` before the
    output projection: the authors' SwitchHead module with E = 1 (no value-side gate, no top-k).
    """

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        inner = self.num_heads * self.head_dim
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)
        # W_gate [H, d]: the reference's `sel_o` with one expert per head
        self.output_gate = nn.Parameter(torch.empty(self.num_heads, config.hidden_size)) \
            if config.attention_output_gate else None

    def project_values(self, hidden_states):
        return self.v_proj(hidden_states).view(*hidden_states.shape[:2], -1, self.head_dim)

    def project_output(self, attended, hidden_states):
        if self.output_gate is not None:
            attended = attended * torch.sigmoid(F.linear(hidden_states, self.output_gate)).unsqueeze(-1)  # [B,T,H,dh]
        return self.o_proj(attended.flatten(2))


ATTENTION_CLASSES = {"switchhead": SwitchHeadAttention, "dense": MultiHeadAttention}


# ==================================================================================================== MLPs
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
    `model.set_experts_implementation(...)`): "eager" is this forward (the PyTorch formulations of
    `expert_projection_torch`), "batched_mm" / "grouped_mm" Transformers' functions, "cvmm" our kernels (registered
    when the switchhead package is imported). The flags say what those functions need to know: no gated (GLU)
    projection, no biases, and weights stored `[experts, in, out]` (is_transposed): `keys` `[E, d, S]` is their
    up projection, `values` `[E, S, d]` their down projection (checkpoint names stay `keys` / `values`).
    """

    def __init__(self, config: SwitchHeadConfig):
        super().__init__()
        d, experts, size = config.hidden_size, config.num_mlp_experts, config.mlp_expert_size
        self.num_experts = experts
        self.keys = nn.Parameter(torch.empty(experts, d, size))  # [E, d, S]
        self.values = nn.Parameter(torch.empty(experts, size, d))  # [E, S, d]
        self.act_fn = _ACTIVATIONS[config.hidden_act]

    @property
    def up_proj(self) -> torch.Tensor:  # the name Transformers' experts functions read
        return self.keys

    @property
    def down_proj(self) -> torch.Tensor:
        return self.values

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        """hidden_states `[N, d]`, top_k_index `[N, k]` (experts), top_k_weights `[N, k]` (gates) -> `[N, d]`."""
        tokens = hidden_states.unsqueeze(1)
        inner = self.act_fn(expert_projection_torch(tokens, top_k_index, self.keys))  # [N, k, S]
        out = expert_projection_torch(inner, top_k_index, self.values, top_k_weights, out_groups=1)
        return out.view(hidden_states.shape)


class SigmaMoeMLP(SigmaMoeExperts):
    """SwitchAll's sigma-MoE: y = sum_{e in topk(s)} s_e * act(x keys_e) values_e, s = sigmoid(x W_sel^T).

    The router (`expert_selection`) picks each token's experts; the experts run as `SigmaMoeExperts` says.
    """

    is_transposed = True  # keys [E, d, S] and values [E, S, d] are [experts, in, out]

    def __init__(self, config: SwitchHeadConfig):
        super().__init__(config)
        self.top_k = config.num_mlp_experts_per_tok
        self.expert_selection = ExpertSelection(config.hidden_size, 1, config.num_mlp_experts, self.top_k,
                                                config.mlp_expert_dropout, True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        _, gates, index = self.expert_selection(tokens)
        return self.run_experts(tokens, index, gates).view(shape)

    def run_experts(self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                    ) -> torch.Tensor:
        """The experts part of `forward` (after the router): what tensor parallelism ("switchhead_sigma_moe") splits."""
        return super().forward(tokens, top_k_index, top_k_weights)


class _ReluFromOutput(torch.autograd.Function):
    """ReLU whose backward multiplies by the sign of its output (1 where it passed, 0 where it clipped): the same
    gradient as `F.relu`'s (which masks `output <= 0`), written so that AOTAutograd's partitioner keeps only the
    output, which the next projection's weight gradient needs anyway, and recomputes the mask in the fused backward
    kernel. Given `F.relu`, its default partitioner makes the forward also store a boolean mask, and inductor's CPU
    kernels for storing and reading it made the compiled 47M training steps slower than eager
    (benchmarks/inductor_relu_mask.py, bench_compiled_train.py)."""

    @staticmethod
    def forward(ctx, inputs):
        output = torch.relu(inputs)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad):
        (output,) = ctx.saved_tensors
        return grad * output.sign()


def relu(inputs: torch.Tensor) -> torch.Tensor:
    """`F.relu`; while torch.compile traces a function that autograd records, `_ReluFromOutput` (same values, same
    gradient; eager keeps ATen's own relu and its backward)."""
    if torch.compiler.is_compiling() and torch.is_grad_enabled() and inputs.requires_grad:
        return _ReluFromOutput.apply(inputs)
    return F.relu(inputs)


_ACTIVATIONS = {"relu": relu, "gelu": F.gelu, "silu": F.silu}
MLP_CLASSES = {"dense": SwitchHeadMLP, "sigma_moe": SigmaMoeMLP}


# ==================================================================================================== tensor parallelism
# `config.base_model_tp_plan` shards the dense projections with Transformers' own styles (colwise / rowwise) and the
# per-head tensors that are not nn.Linear (SwitchHead's V/O experts [H*E, ...], its routers W_S / W_D [H*E, d], the
# dense baseline's output gate [H, d]) with the one style below, "switchhead_heads": each process owns whole heads.
try:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, MoeExpertsParallel, TensorParallelLayer
except ImportError:  # no torch.distributed (or an older Transformers): no tensor parallelism, nothing else changes
    TensorParallelLayer = None

if TensorParallelLayer is not None:

    class _SumGradients(torch.autograd.Function):
        """Identity forward, all-reduce (sum) backward: the input of a per-head computation (Megatron's `f`)."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class _SumOutputs(torch.autograd.Function):
        """All-reduce (sum) forward, identity backward: the per-head partial sums of a layer output (Megatron's `g`)."""

        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class HeadParallel(TensorParallelLayer):
        """Tensor-parallel style "switchhead_heads": per-head tensors split by heads, computed on local shards.

        Parameters (every direct parameter of the module it is planned on) are split along dim 0, whose rows are
        grouped by head (`[H*E, ...]` experts and routers, `[H, d]` gate): a process owns whole heads, so its
        expert ids (head * E + e within its heads) index its local rows. On an `ExpertSelection` (a router) the
        forward runs on the local rows: logits, top-k and gates of this process's heads only. On an attention
        layer its `project_values` / `project_output` run on local tensors, `num_heads` becomes the local count,
        and the input the per-head tensors read (`hidden_states`) sums its gradient over processes (`f`); with
        output experts the result is this process's heads' part of the sum over heads, summed over processes
        (`g`), while a layer with an `o_proj` (planned rowwise) leaves that sum to it. Q/K/V/W_pk are colwise and
        o_proj rowwise (Transformers' styles), so attention itself runs on local heads with no collective.
        """

        def should_use_local_tensors(self, module):
            return True

        def shard_param(self, module, param, mesh):
            meta = module._parameters.get(param)
            if meta is None:
                return
            if meta.shape[0] % mesh.size():
                raise ValueError(f"{param} has {meta.shape[0]} rows: not divisible by the tensor-parallel size "
                                 f"{mesh.size()} (the number of heads must be)")
            module._parameters[param] = nn.Parameter(distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None),
                                                     requires_grad=meta.requires_grad)

        def install_forward(self, module, mesh):
            if not hasattr(module, "project_output"):
                return super().install_forward(module, mesh)  # a router: local rows, local forward
            if module.num_heads % mesh.size():
                raise ValueError(f"{module.num_heads} attention heads do not split over {mesh.size()} processes")
            module.num_heads //= mesh.size()
            own = module._parameters
            if own.get("value_experts") is not None:
                module.project_values = self._local(module, module.project_values, mesh, sum_output=False)
            if own.get("output_experts") is not None or own.get("output_gate") is not None:
                module.project_output = self._local(module, module.project_output, mesh,
                                                    sum_output=not isinstance(getattr(module, "o_proj", None),
                                                                              nn.Linear))
            return module

        def _local(self, module, method, mesh, sum_output):
            group = mesh.get_group()

            def run(*args):
                *rest, hidden_states = args
                if torch.is_grad_enabled() and hidden_states.requires_grad:
                    hidden_states = _SumGradients.apply(hidden_states, group)
                with self.context_around_forward(module, mesh):
                    out = method(*rest, hidden_states)
                return _SumOutputs.apply(out, group) if sum_output else out

            return run

    class SigmaMoeParallel(MoeExpertsParallel):
        """Tensor-parallel style "switchhead_sigma_moe": Transformers' "moe_tp_experts" on `SigmaMoeMLP.run_experts`.

        The router (`expert_selection`) stays replicated and outside: every process picks the same global top-k
        and gets the router's full gradient (the entropy regulariser's included, counted once). The experts call
        runs on this process's slice of each expert's hidden size (`keys` / `values` sharded by the plan), its
        input and gates sum their gradients over processes, and its output (a partial sum over the slices) is
        all-reduced: `MoeExpertsParallel`'s transforms, around `run_experts` instead of the whole `forward`.
        """

        def install_forward(self, module, mesh):
            experts = module.run_experts

            def run(*args, **kwargs):
                args, kwargs = self.transform_inputs_pre_forward(module, args, kwargs, mesh)
                with self.context_around_forward(module, mesh):
                    out = experts(*args, **kwargs)
                return self.transform_output_post_forward(module, out, mesh)

            module.run_experts = run
            return module

    ALL_PARALLEL_STYLES.register("switchhead_heads", HeadParallel())
    ALL_PARALLEL_STYLES.register("switchhead_sigma_moe", SigmaMoeParallel())


# ==================================================================================================== blocks
class SwitchHeadDecoderLayer(GradientCheckpointingLayer):
    """Pre-LayerNorm block: x + drop(attn(LN(x))), then x + drop(mlp(LN(x))).

    With XL memory (the detached inputs of this block on the previous segment, `[B, M, d]`), attention also reads
    LN(memory), normalised by the same LayerNorm, as in the authors' code.
    """

    def __init__(self, config: SwitchHeadConfig, layer_idx: int):
        super().__init__()
        self.self_attn = ATTENTION_CLASSES[config.attention_type](config, layer_idx)
        self.mlp = MLP_CLASSES[config.mlp_type](config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    @accepts_past_key_values
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        memory: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        attended, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            memory=self.input_layernorm(memory) if memory is not None else None,
            **kwargs,
        )
        hidden_states = hidden_states + self.dropout(attended)
        return hidden_states + self.dropout(self.mlp(self.post_attention_layernorm(hidden_states)))


AUTO_MAP = {
    "AutoConfig": "configuration_switchhead.SwitchHeadConfig",
    "AutoModel": "modeling_switchhead.SwitchHeadModel",
    "AutoModelForCausalLM": "modeling_switchhead.SwitchHeadForCausalLM",
}


class SwitchHeadPreTrainedModel(PreTrainedModel):
    config_class = SwitchHeadConfig
    config: SwitchHeadConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SwitchHeadDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]  # the cache's name from Transformers 5.24; before
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = False  # XL needs an additive score bias; RoPE SwitchHead would work, but is untested
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # no host syncs, static shapes; output hooks installed at construction
    _can_record_outputs = {
        "router_logits": OutputRecorder(ExpertSelection, index=0),
        "hidden_states": SwitchHeadDecoderLayer,
        "attentions": [OutputRecorder(SwitchHeadAttention, index=1), OutputRecorder(MultiHeadAttention, index=1)],
    }

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Transformers' check, with our default: "cvmm" (our kernels) once the switchhead package registered it,
        else "eager" (this file's sync-free PyTorch path), rather than Transformers' "grouped_mm"."""
        if requested_experts is None:
            requested_experts = "cvmm" if "cvmm" in ALL_EXPERTS_FUNCTIONS else "eager"
        return super().get_correct_experts_implementation(requested_experts)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, with an `auto_map` for all three Auto classes.

        Transformers records only the saved class; we add the others so that one folder serves AutoConfig,
        AutoModel and AutoModelForCausalLM with `trust_remote_code=True` (the model files are copied beside it).
        """
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The paper's initialisation, scaled by `config.init_scale` (default sqrt(2 / num_hidden_layers))."""
        config = self.config
        scale, d = config.init_scale, config.hidden_size
        # Dense projections (q, k, W_pk, the baseline's v and o, the dense MLP) are nn.Linear children and get
        # std init_scale / sqrt(fan_in) in the nn.Linear branch below; here only the tensors that are not Linear.
        if isinstance(module, SwitchHeadAttention):
            # a dense side of the V-only / O-only ablation (v_proj, o_proj) is an nn.Linear child: the same std
            # as its expert tensor would get (init_scale / sqrt(fan_in)), from the nn.Linear branch below
            if module.expert_values:
                init.normal_(module.value_experts, std=scale / math.sqrt(d))
            if module.expert_output:
                init.normal_(module.output_experts, std=scale / math.sqrt(module.num_heads * module.head_dim))
            for selection in (getattr(module, "value_selection", None), getattr(module, "output_selection", None)):
                if selection is not None:
                    _init_selection(selection.weight, std=scale / math.sqrt(d))
        elif isinstance(module, MultiHeadAttention):
            if module.output_gate is not None:  # a selection matrix in the reference: rows renormalised
                _init_selection(module.output_gate, std=scale / math.sqrt(d))
        elif isinstance(module, SigmaMoeMLP):
            experts, size = module.keys.shape[0], module.keys.shape[2]
            init.normal_(module.keys, std=scale / math.sqrt(d))
            init.normal_(module.values, std=scale / math.sqrt(experts * size))
            _init_selection(module.expert_selection.weight, std=scale / math.sqrt(d))
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, std=1.0 / math.sqrt(d))
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, nn.Linear) and module is getattr(self, "lm_head", None):
            init.normal_(module.weight, std=1.0 / math.sqrt(d))
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):
            # q, k, W_pk (left uninitialised by the public reference; not here), v, o and the dense MLP: the paper's
            # std init_scale / sqrt(fan_in). Transformers visits these Linear children itself (it never passes
            # parameter-less containers such as SwitchHeadMLP to `_init_weights`).
            init.normal_(module.weight, std=scale / math.sqrt(module.in_features))
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, SwitchHeadRotaryEmbedding):  # not saved: rebuilt from the config after loading
            module.reset_frequencies()
        elif isinstance(module, ExpertSelection):
            module.group_offsets.copy_(torch.arange(module.num_groups, device=module.group_offsets.device)
                                       * module.num_experts)


def _init_selection(weight: torch.Tensor, std: float) -> None:
    """Normal init, each row scaled to unit norm, then the whole tensor rescaled to the std it had."""
    init.normal_(weight, std=std)
    if getattr(weight, "_is_hf_initialized", False):
        return
    drawn_std = weight.std()
    weight.div_(weight.norm(dim=-1, keepdim=True)).mul_(drawn_std / weight.std())


@dataclass
class SwitchHeadModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    xl_memory (`list[torch.Tensor]`, *optional*):
        One detached `[B, M, d]` tensor per layer: the last `config.xl_memory_length` positions of that layer's
        input hidden states (previous memory, then this segment). Pass it as `xl_memory=` with the next segment.
        Returned for XL models with `xl_memory_length > 0` when called without a KV cache (`use_cache=False`).
    """

    xl_memory: list[torch.Tensor] | None = None


@dataclass
class SwitchHeadCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    xl_memory (`list[torch.Tensor]`, *optional*):
        The XL memory for the next segment; see `SwitchHeadModelOutputWithPast.xl_memory`.
    """

    xl_memory: list[torch.Tensor] | None = None


def create_xl_memory_mask(
    config: SwitchHeadConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    memory_length: int,
):
    """The paper's masking with XL memory, in the format of the configured attention backend.

    Query t (of T) sees all `memory_length` memory positions and the current positions <= t: the causal mask of
    queries placed at key indices M..M+T-1, like a cache prefix. `attention_mask` is a 2D padding mask over the
    current tokens `[B, T]` (memory all valid) or over memory and current tokens `[B, M + T]`; a 4D mask is
    returned unchanged. The mask is always materialised, so that no backend falls back to its own causal mask
    (sdpa's `is_causal` aligns to the top-left and would hide the memory from the first queries).
    """
    batch, length = inputs_embeds.shape[:2]
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[-1] not in (length, memory_length + length):
            raise ValueError(
                f"with xl_memory, attention_mask must be 2D [batch, {length}] (current tokens) or "
                f"[batch, {memory_length + length}] (memory then current tokens), got {tuple(attention_mask.shape)}"
            )
        attention_mask = attention_mask.to(device=inputs_embeds.device, dtype=torch.bool)
        if attention_mask.shape[-1] == length:
            attention_mask = F.pad(attention_mask, (memory_length, 0), value=True)
    if config._attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"xl_memory needs attn_implementation 'eager', 'sdpa' or 'flex_attention', "
            f"got {config._attn_implementation!r}"
        )
    return ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation](
        batch_size=batch,
        q_length=length,
        kv_length=memory_length + length,
        q_offset=memory_length,
        kv_offset=0,
        mask_function=causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        dtype=inputs_embeds.dtype,
        config=config,
        device=inputs_embeds.device,
    )


class SwitchHeadModel(SwitchHeadPreTrainedModel):
    """The decoder stack: token embedding, `num_hidden_layers` pre-LN blocks, final LayerNorm."""

    def __init__(self, config: SwitchHeadConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.embed_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(
            [SwitchHeadDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        rope_type = (config.rope_parameters or {}).get("rope_type", "default")
        if config.position_encoding != "rope" and rope_type != "default":
            raise ValueError(
                f"rope_parameters['rope_type']={rope_type!r} needs position_encoding='rope'; this model uses "
                f"{config.position_encoding!r} positions (no RoPE to scale): drop the RoPE scaling"
            )
        self.rotary_emb = SwitchHeadRotaryEmbedding(config) if config.position_encoding == "rope" else None
        self.gradient_checkpointing = False
        self.post_init()
        # SwitchAll's training forward records its router logits (entropy loss) through Transformers' output hooks,
        # which `capture_outputs` installs on the first recording call under a threading lock that
        # torch.compile(fullgraph=True) cannot enter: install them now, in eager code. (Mixtral escapes this only
        # because it records nothing unless asked.) Only where a plain training step records something: installed
        # hooks stop a submodule from compiling on its own (they read a ContextVar), so the others stay hook-free.
        install_hooks = getattr(output_capturing, "maybe_install_capturing_hooks", None)
        records = config.mlp_type == "sigma_moe" and config.entropy_reg_coef > 0
        if install_hooks is not None and (records or config.output_router_logits):
            install_hooks(self)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _embed(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """The token embeddings. An id outside the vocabulary raises a ValueError naming the vocabulary size on
        the CPU (the embedding's IndexError, caught: no extra check), in forward and so in `generate`. On CUDA (and
        under torch.compile) nothing is checked, because a check would synchronise with the host on every step:
        the embedding kernel's device-side assert fires instead ("CUDA error: device-side assert triggered"), which
        leaves the CUDA context unusable; check ids on the host before moving them to the GPU."""
        if input_ids.device.type != "cpu" or torch.compiler.is_compiling():
            return self.embed_tokens(input_ids)
        try:
            return self.embed_tokens(input_ids)
        except IndexError:
            raise ValueError(
                f"input_ids holds token ids outside the vocabulary: every id must be in [0, vocab_size="
                f"{self.config.vocab_size}) (min {int(input_ids.min())}, max {int(input_ids.max())})"
            ) from None

    @accepts_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        xl_memory: list[torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SwitchHeadModelOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The key-value cache (also accepted as `past_key_values`, its name before Transformers 5.24).
        xl_memory (`list[torch.Tensor]`, *optional*):
            Transformer-XL memory: one `[B, M, d]` tensor per layer, the `xl_memory` of the previous segment's
            output. Every query of this segment attends to all M memory positions, and relative positions continue
            across the boundary. Only for `position_encoding="xl"` and without a KV cache (`use_cache=False`).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        given = input_ids if input_ids is not None else inputs_embeds
        name, layout, dims = ("input_ids", "[batch, length]", 2) if input_ids is not None else (
            "inputs_embeds", "[batch, length, hidden_size]", 3)
        if given.dim() != dims:  # shape checks only: no host sync
            hint = f" (one sequence: add a batch dimension, {name}[None])" if given.dim() == dims - 1 else ""
            raise ValueError(f"{name} must be shaped {layout}, got shape {tuple(given.shape)}{hint}")
        if given.shape[0] == 0 or given.shape[1] == 0:
            raise ValueError(f"{name} is empty (shape {tuple(given.shape)}): give at least one token per sequence, "
                             f"shaped {layout}")
        if xl_memory is not None:
            batch = (input_ids if input_ids is not None else inputs_embeds).shape[0]
            self._check_xl_memory(xl_memory, batch, use_cache, cache)
        cache, kwargs = route_paged_cache(cache, kwargs)
        if use_cache and cache is None and not is_paged_call(cache, kwargs):
            cache = DynamicCache(config=self.config)
        # memory is for segment-by-segment calls without a KV cache (use_cache=False): decoding keeps its own state
        keep_memory = (self.config.position_encoding == "xl" and self.config.xl_memory_length > 0 and cache is None
                       and not is_paged_call(cache, kwargs))
        if inputs_embeds is None:
            inputs_embeds = self._embed(input_ids)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen)[None]

        memory_length = xl_memory[0].shape[1] if xl_memory is not None else 0
        if memory_length > 0:
            causal_mask = create_xl_memory_mask(self.config, inputs_embeds, attention_mask, memory_length)
        else:
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_kwarg(cache),
            )
        new_memory = [] if keep_memory else None
        hidden_states = self.embed_dropout(inputs_embeds)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None
        for layer_idx, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            memory = xl_memory[layer_idx].to(hidden_states) if memory_length > 0 else None
            if keep_memory:  # this layer's input, as the authors keep it: before the LayerNorm, detached
                inputs = hidden_states if memory is None else torch.cat((memory, hidden_states), dim=1)
                new_memory.append(inputs[:, -self.config.xl_memory_length :].detach())
            hidden_states = decoder_layer(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=causal_mask,
                memory=memory,
                **cache_kwarg(cache),  # by the release's name: GradientCheckpointingLayer drops it when training
                use_cache=use_cache,
                position_ids=position_ids,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return SwitchHeadModelOutputWithPast(
            last_hidden_state=hidden_states, xl_memory=new_memory, **cache_kwarg(cache)
        )

    def _check_xl_memory(self, xl_memory, batch: int, use_cache, cache) -> None:
        """Reject XL memory that does not fit this model or call, saying what to change."""
        config = self.config
        if config.position_encoding != "xl":
            raise ValueError(f"xl_memory needs position_encoding='xl', this model uses {config.position_encoding!r}")
        if use_cache or cache is not None:
            raise ValueError(
                "xl_memory cannot be combined with a KV cache: pass use_cache=False (and no cache); "
                "generation continues a sequence through the KV cache instead"
            )
        if not isinstance(xl_memory, (list, tuple)) or len(xl_memory) != config.num_hidden_layers:
            raise ValueError(
                f"xl_memory must be a list of {config.num_hidden_layers} tensors (one per layer), got "
                f"{type(xl_memory).__name__} of length {len(xl_memory) if hasattr(xl_memory, '__len__') else '?'}"
            )
        shape = tuple(xl_memory[0].shape)
        if len(shape) != 3 or shape[0] != batch:
            raise ValueError(f"xl_memory tensors must be [batch={batch}, memory_length, d], got {shape}")
        for layer_idx, memory in enumerate(xl_memory):
            if memory.dim() != 3 or memory.shape[-1] != config.hidden_size or tuple(memory.shape) != shape:
                raise ValueError(
                    f"xl_memory[{layer_idx}] must have shape [batch, memory_length, {config.hidden_size}] like "
                    f"xl_memory[0] {shape}, got {tuple(memory.shape)}"
                )


def sigma_moe_entropy_loss(
    mlp_router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The sigma-MoE regulariser: sum over layers of sum_e p_e log p_e, p = mean over tokens of softmax(logits).

    Minimising it maximises the entropy of the batch's average expert distribution (balanced usage). Padding
    tokens (attention_mask == 0) are left out of the mean.
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


class SwitchHeadForCausalLM(SwitchHeadPreTrainedModel, GenerationMixin):
    """SwitchHead / SwitchAll language model: the decoder stack plus an (untied, biased) output layer."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # tensor parallelism: vocabulary rows split, logits gathered

    def __init__(self, config: SwitchHeadConfig):
        super().__init__(config)
        self.model = SwitchHeadModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def mlp_router_logits(self, router_logits: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The sigma-MoE routers among all recorded ones (each block records value, output, then MLP router)."""
        if self.config.mlp_type != "sigma_moe" or not router_logits:
            return ()
        per_layer = self.config.routers_per_layer
        return tuple(router_logits[per_layer - 1 :: per_layer])

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        xl_memory: list[torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SwitchHeadCausalLMOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The key-value cache (also accepted as `past_key_values`, its name before Transformers 5.24).
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Token ids for the language-modelling loss (shifted inside; -100 is ignored). In training, the sigma-MoE
            entropy regulariser times `config.entropy_reg_coef` is added to the loss.
        output_router_logits (`bool`, *optional*):
            Return the logits of every expert router (value, output and sigma-MoE selections) and `aux_loss`.
        logits_to_keep (`int` or `torch.Tensor`, *optional*):
            Compute logits only for the last `logits_to_keep` positions (or the given indices); 0 keeps all.
        xl_memory (`list[torch.Tensor]`, *optional*):
            Transformer-XL memory from the previous segment's output (`out.xl_memory`), with `use_cache=False`:
            `out = model(input_ids=seg, labels=seg, xl_memory=mem, use_cache=False); mem = out.xl_memory`.
        """
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        regularise = self.training and self.config.mlp_type == "sigma_moe" and self.config.entropy_reg_coef > 0
        outputs: SwitchHeadModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            xl_memory=xl_memory,
            output_router_logits=output_router_logits or regularise,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)

        aux_loss = None
        mlp_logits = self.mlp_router_logits(outputs.router_logits or ())
        if mlp_logits:
            aux_loss = sigma_moe_entropy_loss(mlp_logits, attention_mask)
            if loss is not None and regularise:
                loss = loss + self.config.entropy_reg_coef * aux_loss.to(loss.device)

        return SwitchHeadCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            **cache_kwarg(output_cache(outputs)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits if output_router_logits else None,
            xl_memory=outputs.xl_memory,
        )


__all__ = [
    "SwitchHeadPreTrainedModel",
    "SwitchHeadModel",
    "SwitchHeadForCausalLM",
    "SwitchHeadAttention",
    "MultiHeadAttention",
    "SigmaMoeMLP",
    "ExpertSelection",
    "expert_projection",
    "expert_projection_torch",
    "sigma_moe_entropy_loss",
    "SwitchHeadModelOutputWithPast",
    "SwitchHeadCausalLMOutputWithPast",
]
