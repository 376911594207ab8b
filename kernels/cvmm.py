"""CVMM ("conditional vector-matrix multiplication"): the expert projection of SwitchHead and sigma-MoE.

    cvmm(inputs, expert_index, weight, gates=None, out_groups=1)
    cvmm(inputs, sort_slots(expert_index, G), ...)  # calls that route by one index share its sort

inputs `[N, R, d_in]` (R input rows per token), expert_index `[N, S]` (integer indices into weight's first
dimension), weight `[G, d_in, d_out]`, gates `[N, S]` or None. Slot s of token n multiplies input row
`s // (S // R)` by matrix `weight[expert_index[n, s]]`. Without gates the result is `[N, S, d_out]`; with gates
each slot is scaled by its gate and summed into output group `s // (S // out_groups)`: `[N, out_groups, d_out]`.
In SwitchHead: values (R=1, S=H*k, out_groups=H), output (R=H, S=H*k, out_groups=1: the sum over heads and their
experts); sigma-MoE: keys (R=1, S=k, no gates), values (R=k, S=k, out_groups=1).

The model's dispatch (`EXPERTS_IMPLEMENTATIONS["cvmm"]` in `switchhead.expert_ops`) calls `cvmm` where
`triton_runs` says the kernels run: CUDA tensors, and CPU tensors when `TRITON_INTERPRET=1` was set before the first
use (the Triton interpreter, for tests), in float32 / float16 / bfloat16; everywhere else it runs its PyTorch
formulations, and `cvmm` itself raises. The op and its backward are registered with `torch.library` as
`switchhead::cvmm_forward` / `switchhead::cvmm_backward` (custom_op + register_fake + register_autograd), so
`torch.compile(fullgraph=True)` traces through them.

The kernels read the slots sorted by expert. The sort (`sort_slots`, one `torch.sort` on the narrowest integer keys
that hold the expert count, `key_dtype`) runs outside the op and its result goes to the backward, so a call sorts
once for its forward and backward; projections that route by the same index (sigma-MoE's keys and values:
`switchhead.experts_integration`) pass one `SlotOrder` and share one sort per layer. SwitchHead's value and output
projections have routers of their own, so theirs are two sorts.

No path syncs with the host: expert ids outside `[0, G)` are not read back. Set `SWITCHHEAD_CVMM_CHECK_INDEX=1` for
an explicit host-side range check before every call (a sync; for debugging, as an out-of-range id in a kernel is
not reported clearly: it reads outside the weight, or wraps around in the narrow sort key).

Where several slots share an output row (the gated sum; the input gradient of rows read by several slots), the Triton
forward and input gradient write each slot's row and sum the slots in a fixed order: bitwise reproducible, and on an
H100 faster than fp32 atomics at all four 262M shapes timed (forward+backward 0.24-0.38 of a same-FLOP dense matmul
against 0.18-0.30; benchmarks/results/gpu/NOTES.md and run2/NOTES.md). `SWITCHHEAD_CVMM_DETERMINISTIC=0` or
`set_deterministic(False)` opts into the atomics instead: they hold one fp32 row per output row rather than one per
slot, and were faster at four of the seven other shapes timed (by 0.01-0.03 of that ratio);
`torch.use_deterministic_algorithms(True)` keeps the fixed order. Weight gradients never use atomics.
"""

# no `from __future__ import annotations` here: torch.library reads the op signatures' annotations at run time
import importlib.util
import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

DETERMINISTIC_ENV = "SWITCHHEAD_CVMM_DETERMINISTIC"
CHECK_INDEX_ENV = "SWITCHHEAD_CVMM_CHECK_INDEX"
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_deterministic_override: bool | None = None


# ---------------------------------------------------------------------------------------------------- switches
def set_deterministic(enabled: bool | None) -> None:
    """True: the Triton path sums slots in a fixed order (bitwise reproducible; the default); False: fp32 atomics;
    None defers to torch's deterministic flag and the env var."""
    global _deterministic_override
    _deterministic_override = enabled


def is_deterministic() -> bool:
    if _deterministic_override is not None:
        return _deterministic_override
    return torch.are_deterministic_algorithms_enabled() or os.environ.get(DETERMINISTIC_ENV, "1") != "0"


def _find_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


_TRITON_INSTALLED = _find_triton()


def triton_installed() -> bool:
    return _TRITON_INSTALLED  # looked up once at import (a plain constant for torch.compile, unlike a cache)


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1")


