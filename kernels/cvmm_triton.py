"""The CVMM op in Triton: the bodies of the custom ops in `cvmm.py` (tested against `expert_ops.naive`).

Notation: N tokens, S slots per token, M = N * S slots, flat slot m = n * S + s. Slot m reads input row
`m // (S // R)` of `inputs.view(N * R, d_in)` and, with gates, adds into output row `m // (S // out_groups)` of
`out.view(N * out_groups, d_out)`.

Two kernels cover the forward and the backward:

- `_gathered_expert_matmul`: for the slots sorted by expert, `out[m // OUT_DIV] (+)= gate_m * A[m // A_DIV] @ W_e`.
  A program owns BLOCK_M consecutive sorted slots and BLOCK_N output columns. A block is usually one expert; at
  an expert boundary the program loops over the few experts it holds, masking the other rows (the authors'
  trick, which needs no per-expert padding). Forward: A = inputs, W = weight, out = output. Backward for the
  inputs: A = grad, W = weight^T (a strided view), out = d inputs; the same program also forms the gate gradient
  `<x_m, grad_row W_e^T>` from the tile it already holds, so d gates costs no extra matmul.
  When several slots share an output row (the gated sum over experts and heads; the input rows read by several
  slots) the epilogue stores each slot to its own fp32 row and the host sums the slots in a fixed order (the
  default, deterministic), or, with atomics asked for, adds with fp32 atomics into a zeroed fp32 buffer.
- `_expert_weight_grad`: `dW_e = sum_{m of e} x_m^T dy_m`, one program per (expert, d_in tile, d_out tile),
  looping over that expert's contiguous block of sorted slots: no atomics, deterministic. When that grid is too
  small to fill the GPU, SPLIT programs share an expert's rows and write fp32 partial sums that the host adds in
  a fixed order (still deterministic).

Row indices are computed from the slot id (`m // A_DIV`), so nothing of size `[M, d]` is gathered on the host.
Any strides are accepted (they are passed to the kernels); fp32 uses IEEE dots unless
`torch.set_float32_matmul_precision("high")` (or "medium") allows TF32, as for `torch.mm`.

Register budget (`scripts/gpu/gpu_audit.py` compiles every launch and config for sm_80, sm_90 and sm_100 and finds no
spill): each kernel is one flat loop (over (expert, k step) pairs in the row kernel), because a loop nested in a
data-dependent one made the compiler keep a second copy of every load address live. `ALIGN`, a power of two that
divides the sizes and row strides, tells the compiler that rows start on vector boundaries and that the masks are
constant over ALIGN columns, so the loads are vector copies into shared memory (`cp.async`) rather than one
register per element. A reduction step holds the same bytes in every dtype (half as many fp32 elements). Launches
whose rows cannot be loaded as 8-byte vectors (`VECTOR_LOADS` false: odd sizes, transposed inputs) and IEEE fp32
launches (FMA dots, whose operands sit in registers) take 16-deep steps and only the narrow configs
(`_narrow_tiles`).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _configs(sizes: list[tuple[int, int, int, int, int]], names: tuple[str, str, str]) -> list[triton.Config]:
    """(block_a, block_b, block_c, warps, stages) tuples -> autotune configs; one small config in the interpreter."""
    if INTERPRET:  # tl.dot needs blocks >= 16; one config so the interpreter never benchmarks
        return [triton.Config(dict(zip(names, (16, 16, 16))), num_warps=1, num_stages=1)]
    return [triton.Config(dict(zip(names, size[:3])), num_warps=size[3], num_stages=size[4]) for size in sizes]


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): row tiles over slots, column tiles over d_out (d_in in backward)
_ROW_CONFIGS = _configs(
    [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 8, 3), (64, 64, 64, 4, 3),
     (64, 32, 64, 4, 4), (128, 32, 64, 4, 4)],
    ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
)
# (BLOCK_K, BLOCK_N, BLOCK_M, warps, stages): d_in tile, d_out tile, slots reduced per step
_WEIGHT_CONFIGS = _configs(
    [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 3), (128, 128, 32, 4, 4),
     (64, 32, 128, 4, 4), (128, 32, 64, 4, 4)],
    ("BLOCK_K", "BLOCK_N", "BLOCK_M"),
)


def _narrow_tiles(**largest: int):
    """An autotuner `early_config_prune` that leaves only the configs whose blocks are at most `largest` (e.g.
    BLOCK_N=32) to IEEE fp32 launches, whose dots run on the FMA units with each thread's rows and columns of both
    operands in registers, and to launches without vector loads, which hold an address per element: the larger
    tiles spill there (scripts/gpu/gpu_audit.py). Vector-load tensor-core launches keep every config."""
    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        if kwargs.get("PRECISION") != "ieee" and kwargs.get("VECTOR_LOADS", True):
            return configs
        return [c for c in configs if all(c.kwargs[name] <= most for name, most in largest.items())] or configs

    return prune


@triton.jit
def _below(offs, bound, ALIGN: tl.constexpr):
    """`offs < bound` for a bound that is a multiple of ALIGN, in a form whose value the compiler sees is constant
    over runs of ALIGN offsets, so that a masked load of such a run is one vector load."""
    return offs // ALIGN < bound // ALIGN


@triton.autotune(configs=_ROW_CONFIGS,
                 key=["K", "NOUT", "HAS_GATES", "ATOMIC", "COMPUTE_DGATE", "PRECISION", "ALIGN", "VECTOR_LOADS"],
                 reset_to_zero=["out_ptr", "dgate_ptr"],
                 prune_configs_by=dict(early_config_prune=_narrow_tiles(BLOCK_N=32)))
@triton.jit
def _gathered_expert_matmul(
    a_ptr, stride_am, stride_ak,  # A [rows, K]; slot m reads row m // A_DIV
    w_ptr, stride_we, stride_wk, stride_wn,  # W [G, K, NOUT] (any strides: the backward passes W^T)
    sorted_expert_ptr, order_ptr,  # [M]: expert of each sorted slot, and the slot id
    gate_ptr,  # [M] gates by slot id (HAS_GATES)
    out_ptr, stride_om, stride_on,  # out [rows, NOUT]; slot m writes row m // OUT_DIV
    x_ptr, stride_xm, stride_xn,  # (COMPUTE_DGATE) forward inputs [rows, NOUT]; slot m reads row m // X_DIV
    dgate_ptr,  # (COMPUTE_DGATE) fp32 [cdiv(NOUT, min BLOCK_N), M]: one partial sum per column tile
    M, K, NOUT, A_DIV, OUT_DIV, X_DIV,
    HAS_GATES: tl.constexpr, ATOMIC: tl.constexpr, COMPUTE_DGATE: tl.constexpr, PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,  # divides K, NOUT and the row strides of A, W, out and x (see `_alignment`)
    VECTOR_LOADS: tl.constexpr,  # ALIGN elements of A are >= 8 bytes: full BLOCK_K steps
    W_N_CONTIGUOUS: tl.constexpr,  # stride_wn == 1 (forward); else the row stride of W is stride_wn
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # reduction step: BLOCK_K 16-bit elements' worth (half as many fp32, at least the 16 a dot needs), or 16 where
    # loads are scalar or dots run on FMA units
    K_STEP: tl.constexpr = (max(16, BLOCK_K * 16 // a_ptr.dtype.element_ty.primitive_bitwidth)
                            if VECTOR_LOADS and PRECISION != "ieee" else 16)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(NOUT, BLOCK_N)
    pid_m = pid // tiles_n  # neighbouring programs share the same rows of A
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    experts = tl.load(sorted_expert_ptr + offs_m, mask=row_ok, other=-1)
    slot = tl.load(order_ptr + offs_m, mask=row_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = _below(offs_n, NOUT, ALIGN)
    offs_k = tl.arange(0, K_STEP)
    # offsets of the first k step; each step adds a scalar (k0 and the expert's matrix) to them
    a_tile = tl.multiple_of((slot // A_DIV).to(tl.int64) * stride_am, ALIGN)[:, None] + offs_k[None, :] * stride_ak
    w_k = offs_k * stride_wk
    w_n = offs_n * stride_wn
    if W_N_CONTIGUOUS:
        w_k = tl.multiple_of(w_k, ALIGN)
    else:
        w_n = tl.multiple_of(w_n, ALIGN)
    w_tile = w_k[:, None] + w_n[None, :]

    # experts are sorted: this block holds experts first..last (usually first == last); one flat loop over
    # (expert, k step), the rows of the other experts masked to zero, all into one accumulator
    # (the ids are 16- or 32-bit sort keys: widened so that e * stride_we cannot overflow)
    first = tl.load(sorted_expert_ptr + pid_m * BLOCK_M).to(tl.int64)
    last = tl.load(sorted_expert_ptr + tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1).to(tl.int64)
    k_steps = tl.cdiv(K, K_STEP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, (last - first + 1) * k_steps):
        e = first + step // k_steps
        k0 = (step % k_steps) * K_STEP
        k_ok = _below(offs_k, K - k0, ALIGN)
        rows_e = row_ok & (experts == e)
        a = tl.load(a_ptr + k0 * stride_ak + a_tile, mask=rows_e[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + tl.multiple_of(e * stride_we + k0 * stride_wk, ALIGN) + w_tile,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)

    tile_ok = row_ok[:, None] & col_ok[None, :]
    if COMPUTE_DGATE:  # d gate_m = <x_m, grad_row W_e^T>, summed over this column tile
        x_rows = tl.multiple_of((slot // X_DIV).to(tl.int64) * stride_xm, ALIGN)
        x = tl.load(x_ptr + x_rows[:, None] + offs_n[None, :] * stride_xn, mask=tile_ok, other=0.0)
        tl.store(dgate_ptr + pid_n * M + slot, tl.sum(acc * x.to(tl.float32), axis=1), mask=row_ok)
    if HAS_GATES:
        acc = acc * tl.load(gate_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_rows = tl.multiple_of((slot // OUT_DIV).to(tl.int64) * stride_om, ALIGN)
    out_ptrs = out_ptr + out_rows[:, None] + offs_n[None, :] * stride_on
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=tile_ok)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.autotune(configs=_WEIGHT_CONFIGS, key=["K", "NOUT", "HAS_GATES", "PRECISION", "ALIGN", "VECTOR_LOADS"],
                 prune_configs_by=dict(early_config_prune=_narrow_tiles(BLOCK_K=64, BLOCK_N=32)))
@triton.jit
def _expert_weight_grad(
    x_ptr, stride_xm, stride_xk,  # forward inputs [rows, K]; slot m reads row m // X_DIV
    g_ptr, stride_gm, stride_gn,  # output gradient [rows, NOUT]; slot m reads row m // G_DIV
    gate_ptr, order_ptr, offsets_ptr,  # gates by slot id; sorted slot ids; [G + 1] start of each expert's block
    dw_ptr, stride_ds, stride_de, stride_dk, stride_dn,  # d weight [SPLIT, G, K, NOUT] (partial sums if SPLIT > 1)
    K, NOUT, X_DIV, G_DIV, SPLIT,
    HAS_GATES: tl.constexpr, PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,  # divides K, NOUT and the row strides of x, the gradient and d weight
    VECTOR_LOADS: tl.constexpr,  # ALIGN elements of x are >= 8 bytes: full BLOCK_M steps
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # slots per step: BLOCK_M for 16-bit operands (half for fp32, at least 16), or 16 where loads are scalar or
    # dots run on FMA units
    M_STEP: tl.constexpr = (max(16, BLOCK_M * 16 // x_ptr.dtype.element_ty.primitive_bitwidth)
                            if VECTOR_LOADS and PRECISION != "ieee" else 16)
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(NOUT, BLOCK_N)
    e = pid // (SPLIT * tiles_k * tiles_n)
    part = (pid // (tiles_k * tiles_n)) % SPLIT  # which share of the expert's rows this program reduces
    pid_k = (pid // tiles_n) % tiles_k
    pid_n = pid % tiles_n
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = _below(offs_k, K, ALIGN)
    n_ok = _below(offs_n, NOUT, ALIGN)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    share = tl.cdiv(tl.cdiv(end - start, SPLIT), M_STEP) * M_STEP
    lo = start + part * share
    hi = tl.minimum(lo + share, end)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for p0 in range(lo, hi, M_STEP):  # an empty expert (or share) runs no step and stores zeros
        offs_p = p0 + tl.arange(0, M_STEP)
        p_ok = offs_p < hi
        slot = tl.load(order_ptr + offs_p, mask=p_ok, other=0)
        x_rows = tl.multiple_of((slot // X_DIV).to(tl.int64) * stride_xm, ALIGN)
        g_rows = tl.multiple_of((slot // G_DIV).to(tl.int64) * stride_gm, ALIGN)
        x_t = tl.load(x_ptr + x_rows[None, :] + offs_k[:, None] * stride_xk,
                      mask=k_ok[:, None] & p_ok[None, :], other=0.0)  # [BLOCK_K, M_STEP]
        dy = tl.load(g_ptr + g_rows[:, None] + offs_n[None, :] * stride_gn,
                     mask=p_ok[:, None] & n_ok[None, :], other=0.0)  # [M_STEP, BLOCK_N]
        if HAS_GATES:  # on the x side: a register operand of the dot, where dy's tile goes from memory to the dot
            gate = tl.load(gate_ptr + slot, mask=p_ok, other=0.0).to(tl.float32)
            x_t = (x_t.to(tl.float32) * gate[None, :]).to(dy.dtype)
        acc += tl.dot(x_t, dy, input_precision=PRECISION)
    dw_matrix = tl.multiple_of(part.to(tl.int64) * stride_ds + e.to(tl.int64) * stride_de, ALIGN)
    dw_ptrs = dw_ptr + dw_matrix + tl.multiple_of(offs_k * stride_dk, ALIGN)[:, None] + offs_n[None, :] * stride_dn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored for fp16 / bf16 operands


def _alignment(*sizes_and_strides: int) -> int:
    """The largest power of two, at most 8, that divides every size and row stride given (a stride 0 counts as
    divisible): the kernels' `ALIGN`."""
    common = math.gcd(*sizes_and_strides)
    return 8 if common == 0 else min(8, common & -common)


