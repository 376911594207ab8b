"""The naive twin of the Triton kernels: the CVMM contract as the obviously correct loop over experts.

The fast PyTorch formulations live once, in the model's `expert_ops.py` (they ship with a saved model); this file
holds only what the kernels are held against and what the custom ops run on the CPU:

- `cvmm_naive(inputs, expert_index, weight, gates=None, out_groups=1)`: for every expert, the rows of the slots that
  chose it times its matrix; gates scale the slots, which sum per output group. Autograd gives its gradients.
- `cvmm_forward_reference` / `cvmm_backward_reference`: the PyTorch bodies of the `switchhead::cvmm_forward` /
  `cvmm_backward` custom ops, on slots sorted by expert as the Triton kernels take them: the same loop, with the
  backward written out (a custom op's body runs below autograd).

Notation (shared with `cvmm_triton.py`): N tokens, S slots per token, M = N * S slots, flat slot m = n * S + s. Slot m
reads input row `m // (S // R)` of `inputs.view(N * R, d_in)` and, with gates, adds into output row
`m // (S // out_groups)` of `out.view(N * out_groups, d_out)`. An expert id outside `[0, G)` raises IndexError from
an `index_select` (no host sync).
"""

from __future__ import annotations

import torch


def cvmm_naive(inputs: torch.Tensor, expert_index: torch.Tensor, weight: torch.Tensor,
               gates: torch.Tensor | None = None, out_groups: int = 1) -> torch.Tensor:
    """inputs `[N, R, d_in]`, expert_index `[N, S]`, weight `[G, d_in, d_out]`, gates `[N, S]` or None ->
    `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them."""
    n, slots = expert_index.shape
    rows_per_token, d_in = inputs.shape[1], inputs.shape[2]
    num_experts, _, d_out = weight.shape
    # the bounds check: reading the ids through a [G] table raises IndexError for an id outside [0, G)
    expert_index = torch.arange(num_experts, device=inputs.device).index_select(0, expert_index.reshape(-1).long())
    expert_index = expert_index.view(n, slots)
    row_of_slot = torch.arange(slots, device=inputs.device) // (slots // rows_per_token)
    rows = inputs.index_select(1, row_of_slot)  # [N, S, d_in]: each slot's input row
    per_slot = inputs.new_zeros(n, slots, d_out)
    for expert in range(num_experts):
        chosen = (expert_index == expert).unsqueeze(-1)  # [N, S, 1]
        per_slot = per_slot + torch.where(chosen, rows @ weight[expert], 0)
    if gates is None:
        return per_slot
    gated = per_slot * gates.unsqueeze(-1).to(per_slot.dtype)
    return gated.view(n, out_groups, slots // out_groups, d_out).sum(2)


def _slot_order_index(sorted_expert: torch.Tensor, order: torch.Tensor, n: int) -> torch.Tensor:
    """The expert of every slot in slot order `[N, S]`, from the sorted experts and their slot ids."""
    return torch.empty_like(sorted_expert).scatter_(0, order, sorted_expert).view(n, -1)


def cvmm_forward_reference(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    gates: torch.Tensor | None,
    sorted_expert: torch.Tensor,
    order: torch.Tensor,
    out_groups: int,
) -> torch.Tensor:
    """The forward op's PyTorch body: `cvmm_naive` on the slots given sorted (`sorted_expert`, `order` `[M]`)."""
    n = inputs.shape[0]
    return cvmm_naive(inputs, _slot_order_index(sorted_expert, order, n), weight, gates, out_groups)


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

    With g_s the gradient reaching slot s's output (its group's, times its gate), x_s its input row and W_e its
    expert: d x_s = g_s W_e^T (summed into the row), d W_e = sum over e's slots of x_s^T g_s, and
    d gate_s = <x_s W_e, the group's gradient>; the same loop over experts as `cvmm_naive`.
    """
    n, rows_per_token, d_in = inputs.shape
    expert_index = _slot_order_index(sorted_expert, order, n)
    slots = expert_index.shape[1]
    num_experts, _, d_out = weight.shape
    grad = grad.to(inputs.dtype)
    rows = inputs.index_select(1, torch.arange(slots, device=inputs.device) // (slots // rows_per_token))
    if gates is None:
        slot_grad = grad  # [N, S, d_out]
    else:
        group_grad = grad.repeat_interleave(slots // out_groups, dim=1)  # [N, S, d_out]: each slot's group's
        slot_grad = group_grad * gates.unsqueeze(-1).to(grad.dtype)
    row_grad = torch.zeros_like(rows)  # [N, S, d_in]
    d_weight = torch.zeros_like(weight)
    d_gates = torch.zeros(n, slots, dtype=grad.dtype, device=grad.device)
    for expert in range(num_experts):
        chosen = (expert_index == expert).unsqueeze(-1)  # [N, S, 1]
        row_grad = row_grad + torch.where(chosen, slot_grad @ weight[expert].t(), 0)
        d_weight[expert] = torch.einsum("nsi,nso->io", torch.where(chosen, rows, 0), slot_grad)
        if gates is not None:
            d_gates = d_gates + torch.where(chosen, rows @ weight[expert], 0).mul(group_grad).sum(-1)
    d_inputs = row_grad.view(n, rows_per_token, slots // rows_per_token, d_in).sum(2) if need_inputs \
        else inputs.new_empty(0)
    d_weight = d_weight if need_weight else weight.new_empty(0)
    d_gates = d_gates.to(gates.dtype) if gates is not None else grad.new_empty(0)
    return d_inputs, d_weight, d_gates
