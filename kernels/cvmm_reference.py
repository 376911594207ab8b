"""The CVMM op in plain PyTorch: the CPU implementation, the reference twin of `cvmm_triton.py`, and its checks.

Everything here is free of host syncs (no `.item()`, `.tolist()`, data-dependent shapes): for a given input shape
every tensor has a fixed shape, so `torch.compile(fullgraph=True)` traces it and a decoding step never waits on
the host. Two families live here:

- `expert_projection(inputs, expert_index, weight, gates=None, out_groups=1, implementation="auto")`, the op in
  plain tensor ops (autograd derives the backward), which `cvmm.cvmm` runs on CPU so that inductor sees ordinary
  ops. Formulations (`IMPLEMENTATIONS`):
    * "reference": gather each slot's matrix, `[N, S, d_in, d_out]`, and one einsum: obviously right, memory
      hungry; the twin every other formulation is tested against;
    * "batched": gather the selected matrices and one `bmm` (the gated sum folded into the matmul);
    * "all_experts": every input row times every expert (one broadcast matmul), then pick the selected rows:
      G / k times the FLOPs, but no weight copy and few ops, the fastest for a handful of tokens (decoding);
    * "grouped": slots sorted by expert and one grouped matmul (`torch._grouped_mm`) over the contiguous blocks,
      gated rows added into the output with `index_add_`: the training path. It needs a float32 / bfloat16 /
      float16 build of `_grouped_mm` and 16-byte aligned rows; elsewhere (float64, odd sizes, old torch) it runs
      as "all_experts";
    * "auto": "all_experts" while rows x experts <= `SMALL_PROBLEM_ROWS`, else "grouped".
- `cvmm_forward_reference` / `cvmm_backward_reference`: the bodies of the `switchhead::cvmm_forward/backward`
  custom ops on CPU, on slots already sorted by expert (`sorted_expert`, `order` from `cvmm.sort_slots`), with the
  backward written out: three matmuls (the gate gradient reuses the input-gradient product, as the Triton kernel
  does) and in-place `index_add_` into one buffer.

Notation (shared with `cvmm_triton.py`): N tokens, S slots per token, M = N * S slots in all, flat slot
`m = n * S + s`. Slot m reads input row `m // (S // R)` of `inputs.view(N * R, d_in)` and, with gates, adds into
output row `m // (S // out_groups)` of `out.view(N * out_groups, d_out)`.

Index validation costs no sync either: an expert id outside `[0, G)` makes an `index_select` on the CPU raise
IndexError (every formulation reads through one); `cvmm.cvmm` turns it into a ValueError naming the range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IMPLEMENTATIONS = ("auto", "reference", "batched", "all_experts", "grouped")
# "auto" computes every expert for every row while N * R * G stays below this (decoding and small batches)
SMALL_PROBLEM_ROWS = 4096
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_usable(dtype: torch.dtype, d_in: int, d_out: int, device_type: str = "cpu") -> bool:
    """Whether `torch._grouped_mm` takes `[M, d_in] x [G, d_in, d_out]` of `dtype`: supported, 16-byte aligned.

    Only CPU tensors use it: on GPUs its support depends on the architecture (CUDA tensors normally take the
    Triton kernels anyway), so other devices run the "all_experts" formulation instead.
    """
    if _GROUPED_MM is None or dtype not in _GROUPED_DTYPES or device_type != "cpu":
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False  # torch 2.13's fake (meta) kernel of _grouped_mm accepts bf16 only: no fp32/fp16 under compile
    per_16_bytes = 16 // torch.empty(0, dtype=dtype).element_size()
    return d_in % per_16_bytes == 0 and d_out % per_16_bytes == 0


def _slot_rows(inputs: torch.Tensor, slots: int) -> torch.Tensor:
    """Input row of every slot, `[N * R, d_in]` -> `[N, S, d_in]` (a broadcast view, no copy)."""
    n, r, d_in = inputs.shape
    return inputs.unsqueeze(2).expand(n, r, slots // r, d_in).reshape(n, slots, d_in)


def _gated_sum(per_slot: torch.Tensor, gates: torch.Tensor | None, out_groups: int) -> torch.Tensor:
    """`[N, S, d_out]` -> itself without gates, else each slot times its gate, summed per output group."""
    if gates is None:
        return per_slot
    n, slots, d_out = per_slot.shape
    weighted = per_slot * gates.unsqueeze(-1).to(per_slot.dtype)
    return weighted.view(n, out_groups, slots // out_groups, d_out).sum(2)


def _reference(inputs, expert_index, weight, gates, out_groups):
    matrices = weight.index_select(0, expert_index.reshape(-1)).view(*expert_index.shape, *weight.shape[1:])
    per_slot = torch.einsum("nsi,nsio->nso", _slot_rows(inputs, expert_index.shape[1]), matrices)
    return _gated_sum(per_slot, gates, out_groups)


def _batched(inputs, expert_index, weight, gates, out_groups):
    n, slots = expert_index.shape
    d_in, d_out = weight.shape[1], weight.shape[2]
    matrices = weight.index_select(0, expert_index.reshape(-1))  # [M, d_in, d_out]
    rows = _slot_rows(inputs, slots)
    if gates is None:
        return torch.bmm(rows.reshape(n * slots, 1, d_in), matrices).view(n, slots, d_out)
    # the gated sum inside the matmul: [gate_s x_s]_s (concatenated) times [W_s]_s (stacked), per output group
    rows = rows * gates.unsqueeze(-1).to(rows.dtype)
    per_group = slots // out_groups
    out = torch.bmm(rows.reshape(n * out_groups, 1, per_group * d_in),
                    matrices.view(n * out_groups, per_group * d_in, d_out))
    return out.view(n, out_groups, d_out)


def _all_experts(inputs, expert_index, weight, gates, out_groups):
    n, r, d_in = inputs.shape
    slots = expert_index.shape[1]
    g, _, d_out = weight.shape
    every = torch.matmul(inputs.reshape(1, n * r, d_in), weight)  # [G, N * R, d_out]
    row_of_slot = (torch.arange(n, device=inputs.device)[:, None] * r
                   + torch.arange(slots, device=inputs.device)[None, :] // (slots // r))  # [N, S]
    pick = (expert_index * (n * r) + row_of_slot).reshape(-1)  # out of range iff an expert id is
    per_slot = every.reshape(g * n * r, d_out).index_select(0, pick).view(n, slots, d_out)
    return _gated_sum(per_slot, gates, out_groups)


def _sorted_slots(expert_index: torch.Tensor, num_experts: int):
    """(sorted experts `[M]`, slot of each sorted position `[M]`, group ends `[G]` int32), all on the device."""
    flat = expert_index.reshape(-1)
    # reading through a [G] table bounds-checks the ids without a sync (IndexError on the CPU)
    flat = torch.arange(num_experts, device=flat.device).index_select(0, flat)
    sorted_expert, order = torch.sort(flat, stable=True)
    return sorted_expert, order, group_ends(sorted_expert, num_experts)


def group_ends(sorted_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """End of each expert's block in the sorted slots, `[G]` int32 (static shape, unlike `bincount`)."""
    bounds = torch.arange(1, num_experts + 1, device=sorted_expert.device, dtype=sorted_expert.dtype)
    return torch.searchsorted(sorted_expert, bounds).to(torch.int32)