def _min_block(configs: list[triton.Config], name: str) -> int:
    return min(config.kwargs[name] for config in configs)


def _rows_matmul(a, w, sorted_expert, order, gates, out_rows, out_div, a_div, out_dtype, deterministic,
                 x=None, x_div=1):
    """Launch `_gathered_expert_matmul`; returns (out `[out_rows, NOUT]`, d gates `[M]` fp32 or None).

    a `[rows_a, K]`, w `[G, K, NOUT]`; slot m reads a[m // a_div] and adds into out[m // out_div].
    """
    m = order.numel()
    k, n_out = w.shape[1], w.shape[2]
    shared = out_div > 1
    atomic = shared and not deterministic
    if atomic:  # fp32 atomics into a zeroed buffer
        out = torch.zeros(out_rows, n_out, device=a.device, dtype=torch.float32)
    elif shared:  # deterministic: one row per slot, summed below in slot order
        out = torch.empty(m, n_out, device=a.device, dtype=torch.float32)
    else:
        out = torch.empty(out_rows, n_out, device=a.device, dtype=out_dtype)
    compute_dgate = x is not None
    dgate = torch.zeros(triton.cdiv(n_out, _min_block(_ROW_CONFIGS, "BLOCK_N")) if compute_dgate else 1,
                        m if compute_dgate else 1, device=a.device, dtype=torch.float32)
    gate_arg = gates if gates is not None else order
    x_arg = x if compute_dgate else a

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n_out, meta["BLOCK_N"]),)

    w_n_contiguous = w.stride(2) == 1
    align = _alignment(k, n_out, a.stride(0), w.stride(0), w.stride(1) if w_n_contiguous else w.stride(2),
                       out.stride(0), x_arg.stride(0))

    _gathered_expert_matmul[grid](
        a, a.stride(0), a.stride(1),
        w, w.stride(0), w.stride(1), w.stride(2),
        sorted_expert, order, gate_arg,
        out, out.stride(0), out.stride(1),
        x_arg, x_arg.stride(0), x_arg.stride(1), dgate,
        m, k, n_out, a_div, 1 if (shared and not atomic) else out_div, x_div,
        HAS_GATES=gates is not None, ATOMIC=atomic, COMPUTE_DGATE=compute_dgate,
        PRECISION=_precision(a.dtype), ALIGN=align, VECTOR_LOADS=align * a.element_size() >= 8,
        W_N_CONTIGUOUS=w_n_contiguous,
    )
    if shared and not atomic:
        out = out.view(out_rows, out_div, n_out).sum(1)
    return out.to(out_dtype), (dgate.sum(0) if compute_dgate else None)