def triton_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels run tensors on `device` of `dtype` (what the model's "cvmm" entry asks)."""
    return triton_installed() and _triton_runs_on(device) and dtype in TRITON_DTYPES


def _triton_module():
    # imported on first use only: TRITON_INTERPRET is read when the kernels are decorated
    from . import cvmm_triton

    return cvmm_triton


# ---------------------------------------------------------------------------------------------------- the ops
class SlotOrder(NamedTuple):
    """An expert index with its slots sorted by expert, made once by `sort_slots` and passed to every `cvmm` call that
    routes by that index (sigma-MoE's keys and values): their forwards and backwards then share one sort.

    expert_index `[N, S]` (int64), sorted_expert `[N * S]` (the expert of each sorted slot, in `key_dtype`), order
    `[N * S]` (the flat slot id of each sorted slot, int64)."""

    expert_index: Tensor
    sorted_expert: Tensor
    order: Tensor


def key_dtype(num_experts: int | None) -> torch.dtype:
    """The sort key's dtype for expert ids in `[0, num_experts)`: the narrowest signed integer that also holds
    `num_experts` itself (the backward searches for it), int64 when the count is not given. A GPU radix sort makes one
    pass per key digit, so 16-bit ids sort in a quarter of int64's passes."""
    if num_experts is None:
        return torch.int64
    for dtype in (torch.int16, torch.int32):
        if num_experts <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def sort_slots(expert_index: Tensor, num_experts: int | None = None) -> SlotOrder:
    """The flat slots of `expert_index` `[N, S]` sorted by expert; `num_experts` (the weight's G), where given, sorts
    narrower keys (`key_dtype`).

    The sort is stable, so the rows of one expert keep token order and every reduction order is fixed.
    """
    expert_index = expert_index.long()
    sorted_expert, order = torch.sort(expert_index.reshape(-1).to(key_dtype(num_experts)), stable=True)
    return SlotOrder(expert_index, sorted_expert, order)


@torch.library.custom_op("switchhead::cvmm_forward", mutates_args=())
def cvmm_forward(
    inputs: Tensor, weight: Tensor, gates: Optional[Tensor], sorted_expert: Tensor, order: Tensor, slots: int,
    out_groups: int,
) -> Tensor:
    """The CVMM op on slots already sorted by expert (`sort_slots`): `[N, groups, d_out]`."""
    groups = out_groups if gates is not None else slots
    if inputs.shape[0] == 0:
        return inputs.new_zeros(0, groups, weight.shape[2])
    return _triton_module().cvmm_forward_triton(inputs, weight, gates, sorted_expert, order, out_groups,
                                                is_deterministic())


@cvmm_forward.register_fake
def _cvmm_forward_fake(inputs, weight, gates, sorted_expert, order, slots, out_groups):
    groups = out_groups if gates is not None else slots
    return inputs.new_empty(inputs.shape[0], groups, weight.shape[2])


@torch.library.custom_op("switchhead::cvmm_backward", mutates_args=())
def cvmm_backward(
    grad: Tensor, inputs: Tensor, weight: Tensor, gates: Optional[Tensor], sorted_expert: Tensor, order: Tensor,
    out_groups: int, need_inputs: bool, need_weight: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(d inputs, d weight, d gates); a gradient not needed (or d gates without gates) is an empty tensor."""
    grad = grad.to(inputs.dtype)
    if inputs.shape[0] == 0:
        return _gradient_buffers(grad, inputs, weight, gates, need_inputs, need_weight, torch.zeros)
    return _triton_module().cvmm_backward_triton(grad, inputs, weight, gates, sorted_expert, order, out_groups,
                                                 need_inputs, need_weight, is_deterministic())


def _gradient_buffers(grad, inputs, weight, gates, need_inputs, need_weight, make):
    d_inputs = make(inputs.shape if need_inputs else (0,), dtype=inputs.dtype, device=inputs.device)
    d_weight = make(weight.shape if need_weight else (0,), dtype=weight.dtype, device=weight.device)
    d_gates = make(gates.shape if gates is not None else (0,), dtype=gates.dtype if gates is not None else grad.dtype,
                   device=grad.device)
    return d_inputs, d_weight, d_gates


@cvmm_backward.register_fake
def _cvmm_backward_fake(grad, inputs, weight, gates, sorted_expert, order, out_groups, need_inputs, need_weight):
    return _gradient_buffers(grad, inputs, weight, gates, need_inputs, need_weight, torch.empty)


def _setup_context(ctx, inputs, output):
    x, weight, gates, sorted_expert, order, _, out_groups = inputs
    ctx.save_for_backward(x, weight, gates, sorted_expert, order)
    ctx.out_groups = out_groups


def _backward(ctx, grad):
    x, weight, gates, sorted_expert, order = ctx.saved_tensors
    need_inputs, need_weight, need_gates = ctx.needs_input_grad[:3]
    d_inputs, d_weight, d_gates = cvmm_backward(grad, x, weight, gates, sorted_expert, order, ctx.out_groups,
                                                need_inputs, need_weight)
    return (d_inputs if need_inputs else None, d_weight if need_weight else None,
            d_gates if need_gates else None, None, None, None, None)


cvmm_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------- public
def _check_arguments(inputs: Tensor, expert_index: Tensor, weight: Tensor, gates: Tensor | None,
                     out_groups: int) -> None:
    if inputs.dim() != 3 or expert_index.dim() != 2 or weight.dim() != 3:
        raise ValueError(f"cvmm expects inputs [N, R, d_in], expert_index [N, S], weight [G, d_in, d_out]; got "
                         f"{tuple(inputs.shape)}, {tuple(expert_index.shape)}, {tuple(weight.shape)}")
    (n, r, d_in), (n_index, slots) = inputs.shape, expert_index.shape
    if n != n_index:
        raise ValueError(f"inputs has {n} tokens but expert_index has {n_index}; they must match")
    if expert_index.dtype.is_floating_point or expert_index.dtype == torch.bool:
        raise ValueError(f"expert_index must be an integer tensor; got {expert_index.dtype}")
    if r < 1 or slots % r:
        raise ValueError(f"the slot count S={slots} must be a multiple of the input rows per token R={r}")
    if weight.shape[1] != d_in:
        raise ValueError(f"weight is [G, {weight.shape[1]}, d_out] but inputs have d_in={d_in}; they must match")
    if gates is not None:
        if gates.shape != expert_index.shape:
            raise ValueError(f"gates must have expert_index's shape {tuple(expert_index.shape)}; "
                             f"got {tuple(gates.shape)}")
        if out_groups < 1 or slots % out_groups:
            raise ValueError(f"out_groups={out_groups} must divide the slot count S={slots}")


def _range_error(expert_index: Tensor, num_experts: int) -> ValueError:
    return ValueError(f"expert_index values must lie in [0, {num_experts}) (weight has {num_experts} experts); "
                      f"got values in [{int(expert_index.min())}, {int(expert_index.max())}]")


def cvmm(inputs: Tensor, expert_index: Tensor | SlotOrder, weight: Tensor, gates: Tensor | None = None,
         out_groups: int = 1) -> Tensor:
    """Rows times their selected expert's matrix, with an optional gate-weighted sum, on the Triton kernels (see the
    module docstring; where `triton_runs` is false this raises: the model's dispatch runs PyTorch there).

    Args:
        inputs: `[N, R, d_in]`.
        expert_index: `[N, S]` integers in `[0, G)`, or `sort_slots(expert_index, G)`: calls that route by one
            index then share its sort (it carries its index, so a sort cannot be paired with another index).
        weight: `[G, d_in, d_out]`.
        gates: `[N, S]` or None.
        out_groups: output rows per token when `gates` is given.

    Returns:
        `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them, in the inputs' dtype (the autocast dtype
        under autocast). Differentiable w.r.t. inputs, weight and gates.
    """
    slot_order = expert_index if isinstance(expert_index, SlotOrder) else None
    if slot_order is not None:
        expert_index = slot_order.expert_index
    _check_arguments(inputs, expert_index, weight, gates, out_groups)
    device_type = inputs.device.type
    if torch.is_autocast_enabled(device_type):  # as a matmul would: compute in the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        inputs, weight = inputs.to(dtype), weight.to(dtype)
    elif inputs.dtype != weight.dtype:
        dtype = torch.promote_types(inputs.dtype, weight.dtype)
        inputs, weight = inputs.to(dtype), weight.to(dtype)
    expert_index = expert_index.long()
    num_experts = weight.shape[0]
    if slot_order is not None and num_experts > torch.iinfo(slot_order.sorted_expert.dtype).max:
        raise ValueError(f"this SlotOrder's {slot_order.sorted_expert.dtype} keys cannot hold the ids of weight's "
                         f"{num_experts} experts: make it with sort_slots(expert_index, num_experts={num_experts})")
    checking = os.environ.get(CHECK_INDEX_ENV, "0") == "1" and not torch.compiler.is_compiling()
    if checking and expert_index.numel() and (expert_index.min() < 0 or expert_index.max() >= num_experts):
        raise _range_error(expert_index, num_experts)  # explicit debug mode: reads the ids back (a sync)
    if not triton_runs(inputs.device, inputs.dtype):
        raise RuntimeError(
            f"the CVMM Triton kernels cannot run {inputs.dtype} tensors on {device_type}: they need triton "
            f"installed, CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors) and one of "
            f"{[str(t) for t in TRITON_DTYPES]}; switchhead.expert_ops.expert_projection runs PyTorch elsewhere"
        )
    if slot_order is None:
        slot_order = sort_slots(expert_index, num_experts)
    return cvmm_forward(inputs, weight, gates, slot_order.sorted_expert, slot_order.order, expert_index.shape[1],
                        out_groups)