def _grouped(inputs, expert_index, weight, gates, out_groups):
    n, r, d_in = inputs.shape
    slots = expert_index.shape[1]
    g, _, d_out = weight.shape
    _, order, ends = _sorted_slots(expert_index, g)
    rows = inputs.reshape(n * r, d_in).index_select(0, order // (slots // r))  # [M, d_in], sorted by expert
    sorted_out = _GROUPED_MM(rows, weight.contiguous(), offs=ends)  # [M, d_out]
    if gates is None:
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        return sorted_out.index_select(0, inverse).view(n, slots, d_out)
    sorted_out = sorted_out * gates.reshape(-1).index_select(0, order).unsqueeze(-1).to(sorted_out.dtype)
    out = sorted_out.new_zeros(n * out_groups, d_out).index_add_(0, order // (slots // out_groups), sorted_out)
    return out.view(n, out_groups, d_out)


_FORMULATIONS = {"reference": _reference, "batched": _batched, "all_experts": _all_experts, "grouped": _grouped}


def choose_implementation(inputs: torch.Tensor, weight: torch.Tensor, implementation: str = "auto") -> str:
    """The formulation a call runs: `implementation`, with "auto" resolved and "grouped" falling back."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}; got {implementation!r}")
    if implementation == "auto":
        small = inputs.shape[0] * inputs.shape[1] * weight.shape[0] <= SMALL_PROBLEM_ROWS
        implementation = "all_experts" if small else "grouped"
    usable = inputs.dtype == weight.dtype and grouped_mm_usable(weight.dtype, weight.shape[1], weight.shape[2],
                                                                  weight.device.type)
    if implementation == "grouped" and not usable:
        implementation = "all_experts"
    return implementation


def expert_projection(
    inputs: torch.Tensor,
    expert_index: torch.Tensor,
    weight: torch.Tensor,
    gates: torch.Tensor | None = None,
    out_groups: int = 1,
    implementation: str = "auto",
) -> torch.Tensor:
    """The CVMM contract (see `cvmm.py`) in plain, sync-free tensor ops; `implementation` picks the formulation.

    inputs `[N, R, d_in]`, expert_index `[N, S]` (int64), weight `[G, d_in, d_out]`, gates `[N, S]` or None.
    Returns `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them; differentiable in inputs, weight
    and gates. inputs and weight must share a dtype (`cvmm.cvmm` casts them).
    """
    return _FORMULATIONS[choose_implementation(inputs, weight, implementation)](
        inputs, expert_index, weight, gates, out_groups)


# ---------------------------------------------------------------------------------------------------- custom op
def _sorted_matmul(rows: torch.Tensor, sorted_expert: torch.Tensor, ends: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor:
    """Row m of `rows` `[M, d_in]` (sorted by expert) times `weight[sorted_expert[m]]` -> `[M, d_out]`."""
    if rows.dtype == weight.dtype and grouped_mm_usable(weight.dtype, weight.shape[1], weight.shape[2],
                                                        rows.device.type):
        return _GROUPED_MM(rows.contiguous(), weight, offs=ends)  # weight: row- or column-major (see callers)
    every = torch.matmul(rows.unsqueeze(0), weight)  # [G, M, d_out]: the sync-free fallback (float64, odd sizes)
    m = rows.shape[0]
    return every.reshape(-1, weight.shape[2]).index_select(0, sorted_expert * m + torch.arange(m, device=rows.device))


def _sorted_weight_gradient(rows: torch.Tensor, dy: torch.Tensor, sorted_expert: torch.Tensor, ends: torch.Tensor,
                            num_experts: int) -> torch.Tensor:
    """d W_e = sum over the rows m of expert e of x_m^T dy_m -> `[G, d_in, d_out]`."""
    if rows.dtype == dy.dtype and grouped_mm_usable(rows.dtype, rows.shape[1], dy.shape[1], rows.device.type):
        return _GROUPED_MM(rows.t(), dy.contiguous(), offs=ends)
    one_hot = F.one_hot(sorted_expert, num_experts).to(rows.dtype)  # [M, G]
    return torch.einsum("mg,mi,mo->gio", one_hot, rows, dy)


def cvmm_forward_reference(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    gates: torch.Tensor | None,
    sorted_expert: torch.Tensor,
    order: torch.Tensor,
    out_groups: int,
) -> torch.Tensor:
    """inputs `[N, R, d_in]`, weight `[G, d_in, d_out]`, gates `[N, S]` or None, sorted_expert / order `[M]`.

    Returns `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them.
    """
    n, r, d_in = inputs.shape
    slots = order.numel() // max(n, 1)
    g, _, d_out = weight.shape
    sorted_expert = torch.arange(g, device=sorted_expert.device).index_select(0, sorted_expert)  # bounds check
    ends = group_ends(sorted_expert, g)
    rows = inputs.reshape(n * r, d_in).index_select(0, order // (slots // r))  # [M, d_in], sorted by expert
    sorted_out = _sorted_matmul(rows, sorted_expert, ends, weight.contiguous())
    if gates is None:
        return sorted_out.new_empty(n * slots, d_out).index_copy_(0, order, sorted_out).view(n, slots, d_out)
    sorted_out.mul_(gates.reshape(-1).index_select(0, order).unsqueeze(-1).to(sorted_out.dtype))
    out = sorted_out.new_zeros(n * out_groups, d_out).index_add_(0, order // (slots // out_groups), sorted_out)
    return out.view(n, out_groups, d_out)


def cvmm_backward_reference(
    grad: torch.Tensor,
    inputs: torch.Tensor,
    weight: torch.Tensor,
    gates: torch.Tensor | None,
    sorted_expert: torch.Tensor,
    order: torch.Tensor,
    out_groups: int,
    need_inputs: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `cvmm_forward_reference` w.r.t. inputs, weight and gates (empty tensors where not needed).

    grad: `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them. With `g_m` the gradient of slot m's
    output row, `x_m` its input row and `u_m = g_m W_e^T` (one grouped matmul):
    d inputs[row] = sum_{m reading row} gate_m u_m,   d W_e = sum_{m of e} x_m^T (gate_m g_m),
    d gate_m = <x_m W_e, g_m> = <x_m, u_m>   (the product u is shared: three matmuls, not four).
    """
    n, r, d_in = inputs.shape
    slots = order.numel() // max(n, 1)
    g_count, _, d_out = weight.shape
    groups = out_groups if gates is not None else slots
    ends = group_ends(sorted_expert, g_count)
    rows = inputs.reshape(n * r, d_in).index_select(0, order // (slots // r))  # x_m, sorted
    grad_rows = grad.reshape(n * groups, d_out).index_select(0, order // (slots // groups))  # g_m, sorted
    gate_rows = None
    if gates is not None:
        gate_rows = gates.reshape(-1).index_select(0, order).unsqueeze(-1).to(grad_rows.dtype)
    d_inputs, d_weight, d_gates = inputs.new_empty(0), weight.new_empty(0), grad.new_empty(0)
    if need_inputs or gates is not None:
        u = _sorted_matmul(grad_rows, sorted_expert, ends, weight.contiguous().transpose(1, 2))  # [M, d_in]
        if gates is not None:
            d_gates = (rows * u).sum(-1)
            d_gates = d_gates.new_empty(n * slots).index_copy_(0, order, d_gates).view(n, slots).to(gates.dtype)
        if need_inputs:
            if gate_rows is not None:
                u.mul_(gate_rows)
            d_inputs = u.new_zeros(n * r, d_in).index_add_(0, order // (slots // r), u).view(n, r, d_in)
    if need_weight:
        dy = grad_rows * gate_rows if gate_rows is not None else grad_rows
        d_weight = _sorted_weight_gradient(rows, dy, sorted_expert, ends, g_count).to(weight.dtype)
    return d_inputs, d_weight, d_gates