def cvmm_forward_triton(inputs, weight, gates, sorted_expert, order, out_groups, deterministic=False):
    """The forward on slots sorted by expert (`sorted_expert`, their slot ids `order`, both `[M]`) -> `[N, groups,
    d_out]` (groups: `out_groups` with gates, else S)."""
    n, r, d_in = inputs.shape
    slots = order.numel() // n
    groups = out_groups if gates is not None else slots
    a = inputs.reshape(n * r, d_in)
    flat_gates = gates.reshape(-1).contiguous() if gates is not None else None
    out, _ = _rows_matmul(a, weight, sorted_expert, order, flat_gates, n * groups, slots // groups, slots // r,
                          inputs.dtype, deterministic)
    return out.view(n, groups, weight.shape[2])


def cvmm_backward_triton(grad, inputs, weight, gates, sorted_expert, order, out_groups, need_inputs, need_weight,
                         deterministic=False):
    """(d inputs, d weight, d gates) of `cvmm_forward_triton`; a gradient not needed is an empty tensor."""
    n, r, d_in = inputs.shape
    slots = order.numel() // n
    g_count, _, d_out = weight.shape
    groups = out_groups if gates is not None else slots
    grad_rows = grad.reshape(n * groups, d_out)
    x = inputs.reshape(n * r, d_in)
    flat_gates = gates.reshape(-1).contiguous() if gates is not None else None
    d_inputs, d_gates = inputs.new_empty(0), grad.new_empty(0)
    if need_inputs or gates is not None:
        d_x, d_gate_flat = _rows_matmul(grad_rows, weight.transpose(1, 2), sorted_expert, order, flat_gates, n * r,
                                        slots // r, slots // groups, inputs.dtype, deterministic,
                                        x=x if gates is not None else None, x_div=slots // r)
        if need_inputs:
            d_inputs = d_x.view(n, r, d_in)
        if gates is not None:
            d_gates = d_gate_flat.view(n, slots).to(gates.dtype)
    d_weight = weight.new_empty(0)
    if need_weight:
        offsets = torch.searchsorted(sorted_expert, torch.arange(g_count + 1, device=weight.device,
                                                                 dtype=sorted_expert.dtype))
        split = _weight_grad_split(weight.device, g_count, d_in, d_out)
        if split > 1:  # fp32 partial sums over shares of each expert's rows, added below in a fixed order
            d_weight = torch.empty(split, g_count, d_in, d_out, device=weight.device, dtype=torch.float32)
        else:
            d_weight = torch.empty(1, g_count, d_in, d_out, device=weight.device, dtype=weight.dtype)

        align = _alignment(d_in, d_out, x.stride(0), grad_rows.stride(0), *d_weight.stride()[:3])

        def grid(meta):
            return (g_count * split * triton.cdiv(d_in, meta["BLOCK_K"]) * triton.cdiv(d_out, meta["BLOCK_N"]),)

        _expert_weight_grad[grid](
            x, x.stride(0), x.stride(1),
            grad_rows, grad_rows.stride(0), grad_rows.stride(1),
            flat_gates if gates is not None else order, order, offsets,
            d_weight, d_weight.stride(0), d_weight.stride(1), d_weight.stride(2), d_weight.stride(3),
            d_in, d_out, slots // r, slots // groups, split,
            HAS_GATES=gates is not None, PRECISION=_precision(inputs.dtype), ALIGN=align,
            VECTOR_LOADS=align * x.element_size() >= 8,
        )
        d_weight = d_weight.sum(0).to(weight.dtype) if split > 1 else d_weight[0]
    return d_inputs, d_weight, d_gates


def _weight_grad_split(device: torch.device, experts: int, d_in: int, d_out: int) -> int:
    """How many programs share one expert's rows in the weight gradient, so that small problems fill the GPU.

    (A 47M layer has 10 experts of 412 x 76: only ~40 output tiles, against 132 SMs on an H100.)
    """
    tiles = experts * triton.cdiv(d_in, 128) * triton.cdiv(d_out, 128)
    return max(1, min(8, triton.cdiv(2 * _multiprocessors(device), tiles)))


def _multiprocessors(device: torch.device) -> int:
    """The GPU's multiprocessor count (4 for the interpreter's CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
