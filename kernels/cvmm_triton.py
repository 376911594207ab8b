"""The CVMM op in Triton: the fast twin of `cvmm_reference.py` (same arguments, same results).

Two kernels cover the forward and the backward:

- `_gathered_expert_matmul`: for the slots sorted by expert, `out[m // OUT_DIV] (+)= gate_m * A[m // A_DIV] @ W_e`.
  A program owns BLOCK_M consecutive sorted slots and BLOCK_N output columns. A block is usually one expert; at
  an expert boundary the program loops over the few experts it holds, masking the other rows (the authors'
  trick, which needs no per-expert padding). Forward: A = inputs, W = weight, out = output. Backward for the
  inputs: A = grad, W = weight^T (a strided view), out = d inputs; the same program also forms the gate gradient
  `<x_m, grad_row W_e^T>` from the tile it already holds, so d gates costs no extra matmul.
  When several slots share an output row (the gated sum over experts and heads; the input rows read by several
  slots) the epilogue adds with fp32 atomics into a zeroed fp32 buffer; in deterministic mode it stores each slot
  to its own row and the host sums the slots in a fixed order.
- `_expert_weight_grad`: `dW_e = sum_{m of e} x_m^T dy_m`, one program per (expert, d_in tile, d_out tile),
  looping over that expert's contiguous block of sorted slots: no atomics, deterministic. When that grid is too
  small to fill the GPU, SPLIT programs share an expert's rows and write fp32 partial sums that the host adds in
  a fixed order (still deterministic).

Row indices are computed from the slot id (`m // A_DIV`), so nothing of size `[M, d]` is gathered on the host.
Any strides are accepted (they are passed to the kernels); fp32 uses IEEE dots unless
`torch.set_float32_matmul_precision("high")` (or "medium") allows TF32, as for `torch.mm`.
"""

from __future__ import annotations

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
    [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4), (64, 64, 64, 4, 4),
     (128, 256, 64, 8, 3), (64, 32, 64, 2, 4), (128, 32, 64, 4, 4)],
    ("BLOCK_M", "BLOCK_N", "BLOCK_K"),
)
# (BLOCK_K, BLOCK_N, BLOCK_M, warps, stages): d_in tile, d_out tile, slots reduced per step
_WEIGHT_CONFIGS = _configs(
    [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 32, 4, 4),
     (64, 32, 128, 4, 4), (128, 32, 64, 4, 4)],
    ("BLOCK_K", "BLOCK_N", "BLOCK_M"),
)


