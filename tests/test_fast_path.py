"""The sync-free expert path: every formulation held to the simple reference twin, and no host syncs.

The twin is `expert_projection_torch(..., implementation="reference")` of the modeling file (gather each slot's
matrix, one einsum). Every other formulation, in the modeling file (the Hub copy) and in `switchhead.kernels`
(the package's CPU path and the bodies of its custom ops), must give the same outputs and gradients w.r.t.
inputs, weight and gates.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from switchhead import kernels
from switchhead.kernels import cvmm_reference
from switchhead.modeling_switchhead import EXPERT_IMPLEMENTATIONS, expert_projection_torch

sys.path.insert(0, str(Path(__file__).parent))
from cvmm_cases import USES, random_case  # noqa: E402

SYNC_OPS = ("aten::item", "aten::_local_scalar_dense")


def _twin(case):
    return expert_projection_torch(*case.args(), implementation="reference")


def _grads(out, leaves, seed=1):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, leaves, upstream)


def _assert_same(got_out, want_out, got_grads, want_grads, dtype):
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    assert got_out.shape == want_out.shape and got_out.dtype == want_out.dtype
    torch.testing.assert_close(got_out, want_out, **tol)
    for got, want in zip(got_grads, want_grads):
        assert got is not None and got.shape == want.shape
        torch.testing.assert_close(got, want, **tol)


def test_reference_twin_is_the_definition():
    # the twin itself against a per-slot Python loop over the contract's definition
    case = random_case(torch.Generator().manual_seed(0), "output", tokens=4, heads=2, experts=3, k=2, d_in=5,
                       d_out=3)
    n, slots = case.expert_index.shape
    rows_per_token = case.inputs.shape[1]
    out = torch.zeros(n, case.out_groups, case.weight.shape[2], dtype=torch.float64)
    for t in range(n):
        for s in range(slots):
            x = case.inputs[t, s // (slots // rows_per_token)]
            y = x @ case.weight[case.expert_index[t, s]]
            out[t, s // (slots // case.out_groups)] += case.gates[t, s] * y
    torch.testing.assert_close(_twin(case), out, rtol=1e-12, atol=1e-12)


# d_in / d_out multiples of 4, so that float32 "grouped" really runs torch._grouped_mm (float64 falls back)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_every_formulation_matches_the_twin(use, k, dtype):
    generator = torch.Generator().manual_seed(10 * k + len(use))
    for tokens, used in ((0, None), (1, None), (9, 2 if k <= 2 else None), (33, None)):
        case = random_case(generator, use, tokens=tokens, heads=2, experts=5, k=k, d_in=8, d_out=12, dtype=dtype,
                           used_experts=used, strided=tokens == 9)
        want = _twin(case)
        want_grads = _grads(want, case.leaves())
        for implementation in EXPERT_IMPLEMENTATIONS:
            for name, fn in (("modeling", expert_projection_torch), ("kernels", cvmm_reference.expert_projection),
                             ("cvmm", kernels.cvmm)):
                got = fn(*case.args(), implementation=implementation)
                _assert_same(got, want, _grads(got, case.leaves()), want_grads, dtype)


def test_grouped_formulation_really_uses_grouped_mm_where_it_can():
    x32, w32 = torch.zeros(3, 1, 8), torch.zeros(4, 8, 12)
    assert cvmm_reference.choose_implementation(x32, w32, "grouped") == "grouped"
    assert cvmm_reference.choose_implementation(x32.double(), w32.double(), "grouped") == "all_experts"
    assert cvmm_reference.choose_implementation(torch.zeros(3, 1, 7), torch.zeros(4, 7, 12), "grouped") \
        == "all_experts"  # rows not 16-byte aligned
    assert cvmm_reference.choose_implementation(torch.zeros(1, 1, 8), w32) == "all_experts"  # decoding
    assert cvmm_reference.choose_implementation(torch.zeros(4096, 1, 8), w32) == "grouped"  # training
    with pytest.raises(ValueError, match="implementation must be one of"):
        expert_projection_torch(x32, torch.zeros(3, 1, dtype=torch.long), w32, implementation="fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("use", sorted(USES))
def test_custom_op_bodies_match_the_twin(use, dtype):
    # the switchhead::cvmm_forward / cvmm_backward ops' PyTorch bodies (sorted slots, hand-written backward)
    case = random_case(torch.Generator().manual_seed(3), use, tokens=11, heads=2, experts=4, k=2, d_in=8, d_out=4,
                       dtype=dtype, used_experts=3)
    want = _twin(case)
    want_grads = _grads(want, case.leaves())
    got, _, _ = torch.ops.switchhead.cvmm_forward(case.inputs, case.expert_index, case.weight, case.gates,
                                                  case.out_groups)
    _assert_same(got, want, _grads(got, case.leaves()), want_grads, dtype)


def test_out_of_range_expert_ids_raise_without_a_sync():
    x, w = torch.randn(3, 1, 8), torch.randn(4, 8, 4)
    for bad in (4, -1):
        index = torch.tensor([[0], [bad], [1]])
        for implementation in EXPERT_IMPLEMENTATIONS:
            with pytest.raises(IndexError):
                expert_projection_torch(x, index, w, implementation=implementation)
            with pytest.raises(ValueError, match=r"must lie in \[0, 4\)"):
                kernels.cvmm(x, index, w, implementation=implementation)
        with pytest.raises(IndexError):
            cvmm_reference.cvmm_forward_reference(x, w, None, *torch.sort(index.reshape(-1), stable=True), 1)


def host_syncs(fn) -> list[str]:
    """The sync ops (`aten::item` / `aten::_local_scalar_dense`) `fn` runs, each named by its outermost caller op.

    `aten::_grouped_mm`'s CPU kernel reads its group offsets with `item` inside ATen (a read of CPU memory, no
    device sync and no graph break); a sync anywhere inside `aten::_grouped_mm` is reported as "aten::_grouped_mm".
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    found = []
    for event in prof.events():
        if event.name == "aten::item" or (event.name == "aten::_local_scalar_dense" and (
                event.cpu_parent is None or event.cpu_parent.name != "aten::item")):
            outer, names = event, []
            while outer.cpu_parent is not None:
                outer = outer.cpu_parent
                names.append(outer.name)
            found.append("aten::_grouped_mm" if "aten::_grouped_mm" in names else outer.name)
    return found


