"""The expert projection of SwitchHead and sigma-MoE ("CVMM"): its formulations, the one table that picks among
them, and the one rule behind "eager".

    expert_projection(inputs, expert_index, weight, gates=None, out_groups=1, implementation=None,
                      grouped_routing=False)

inputs `[N, R, d_in]` (R input rows per token), expert_index `[N, S]` (indices into weight's first dimension),
weight `[G, d_in, d_out]`, gates `[N, S]` or None. Slot s of a token multiplies input row `s // (S // R)` by
`weight[expert_index[n, s]]`. Without gates the result is `[N, S, d_out]`; with gates each slot is scaled by its gate
and summed into output group `s // (S // out_groups)`: `[N, out_groups, d_out]`. SwitchHead's values are
(R=1, S=H*k, out_groups=H), its output (R=H, S=H*k, out_groups=1); sigma-MoE's keys (R=1, S=k, no gates) and values
(R=k, S=k, out_groups=1).

`EXPERTS_IMPLEMENTATIONS` is the one place a projection is chosen, keyed by the values of
`config.experts_implementation`:
- "eager": the PyTorch formulation that `choose_formulation` (the "auto" rule) picks for the call's sizes;
- "switchhead_batched": gather the selected matrices, one bmm with the gated sum inside (`_batched`);
- "switchhead_grouped": slots sorted by expert, one grouped matmul (`torch._grouped_mm`: CPU tensors in float32 /
  bfloat16 / float16 with 16-byte aligned rows, not under torch.compile; elsewhere `_all_experts` runs) with a
  backward that keeps no per-slot tensor (`_GroupedExperts`);
- "cvmm": the Triton kernels of `switchhead.kernels` (the custom op `switchhead::cvmm_forward`) where they run (CUDA
  tensors, or CPU tensors under `TRITON_INTERPRET=1`), elsewhere the PyTorch formulation the "auto" rule picks (the
  kernels' twin on devices they do not run on);
- "switchhead_auto" (the default): per call, what an H100 measured faster: "eager"'s rule for grouped routing
  (SwitchHead's per-head projections), "cvmm" for any other routing (sigma-MoE's MLP, other MoE models); training
  on a GPU (`LEAN_DEVICES`), SwitchHead's attention runs "switchhead_fused"'s lean block instead (`lean_default`);
- "switchhead_fused": SwitchHead's attention block with dense's kernel count: q, k, every expert's values and both
  routers from one GEMM, values mixed with a backward that recomputes rather than stores every expert's values, the
  output one GEMM over `H * E * dh` that keeps only its arguments (the attention layer does the fusing, see
  "fused" below); alone, a per-head projection runs `_per_head` with those backwards (under autocast too), and
  any other call "eager"'s rule.

Only "eager", "cvmm", "switchhead_auto" and "switchhead_fused" (outside the attention layer) choose by size; the
other names are one formulation each.

The formulations "eager" chooses among besides those two: `_all_experts` (every expert in dense matmuls, no weight
copy: without gates every row times every expert, then each slot's result picked; with gates, the gates scattered
into a mixing matrix, `_mixing_matrix`, then either every row times every expert, mixed, for R <= out groups, or the
rows mixed per expert and one matmul with all experts stacked) and `_per_head` (SwitchHead's own case, for grouped
routing: slot group h picks among experts h*E .. h*E + E - 1, what `ExpertSelection` produces for heads; the gates
become dense `[N, H, E]` and both projections run against every expert of a head with no index arithmetic, with
custom autograd functions that keep what their backward needs and no more). `naive` is the short twin every entry
and formulation is tested against.

Under `torch.export` with a symbolic token count (a dynamic batch or length), "eager" is `_all_experts` for every
size: a choice by size would specialise the exported graph to the example's size. No formulation syncs with the
host, so the op compiles with `torch.compile(fullgraph=True)`; an expert id outside `[0, G)` raises IndexError from
an `index_select`.

Part of the Hub-ready model: this file imports only torch, and uses `switchhead.kernels` when it is installed.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

try:  # the package's Triton kernels where the package is installed; a Hub copy of the model runs without them
    from switchhead import kernels as _kernels
except Exception:  # noqa: BLE001 - not installed, or its kernels fail to import: the PyTorch formulations run
    _kernels = None
if _kernels is not None and not (hasattr(_kernels, "cvmm") and hasattr(_kernels, "triton_runs")):
    _kernels = None  # another release of the package, without the kernel API this file calls

_FEW_SLOTS = 4  # "eager": gather the selected matrices while N * S (selected matrices in the call) is at most this
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


def _expert_gated_sum(per_slot: torch.Tensor, gates: torch.Tensor | None, out_groups: int) -> torch.Tensor:
    if gates is None:
        return per_slot
    n, s, d_out = per_slot.shape
    # the gates as they are (float32 from the router): under autocast the gated sum runs in float32, as eager's
    # per-head mix does, and the result is rounded to the slots' dtype once
    weighted = per_slot * gates.unsqueeze(-1)
    return weighted.view(n, out_groups, s // out_groups, d_out).sum(2).to(per_slot.dtype)


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
        # gated and summed in at least float32 (the matmul's own accumulator), rounded once: 16-bit slots summed in
        # their own dtype would round after every slot added (H * k of them on SwitchHead's output side)
        total = torch.promote_types(sorted_out.dtype, torch.float32)
        gated = sorted_out.to(total).mul_(gates.reshape(-1).index_select(0, order).to(total).unsqueeze(-1))
        out = gated.new_zeros(n * out_groups, d_out).index_add_(0, order // (s // out_groups), gated)
        return out.to(sorted_out.dtype).view(n, out_groups, d_out)

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


def naive(inputs, expert_index, weight, gates=None, out_groups=1):
    """The naive twin: every slot's matrix gathered (`[N, S, d_in, d_out]`), one einsum, then the gated sum."""
    n, s = expert_index.shape
    r, d_in = inputs.shape[1], inputs.shape[2]
    rows = inputs.unsqueeze(2).expand(n, r, s // r, d_in).reshape(n, s, d_in)
    matrices = weight.index_select(0, expert_index.reshape(-1)).view(n, s, d_in, weight.shape[2])
    return _expert_gated_sum(torch.einsum("nsi,nsio->nso", rows, matrices), gates, out_groups)


def _gathered(inputs, expert_index, weight, gates, out_groups):
    """The naive twin with its matrix product written as a broadcast product and a sum over `d_in`: under
    torch.compile, inductor fuses the gather of the selected matrices into that reduction, so each selected matrix
    is read once and none is copied. Eager, it materialises `[N, S, d_in, d_out]`: chosen only while compiling."""
    n, s = expert_index.shape
    r, d_in = inputs.shape[1], inputs.shape[2]
    rows = inputs.unsqueeze(2).expand(n, r, s // r, d_in).reshape(n, s, d_in, 1)
    matrices = weight.index_select(0, expert_index.reshape(-1)).view(n, s, d_in, weight.shape[2])
    return _expert_gated_sum((rows * matrices).sum(2), gates, out_groups)


def _batched(inputs, expert_index, weight, gates, out_groups, grouped_routing=False):
    n, s = expert_index.shape
    r, d_in, d_out = inputs.shape[1], inputs.shape[2], weight.shape[2]
    matrices = weight.index_select(0, expert_index.reshape(-1))  # [M, d_in, d_out]
    if gates is None:
        rows = inputs.unsqueeze(2).expand(n, r, s // r, d_in).reshape(n * s, 1, d_in)
        return torch.bmm(rows, matrices).view(n, s, d_out)
    # each slot's input row scaled by its gate (one broadcast product): the gated sum inside the matmul, per group
    gates = gates if gates.dtype == inputs.dtype else gates.to(inputs.dtype)
    rows = inputs.unsqueeze(2) * gates.view(n, r, s // r, 1)  # [N, R, S / R, d_in]
    if n * out_groups == 1:  # one output row: a matrix-vector product
        return torch.mm(rows.view(1, s * d_in), matrices.view(s * d_in, d_out)).view(1, 1, d_out)
    per_group = s // out_groups
    out = torch.bmm(rows.reshape(n * out_groups, 1, per_group * d_in),
                    matrices.view(n * out_groups, per_group * d_in, d_out))
    return out.view(n, out_groups, d_out)


def _all_experts(inputs, expert_index, weight, gates, out_groups):
    n, s = expert_index.shape
    r, d_in = inputs.shape[1], inputs.shape[2]
    g, _, d_out = weight.shape
    device = inputs.device
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


def _grouped(inputs, expert_index, weight, gates, out_groups, grouped_routing=False):
    if expert_index.shape[0] == 0 or not _grouped_mm_usable(inputs, weight):
        return _all_experts(inputs, expert_index, weight, gates, out_groups)
    return _GroupedExperts.apply(inputs, weight, gates, expert_index, out_groups)


def _per_head(inputs, expert_index, weight, gates, out_groups):
    """Grouped routing with gates, one side of SwitchHead: values (R = 1, H output groups) or output (R = H rows,
    one output group); H groups of E = G / H experts."""
    rows = inputs.shape[1]
    heads = max(rows, out_groups)
    dense = dense_head_gates(expert_index, gates, heads, weight.shape[0] // heads, inputs.dtype)  # [N, H, E]
    if rows == 1:
        return head_expert_values(inputs[:, 0], dense, weight)  # [N, H, d_out]
    return head_expert_output(inputs, dense, weight).unsqueeze(1)  # [N, 1, d_out]


def choose_formulation(tokens: int, slots: int, rows: int, out_groups: int | None, num_experts: int,
                       grouped_routing: bool = False) -> Callable:
    """The "auto" rule behind "eager": the formulation for a call of these sizes (`out_groups` None: no gates).

    While a call selects at most as many matrices as there are experts (N * S <= G: decoding a few tokens), only
    the selected ones are read: compiled (not exported) by `_gathered`, whose gather inductor fuses into the product;
    eager by `_batched`, which copies them first (in decoding the weights stream from memory and the copy stays in
    cache: at one token it beats every formulation that reads all experts, even with all of them selected,
    benchmarks/results/decode_experts_*). Otherwise `_batched` for a handful of selected matrices (N * S <= 4: the
    weight copy is small); `_all_experts` while its extra work is small: it multiplies by every expert, i.e.
    min(R, out groups) * G matrix products per token where S are needed, so it is taken when that is at most twice
    S, or for few tokens (N * S <= 512, where sorting and copying cost more than the extra products); else
    `_grouped`. With grouped routing and gates on a side with one input row or one output group, `_per_head`
    replaces `_batched` and `_all_experts` there (the work of `_all_experts` in fewer ops). Exporting with a
    symbolic token count: `_all_experts` (one graph for every size; the others are size-dependent choices, and
    `_grouped` does not export).
    """
    if isinstance(tokens, torch.SymInt) and torch.compiler.is_exporting():
        return _all_experts
    if tokens * slots <= num_experts:  # no more selected matrices than experts (decoding): read only those
        if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
            return _gathered
        return _batched
    mixed = min(rows, out_groups or slots) * num_experts  # products per token of `_all_experts`
    if mixed > 2 * slots and tokens * slots > 512:
        return _grouped
    if grouped_routing and out_groups is not None and min(rows, out_groups) == 1:
        return _per_head
    return _batched if tokens * slots <= _FEW_SLOTS else _all_experts


def _eager(inputs, expert_index, weight, gates, out_groups, grouped_routing=False):
    n, s = expert_index.shape
    groups = out_groups if gates is not None else None
    formulation = choose_formulation(n, s, inputs.shape[1], groups, weight.shape[0], grouped_routing)
    return formulation(inputs, expert_index, weight, gates, out_groups)


def _cvmm(inputs, expert_index, weight, gates, out_groups, grouped_routing=False):
    if _kernels is not None and _kernels.triton_runs(inputs.device, inputs.dtype):
        return _kernels.cvmm(inputs, expert_index, weight, gates, out_groups)
    n, s = expert_index.shape
    groups = out_groups if gates is not None else None
    formulation = choose_formulation(n, s, inputs.shape[1], groups, weight.shape[0], grouped_routing)
    return formulation(inputs, expert_index, weight, gates, out_groups)


def _auto(inputs, expert_index, weight, gates, out_groups, grouped_routing=False):
    # The default, from what an H100 measured (benchmarks/results/gpu/matrices/long_train.md, decode_floor.md):
    # SwitchHead's per-head projections (grouped routing) train and decode faster on the PyTorch formulation than on
    # the Triton kernel at every shape timed (e.g. 0.836 against 0.974 of dense's step at 47M, 0.858 against 1.271
    # at 262M), so they run "eager"'s rule; any other routing (sigma-MoE's MLP, other MoE models) runs "cvmm", whose
    # kernel was faster on the largest sigma-MoE shape timed.
    if grouped_routing:
        if lean_default(inputs):
            return _fused(inputs, expert_index, weight, gates, out_groups, grouped_routing)
        return _eager(inputs, expert_index, weight, gates, out_groups, grouped_routing)
    return _cvmm(inputs, expert_index, weight, gates, out_groups, grouped_routing)


# ---------------------------------------------------------------------------------------------------- lean default
# Where "switchhead_auto" trains SwitchHead's attention with the lean block of "switchhead_fused" (one input GEMM, the
# value mix recomputing every expert's values in its backward, the output side keeping only its arguments; a side the
# layer does not fuse, such as XL's memory, runs `_fused`'s per-head projection with the same backwards). On a GPU
# under bf16 autocast the per-projection formulations keep every expert's values and one bf16 copy of the layer's
# input per projection: more than dense attention keeps (benchmarks/results/saved_memory_*). The CPU keeps "eager"'s
# rule, which is faster there (benchmarks/results/attention_block_*).
LEAN_DEVICES = frozenset({"cuda"})


def lean_default(tensor: torch.Tensor) -> bool:
    """Whether "switchhead_auto" runs the lean attention block on `tensor`: on `LEAN_DEVICES`, while autograd records
    (training; decoding and evaluation keep "eager"'s rule, which reads only the selected experts for few tokens)."""
    return tensor.device.type in LEAN_DEVICES and torch.is_grad_enabled()


def fuses_attention_block(implementation: str, tensor: torch.Tensor) -> bool:
    """Whether a SwitchHead attention layer configured with `implementation` makes q, k, values and routers in one
    GEMM on `tensor`: "switchhead_fused" always, "switchhead_auto" where `lean_default` holds."""
    return implementation == "switchhead_fused" or (implementation == DEFAULT_EXPERTS_IMPLEMENTATION
                                                     and lean_default(tensor))


_KERNELS_SORT_ONCE = _kernels is not None and hasattr(_kernels, "sort_slots")  # older kernels sort in each call


def sorting_once(project: Callable, inputs: torch.Tensor, expert_index: torch.Tensor, num_experts: int) -> Callable:
    """`project` for the projections of one layer that all route by `expert_index` into `num_experts` experts
    (sigma-MoE's keys, then its values), the first reading `inputs`: where `project` runs the Triton kernels on them
    ("cvmm", or "switchhead_auto" outside grouped routing), the slots are sorted once here and every call with this
    index reads that sort, forward and backward alike, instead of sorting per call; any other call, or another
    index, runs `project` itself."""
    if (not _KERNELS_SORT_ONCE or project not in (_cvmm, _auto)
            or not _kernels.triton_runs(inputs.device, inputs.dtype)):
        return project
    slot_order = _kernels.sort_slots(expert_index, num_experts)

    def run(inputs, index, weight, gates, out_groups, grouped_routing=False):
        if grouped_routing or index is not expert_index or not _kernels.triton_runs(inputs.device, inputs.dtype):
            return project(inputs, index, weight, gates, out_groups, grouped_routing)
        return _kernels.cvmm(inputs, slot_order, weight, gates, out_groups)

    return run


# ---------------------------------------------------------------------------------------------------- fused
# "switchhead_fused": SwitchHead's attention block with dense's kernel count. The attention layer makes q, k, every
# expert's values and both routers' logits in one GEMM over one concatenated weight (`fused_input_weight`); the value
# mix (`mix_values_recomputed`) keeps no per-expert tensor for its backward, which recomputes every expert's values
# from the GEMM's own saved operands; the output is `head_expert_output`'s one GEMM over H * E * dh, which keeps only
# its arguments. Under autocast the operands are cast once, before the GEMM (`autocast_operands`), so the hand-written
# backwards see the dtypes the forward used and share the casts the GEMM's autograd keeps.
def _autocast_on(tensor: torch.Tensor) -> bool:
    """Whether autocast is on for the tensor's device (devices autocast has no mode for, such as meta: never)."""
    device = tensor.device.type
    return torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype of their device where autocast is on there (floating ones only), else as
    they are. A tensor with a copy in `shared_autocast_inputs` gets that copy."""
    if not _autocast_on(tensors[0]):
        return tensors
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(autocast_input(t, dtype) if t.is_floating_point() else t for t in tensors)


# ---------------------------------------------------------------------------------------------------- shared casts
# Under autocast every matmul casts its float32 input to the low-precision dtype and autograd keeps that copy for the
# weight's gradient: an attention layer whose q, k, values and routers each read the layer's input kept one copy per
# projection. While `shared_autocast_inputs` is active (an attention layer's forward), each float32 input is cast
# once and every projection reads that copy; the backward is unchanged (each reader's gradient is cast back to
# float32 on its own, as autocast's casts do), so outputs and gradients are bit for bit those of separate casts.
SHARE_AUTOCAST_INPUTS = True  # False: every reader casts for itself, as autocast does (the twin the tests hold)
_SHARED = []  # the active layers' copies: {(data_ptr, numel, version, dtypes, device): (the tensor, its contiguous
# copy)}; the tensor is held so that its memory is not reused by another while the layer runs


class _SharedCast(torch.autograd.Function):
    """`tensor.to(copy.dtype)` whose result is `copy` (the same values, made once, outside autograd), with the cast's
    backward: the gradient cast back to `tensor`'s dtype."""

    @staticmethod
    def forward(ctx, tensor, copy):
        ctx.dtype = tensor.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class shared_autocast_inputs:
    """Context manager: within it, `autocast_input` casts each contiguous float tensor once (see above). Inactive
    (a no-op) without autocast, while compiling (inductor removes repeated casts itself) and with
    `SHARE_AUTOCAST_INPUTS` False."""

    def __init__(self, tensor: torch.Tensor):
        self.active = (SHARE_AUTOCAST_INPUTS and _autocast_on(tensor) and not torch.compiler.is_compiling()
                       and torch.is_grad_enabled())

    def __enter__(self):
        if self.active:
            _SHARED.append({})
        return self

    def __exit__(self, *exc):
        if self.active:
            _SHARED.pop()
        return False


def autocast_input(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` as autocast hands it to a matmul: in `dtype` (default: the autocast dtype of its device, where
    autocast is on there; else `tensor` itself). Inside `shared_autocast_inputs`, the one copy of a contiguous
    float tensor (its views of the same elements included) that every reader shares."""
    if dtype is None:
        if not _autocast_on(tensor):
            return tensor
        dtype = torch.get_autocast_dtype(tensor.device.type)
    if tensor.dtype == dtype or not tensor.is_floating_point():
        return tensor
    if not _SHARED or not tensor.is_contiguous() or torch.compiler.is_compiling():
        return tensor.to(dtype)
    # the version counter (shared by views) keeps a copy made before an in-place change from being handed out after
    key = (tensor.data_ptr(), tensor.numel(), tensor._version, tensor.dtype, dtype, tensor.device)
    copies = _SHARED[-1]
    if key not in copies:
        copies[key] = (tensor, tensor.detach().to(dtype))
    copy = copies[key][1]
    if not tensor.requires_grad or not torch.is_grad_enabled():
        return copy.view(tensor.shape)
    return _SharedCast.apply(tensor, copy.view(tensor.shape))


def fused_input_weight(parts: list[torch.Tensor], value_experts: torch.Tensor) -> torch.Tensor:
    """One linear weight `[rows, d]`: the dense `[rows_i, d]` weights of `parts` around every expert's value weight
    (`value_experts` `[H * E, d, dh]`, as rows `h * E * dh + e * dh + j`), in the order (q, k, values, routers):
    `parts[:2] + [values] + parts[2:]`."""
    return torch.cat([*parts[:2], _as_linear_weight(value_experts), *parts[2:]])


def _as_linear_weight(value_experts: torch.Tensor) -> torch.Tensor:
    """Expert value weights `[H * E, d, dh]` as one linear weight `[H * E * dh, d]` (a copy)."""
    return value_experts.transpose(1, 2).reshape(-1, value_experts.shape[1])


def fused_attention_inputs(tokens: torch.Tensor, dense_weights: list[torch.Tensor], value_experts: torch.Tensor,
                           value_router: Callable, num_experts: int) -> tuple[torch.Tensor, ...]:
    """SwitchHead's q, k, values and output-router logits from one GEMM: tokens `[N, d]`, `dense_weights` the
    linear weights (q, k, value router, output router), `value_experts` `[H * E, d, dh]`, `value_router(tokens,
    logits=...)` the value side's `ExpertSelection` (called, so that its logits are recorded) -> query, key
    `[N, H * dh]`, values `[N, H, dh]` (mixed by `mix_values_recomputed`), output-router logits `[N, H * E]`."""
    weight = fused_input_weight(dense_weights, value_experts)
    mix_dtype = tokens.dtype  # the gates' dtype in eager's per-head mix: the tokens' own (float32 under autocast)
    tokens, weight = autocast_operands(tokens, weight)
    sizes = [dense_weights[0].shape[0], dense_weights[1].shape[0], value_experts.shape[0] * value_experts.shape[2],
             dense_weights[2].shape[0], dense_weights[3].shape[0]]
    query, key, every, value_logits, output_logits = F.linear(tokens, weight).split(sizes, dim=-1)
    _, gates, index = value_router(tokens, logits=value_logits)
    heads = value_experts.shape[0] // num_experts
    dense_gates = dense_head_gates(index, gates, heads, num_experts, mix_dtype)
    values = mix_values_recomputed(every, dense_gates, tokens, weight[sizes[0] + sizes[1]: sum(sizes[:3])])
    return query, key, values, output_logits


class _MixRecomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, every, gates, inputs, weight):
        n, heads, experts = gates.shape
        ctx.save_for_backward(gates, inputs, weight)  # inputs and weight: the GEMM's own operands, kept anyway
        return _mix_rounded_once(every, gates)

    @staticmethod
    def backward(ctx, grad):  # grad [N, H, dh]
        gates, inputs, weight = ctx.saved_tensors
        n, heads, experts = gates.shape
        grad_every = grad_gates = None
        if ctx.needs_input_grad[0]:
            grad_every = (gates.unsqueeze(-1) * grad.unsqueeze(2)).view(n, heads * experts * grad.shape[-1])
            grad_every = grad_every.to(weight.dtype)  # `every`'s dtype (the GEMM's)
        if ctx.needs_input_grad[1]:  # d gate[n, h, e] = <dy[n, h], x_n W_he>, W_he's values recomputed
            every = F.linear(inputs, weight).view(n, heads, experts, -1)
            grad_gates = (every * grad.unsqueeze(2)).sum(-1, dtype=gates.dtype)
        return grad_every, grad_gates, None, None


def mix_values_recomputed(every: torch.Tensor, gates: torch.Tensor, inputs: torch.Tensor,
                          weight: torch.Tensor) -> torch.Tensor:
    """Every expert's values `every` `[N, H * E * dh]` (= `F.linear(inputs, weight)`, computed by the caller, maybe
    as a slice of a wider GEMM) mixed by dense gates `[N, H, E]` -> `[N, H, dh]`. Its backward keeps `inputs` and
    `weight` (which the caller's GEMM keeps too) instead of `every`, and recomputes `every` for the gates' gradient."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (every, gates)):
        return _MixRecomputed.apply(every, gates, inputs, weight)
    return _mix_rounded_once(every, gates)


def _mix_rounded_once(every: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """`every` `[N, H * E * dh]` mixed by dense gates `[N, H, E]` in the gates' dtype where it is wider (float32 gates
    under autocast: the products and their sum in float32, as in eager's per-head mix), rounded to `every`'s dtype
    once at the end."""
    n, heads, experts = gates.shape
    return (every.view(n, heads, experts, -1) * gates.unsqueeze(-1)).sum(2).to(every.dtype)


def _fused(inputs, expert_index, weight, gates, out_groups, grouped_routing=False):
    # One projection alone (the MLP, other MoE models, or an attention side the layer does not fuse): for SwitchHead's
    # per-head sides `_per_head` with its lean backwards, under autocast too; otherwise "eager"'s rule.
    if grouped_routing and gates is not None and min(inputs.shape[1], out_groups) == 1 and expert_index.shape[0]:
        mix_dtype = inputs.dtype  # the values' gates as eager's per-head mix has them: in the inputs' own dtype
        inputs, weight = autocast_operands(inputs, weight)
        heads = max(inputs.shape[1], out_groups)
        if inputs.shape[1] == 1:
            dense = dense_head_gates(expert_index, gates, heads, weight.shape[0] // heads, mix_dtype)
            linear = _as_linear_weight(weight)
            return mix_values_recomputed(F.linear(inputs[:, 0], linear), dense, inputs[:, 0], linear)
        # the output side's gated rows in the rows' (autocast) dtype, as eager's: one dtype for the lean backward
        dense = dense_head_gates(expert_index, gates, heads, weight.shape[0] // heads, inputs.dtype)
        return head_expert_output(inputs, dense, weight, lean=True).unsqueeze(1)
    return _eager(inputs, expert_index, weight, gates, out_groups, grouped_routing)


# The one table, keyed by the values of `config.experts_implementation`: every entry takes (inputs, expert_index,
# weight, gates, out_groups, grouped_routing=False). Our names differ from Transformers' "batched_mm" / "grouped_mm"
# (its MLP-only experts functions): a name means one function, and `experts_integration.register` puts every entry
# but "eager" into Transformers' table under the same name, so a SwitchAll model's MLP runs what its attention runs.
EXPERTS_IMPLEMENTATIONS: dict[str, Callable] = {
    "eager": _eager,
    "cvmm": _cvmm,
    "switchhead_batched": _batched,
    "switchhead_grouped": _grouped,
    "switchhead_auto": _auto,
    "switchhead_fused": _fused,
}
DEFAULT_EXPERTS_IMPLEMENTATION = "switchhead_auto"


def default_experts_implementation(registered) -> str:
    """The experts implementation a model runs unless told otherwise: "switchhead_auto" (per call, "eager"'s rule
    for SwitchHead's per-head projections and "cvmm" for any other routing) once it is registered in `registered`
    (Transformers' `ALL_EXPERTS_FUNCTIONS`: the model file registers it on import), else "eager"."""
    return DEFAULT_EXPERTS_IMPLEMENTATION if DEFAULT_EXPERTS_IMPLEMENTATION in registered else "eager"


def expert_projection(
    inputs: torch.Tensor,
    expert_index: torch.Tensor,
    weight: torch.Tensor,
    gates: torch.Tensor | None = None,
    out_groups: int = 1,
    implementation: str = DEFAULT_EXPERTS_IMPLEMENTATION,
    grouped_routing: bool = False,
) -> torch.Tensor:
    """The expert projection (see the module docstring for the contract and the table), for callers outside a model.

    Args:
        inputs: `[N, R, d_in]`.
        expert_index: `[N, S]` integer indices into `weight`'s first dimension.
        weight: `[G, d_in, d_out]`.
        gates: `[N, S]` or None.
        out_groups: output rows per token when `gates` is given.
        implementation: a key of `EXPERTS_IMPLEMENTATIONS` (any other name is a ValueError).
        grouped_routing: the caller guarantees that the slots of group h (input row or output group h) pick among
            experts h * E .. h * E + E - 1, which lets "eager" take the per-head formulation.

    Returns:
        `[N, S, d_out]` without gates, `[N, out_groups, d_out]` with them.
    """
    return lookup(implementation)(inputs, expert_index.long(), weight, gates, out_groups, grouped_routing)


def lookup(implementation: str) -> Callable:
    """The table's function for `implementation`; a name it lacks is a ValueError that lists the table."""
    try:
        return EXPERTS_IMPLEMENTATIONS[implementation]
    except KeyError:
        raise ValueError(
            f"experts_implementation={implementation!r} has no expert projection: SwitchHead's expert projections "
            f"run {sorted(EXPERTS_IMPLEMENTATIONS)} (Transformers' 'batched_mm' / 'grouped_mm' are MLP experts "
            f"functions; ours are 'switchhead_batched' / 'switchhead_grouped')"
        ) from None


# ---------------------------------------------------------------------------------------------------- per head
# "per_head" holds the top-k as dense gates `[N, H, E]` (zero for the experts not chosen) and runs against every
# expert of a head: the work of "all_experts" in a handful of ops (training, batch decoding). Under autograd the
# custom functions keep what their backward needs: the value side its arguments and every expert's products
# `[N, H * E, dh]` (the gates' gradient reads them), the output side only its arguments (the gated input rows are
# elementwise, recomputed).
def dense_head_gates(expert_index: torch.Tensor, gates: torch.Tensor, num_groups: int, num_experts: int,
                     dtype: torch.dtype) -> torch.Tensor:
    """`[N, S]` global expert ids (group h's slots pick ids in `[h * E, (h + 1) * E)`) and their gates -> the dense
    gates `[N, groups, E]` in `dtype` (summed where an id repeats, zero where no slot picked the expert)."""
    dense = gates.new_zeros(gates.shape[0], num_groups * num_experts)
    return dense.scatter_add_(1, expert_index, gates).view(-1, num_groups, num_experts).to(dtype)


def _every_expert_values(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """inputs `[N, d]`, weight `[H * E, d, dh]` -> every expert's projection `[H * E, N, dh]`."""
    return torch.matmul(inputs.unsqueeze(0), weight)


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
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors) and not _autocast_on(tensors[0])


def head_expert_values(inputs: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head expert values: inputs `[N, d]`, dense gates `[N, H, E]` (`dense_head_gates`), weight
    `[H * E, d, dh]` (head h's experts in rows h * E .. h * E + E - 1) -> `[N, H, dh]`,
    out[n, h] = sum_e gates[n, h, e] * inputs[n] @ weight[h * E + e]."""
    if _lean_autograd(inputs, gates, weight):
        return _HeadExpertValues.apply(inputs, gates, weight)
    return _mix_values(_every_expert_values(inputs, weight), gates)


def head_expert_output(rows: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor, lean: bool = False
                       ) -> torch.Tensor:
    """Per-head expert outputs summed over heads: rows `[N, H, dh]`, dense gates `[N, H, E]`, weight
    `[H * E, dh, d]` -> `[N, d]`, out[n] = sum_{h, e} gates[n, h, e] * rows[n, h] @ weight[h * E + e].
    `lean`: the operands are in one dtype (`autocast_operands`), so the lean backward runs under autocast too."""
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (rows, gates, weight))
    if (lean and grads) or _lean_autograd(rows, gates, weight):
        return _HeadExpertOutput.apply(rows, gates, weight)
    return _head_output_mixed(rows, gates) @ weight.reshape(-1, weight.shape[2])


# ---------------------------------------------------------------------------------------------------- activation
class _ReluFromOutput(torch.autograd.Function):
    """ReLU whose backward multiplies by the sign of its output (1 where it passed, 0 where it clipped): the same
    gradient as `F.relu`'s (which masks `output <= 0`), written so that AOTAutograd's partitioner keeps only the
    output, which the next projection's weight gradient needs anyway, and recomputes the mask in the fused backward
    kernel. Given `F.relu`, its default partitioner makes the forward also store a boolean mask, and inductor's CPU
    kernels for storing and reading it are slow (benchmarks/inductor_relu_mask.py)."""

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