@triton.autotune(configs=_ROW_CONFIGS, key=["K", "NOUT", "HAS_GATES", "ATOMIC", "COMPUTE_DGATE"],
                 reset_to_zero=["out_ptr", "dgate_ptr"])
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(NOUT, BLOCK_N)
    pid_m = pid // tiles_n  # neighbouring programs share the same rows of A
    pid_n = pid % tiles_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    experts = tl.load(sorted_expert_ptr + offs_m, mask=row_ok, other=-1)
    slot = tl.load(order_ptr + offs_m, mask=row_ok, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < NOUT
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (slot // A_DIV).to(tl.int64)

    # experts are sorted: this block holds experts first..last (usually first == last)
    first = tl.load(sorted_expert_ptr + pid_m * BLOCK_M)
    last = tl.load(sorted_expert_ptr + tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1)  # int64: e * stride_we is 64-bit
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for e in range(first, last + 1):
        rows_e = row_ok & (experts == e)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        w_ptrs = w_ptr + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=rows_e[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(a, w, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            w_ptrs += BLOCK_K * stride_wk

    tile_ok = row_ok[:, None] & col_ok[None, :]
    if COMPUTE_DGATE:  # d gate_m = <x_m, grad_row W_e^T>, summed over this column tile
        x_rows = (slot // X_DIV).to(tl.int64)
        x = tl.load(x_ptr + x_rows[:, None] * stride_xm + offs_n[None, :] * stride_xn, mask=tile_ok, other=0.0)
        tl.store(dgate_ptr + pid_n * M + slot, tl.sum(acc * x.to(tl.float32), axis=1), mask=row_ok)
    if HAS_GATES:
        acc = acc * tl.load(gate_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_rows = (slot // OUT_DIV).to(tl.int64)
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=tile_ok)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)


@triton.autotune(configs=_WEIGHT_CONFIGS, key=["K", "NOUT", "HAS_GATES"])
@triton.jit
def _expert_weight_grad(
    x_ptr, stride_xm, stride_xk,  # forward inputs [rows, K]; slot m reads row m // X_DIV
    g_ptr, stride_gm, stride_gn,  # output gradient [rows, NOUT]; slot m reads row m // G_DIV
    gate_ptr, order_ptr, offsets_ptr,  # gates by slot id; sorted slot ids; [G + 1] start of each expert's block
    dw_ptr, stride_ds, stride_de, stride_dk, stride_dn,  # d weight [SPLIT, G, K, NOUT] (partial sums if SPLIT > 1)
    K, NOUT, X_DIV, G_DIV, SPLIT,
    HAS_GATES: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_n = tl.cdiv(NOUT, BLOCK_N)
    e = pid // (SPLIT * tiles_k * tiles_n)
    part = (pid // (tiles_k * tiles_n)) % SPLIT  # which share of the expert's rows this program reduces
    pid_k = (pid // tiles_n) % tiles_k
    pid_n = pid % tiles_n
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    n_ok = offs_n < NOUT
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    share = tl.cdiv(tl.cdiv(end - start, SPLIT), BLOCK_M) * BLOCK_M
    lo = start + part * share
    hi = tl.minimum(lo + share, end)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for p0 in range(lo, hi, BLOCK_M):  # an empty expert (or share) runs no step and stores zeros
        offs_p = p0 + tl.arange(0, BLOCK_M)
        p_ok = offs_p < hi
        slot = tl.load(order_ptr + offs_p, mask=p_ok, other=0)
        x_rows = (slot // X_DIV).to(tl.int64)
        g_rows = (slot // G_DIV).to(tl.int64)
        x_t = tl.load(x_ptr + x_rows[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                      mask=k_ok[:, None] & p_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
        dy = tl.load(g_ptr + g_rows[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                     mask=p_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
        if HAS_GATES:
            gate = tl.load(gate_ptr + slot, mask=p_ok, other=0.0).to(tl.float32)
            dy = (dy.to(tl.float32) * gate[:, None]).to(x_t.dtype)
        acc += tl.dot(x_t, dy, input_precision=PRECISION)
    dw_ptrs = dw_ptr + part.to(tl.int64) * stride_ds + e.to(tl.int64) * stride_de + offs_k[:, None] * stride_dk \
        + offs_n[None, :] * stride_dn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"  # ignored for fp16 / bf16 operands


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

    _gathered_expert_matmul[grid](
        a, a.stride(0), a.stride(1),
        w, w.stride(0), w.stride(1), w.stride(2),
        sorted_expert, order, gate_arg,
        out, out.stride(0), out.stride(1),
        x_arg, x_arg.stride(0), x_arg.stride(1), dgate,
        m, k, n_out, a_div, 1 if (shared and not atomic) else out_div, x_div,
        HAS_GATES=gates is not None, ATOMIC=atomic, COMPUTE_DGATE=compute_dgate,
        PRECISION=_precision(a.dtype),
    )
    if shared and not atomic:
        out = out.view(out_rows, out_div, n_out).sum(1)
    return out.to(out_dtype), (dgate.sum(0) if compute_dgate else None)


def cvmm_forward_triton(inputs, weight, gates, sorted_expert, order, out_groups, deterministic=False):
    """Same contract as `cvmm_reference.cvmm_forward_reference`."""
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
    """Same contract as `cvmm_reference.cvmm_backward_reference`."""
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

        def grid(meta):
            return (g_count * split * triton.cdiv(d_in, meta["BLOCK_K"]) * triton.cdiv(d_out, meta["BLOCK_N"]),)

        _expert_weight_grad[grid](
            x, x.stride(0), x.stride(1),
            grad_rows, grad_rows.stride(0), grad_rows.stride(1),
            flat_gates if gates is not None else order, order, offsets,
            d_weight, d_weight.stride(0), d_weight.stride(1), d_weight.stride(2), d_weight.stride(3),
            d_in, d_out, slots // r, slots // groups, split,
            HAS_GATES=gates is not None, PRECISION=_precision(inputs.dtype),
        )
        d_weight = d_weight.sum(0).to(weight.dtype) if split > 1 else d_weight[0]
    return d_inputs, d_weight, d_gates


def _weight_grad_split(device: torch.device, experts: int, d_in: int, d_out: int) -> int:
    """How many programs share one expert's rows in the weight gradient, so that small problems fill the GPU.

    (A 47M layer has 10 experts of 412 x 76: only ~40 output tiles, against 132 SMs on an H100.)
    """
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    tiles = experts * triton.cdiv(d_in, 128) * triton.cdiv(d_out, 128)
    return max(1, min(8, triton.cdiv(2 * multiprocessors, tiles)))
