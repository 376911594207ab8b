"""The CVMM op in plain PyTorch: the reference twin of `cvmm_triton.py`, and the CPU implementation.

Both directions work on slots sorted by expert (`sorted_expert`, `order` from `cvmm.sort_slots`), so each expert
is one dense matmul over a contiguous block of rows and the only Python loop is over the G experts. Every
reduction (over the slots of a token, over the rows of an expert) is a plain `sum`/matmul: deterministic.

Notation (shared with `cvmm_triton.py`): N tokens, S slots per token, M = N * S slots in all, flat slot
`m = n * S + s`. Slot m reads input row `m // (S // R)` of `inputs.view(N * R, d_in)` and, with gates, adds into
output row `m // (S // out_groups)` of `out.view(N * out_groups, d_out)`.
"""

from __future__ import annotations

import torch


def _expert_blocks(sorted_expert: torch.Tensor, num_experts: int) -> list[int]:
    """Rows of each expert in the sorted order (a host list: the reference loops over experts in Python)."""
    return torch.bincount(sorted_expert, minlength=num_experts).tolist()


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
    d_out = weight.shape[2]
    rows = inputs.reshape(n * r, d_in).index_select(0, order // (slots // r))  # [M, d_in], sorted by expert
    counts = _expert_blocks(sorted_expert, weight.shape[0])
    pieces = [block @ weight[e] for e, block in enumerate(rows.split(counts)) if counts[e] > 0]
    sorted_out = torch.cat(pieces, 0) if pieces else rows.new_zeros(0, d_out)
    out = sorted_out.new_empty(n * slots, d_out).index_copy(0, order, sorted_out).view(n, slots, d_out)
    if gates is None:
        return out
    weighted = out * gates.unsqueeze(-1).to(out.dtype)
    return weighted.view(n, out_groups, slots // out_groups, d_out).sum(2)


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

    grad: `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them. With `dy_m` the gradient reaching
    slot m (its gate times its output row's gradient) and `x_m` its input row:
    d inputs[row] = sum_{m reading row} dy_m W_e^T,   d W_e = sum_{m of e} x_m^T dy_m,   d gate_m = <x_m W_e, grad_row>.
    """
    n, r, d_in = inputs.shape
    slots = order.numel() // max(n, 1)
    g_count, _, d_out = weight.shape
    groups = out_groups if gates is not None else slots
    rows = inputs.reshape(n * r, d_in).index_select(0, order // (slots // r))  # x_m, sorted
    grad_rows = grad.reshape(n * groups, d_out).index_select(0, order // (slots // groups))  # sorted
    dy = grad_rows
    if gates is not None:
        dy = grad_rows * gates.reshape(-1).index_select(0, order).unsqueeze(-1).to(grad_rows.dtype)
    counts = _expert_blocks(sorted_expert, g_count)
    d_rows, d_gate, d_weight = [], [], torch.zeros_like(weight) if need_weight else weight.new_empty(0)
    for e, (x, dy_e, g_e) in enumerate(zip(rows.split(counts), dy.split(counts), grad_rows.split(counts))):
        if counts[e] == 0:
            continue
        if need_inputs:
            d_rows.append(dy_e @ weight[e].T)
        if need_weight:
            d_weight[e] = x.T @ dy_e
        if gates is not None:
            d_gate.append(((x @ weight[e]) * g_e).sum(-1))
    d_inputs = inputs.new_empty(0)
    if need_inputs:
        sorted_d = torch.cat(d_rows, 0) if d_rows else rows.new_zeros(0, d_in)
        per_slot = sorted_d.new_empty(n * slots, d_in).index_copy(0, order, sorted_d)
        d_inputs = per_slot.view(n, r, slots // r, d_in).sum(2)
    d_gates = grad.new_empty(0)
    if gates is not None:
        sorted_g = torch.cat(d_gate, 0) if d_gate else grad.new_zeros(0)
        d_gates = sorted_g.new_empty(n * slots).index_copy(0, order, sorted_g).view(n, slots).to(gates.dtype)
    return d_inputs, d_weight, d_gates