def test_sync_counter_sees_a_sync():
    assert host_syncs(lambda: torch.tensor([1.0]).item()) == ["aten::item"]  # the counter below is not blind


@pytest.mark.parametrize("implementation", EXPERT_IMPLEMENTATIONS)
def test_no_host_sync_forward_and_backward(implementation):
    case = random_case(torch.Generator().manual_seed(1), "value", tokens=700, heads=2, experts=5, k=2, d_in=8,
                       d_out=4, dtype=torch.float32)

    def run():
        for fn in (expert_projection_torch, kernels.cvmm):
            out = fn(*case.args(), implementation=implementation)
            torch.autograd.grad(out.sum(), case.leaves())
        out, sorted_expert, order = torch.ops.switchhead.cvmm_forward(*case.args())
        torch.autograd.grad(out.sum(), case.leaves())

    syncs = host_syncs(run)
    assert all(name == "aten::_grouped_mm" for name in syncs), syncs  # none from our code
    if implementation not in ("grouped", "auto"):  # 700 tokens: "auto" is "grouped"
        assert len(syncs) <= 3 * case.weight.shape[0]  # only those of the custom op's three grouped matmuls
    decode = random_case(torch.Generator().manual_seed(2), "output", tokens=8, heads=2, experts=5, k=2, d_in=8,
                         d_out=4, dtype=torch.float32)
    decode_syncs = host_syncs(lambda: [fn(*decode.args(), implementation=implementation)
                                       for fn in (expert_projection_torch, kernels.cvmm)])
    assert decode_syncs == [] or implementation == "grouped", decode_syncs
