"""Every formulation of the expert op (switchhead.expert_ops, switchhead.kernels) held to the reference twin:
outputs and gradients w.r.t. inputs, weight and gates; the per-head formulation; the routers' fast paths."""

from __future__ import annotations

import pytest
import torch

from switchhead import kernels
from switchhead.kernels import cvmm_reference
from switchhead import expert_ops
from switchhead import modeling_switchhead as modeling
from switchhead.expert_ops import EXPERT_IMPLEMENTATIONS, expert_projection_torch

from helpers.cvmm_cases import USES, random_case
from helpers.decoding import variant_model


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
            for name, fn in (("modeling", expert_projection_torch), ("cvmm", kernels.cvmm)):
                got = fn(*case.args(), implementation=implementation)
                _assert_same(got, want, _grads(got, case.leaves()), want_grads, dtype)


def test_grouped_formulation_really_uses_grouped_mm_where_it_can():
    x32, w32 = torch.zeros(3, 1, 8), torch.zeros(4, 8, 12)
    choose = expert_ops.choose_expert_implementation  # (tokens, slots, rows, out groups, experts, inputs, weight)
    assert choose(3, 1, 1, None, 4, x32, w32, "grouped") == "grouped"
    assert choose(3, 1, 1, None, 4, x32.double(), w32.double(), "grouped") == "all_experts"
    assert choose(3, 1, 1, None, 4, torch.zeros(3, 1, 7), torch.zeros(4, 7, 12), "grouped") \
        == "all_experts"  # rows not 16-byte aligned
    assert choose(1, 1, 1, None, 4, torch.zeros(1, 1, 8), w32) == "batched"  # decoding
    assert choose(4096, 1, 1, None, 4, torch.zeros(4096, 1, 8), w32) == "grouped"  # training
    with pytest.raises(ValueError, match="implementation must be one of"):
        expert_projection_torch(x32, torch.zeros(3, 1, dtype=torch.long), w32, implementation="fast")


@pytest.mark.parametrize("use", sorted(USES))
def test_every_formulation_with_repeated_and_cross_group_expert_ids(use):
    # any id in [0, G) for any slot: the same expert twice in one token, from one row or from several, and a
    # head's slot taking another head's expert (the contract allows it; the mixing matrix must add, not overwrite)
    generator = torch.Generator().manual_seed(7)
    case = random_case(generator, use, tokens=40, heads=2, experts=3, k=2, d_in=8, d_out=4, dtype=torch.float64)
    case.expert_index = torch.randint(0, case.weight.shape[0], case.expert_index.shape, generator=generator)
    assert (case.expert_index[:, :1] == case.expert_index[:, 1:2]).any()  # repeats really occur
    want = _twin(case)
    want_grads = _grads(want, case.leaves())
    for implementation in EXPERT_IMPLEMENTATIONS:
        got = expert_projection_torch(*case.args(), implementation=implementation)
        _assert_same(got, want, _grads(got, case.leaves()), want_grads, torch.float64)
    f32 = case.as_dtype(torch.float32)  # float32: the "grouped" formulation really runs torch._grouped_mm
    want32 = expert_projection_torch(*f32.args(), implementation="reference")
    got32 = expert_projection_torch(*f32.args(), implementation="grouped")
    _assert_same(got32, want32, _grads(got32, f32.leaves()), _grads(want32, f32.leaves()), torch.float32)


def test_auto_picks_by_problem_size():
    choose = expert_ops.choose_expert_implementation
    x, w = torch.zeros(1, 1, 8), torch.zeros(10, 8, 12)
    # SwitchHead values (R=1, S=H*k=4, H=2 groups, G=10): decoding one sequence gathers its 4 matrices
    assert choose(1, 4, 1, 2, 10, x, w) == "batched"
    assert choose(2, 4, 1, 2, 10, x, w) == "all_experts"  # batch decoding: no weight copies
    assert choose(8, 4, 1, 2, 10, x, w) == "all_experts"
    assert choose(4096, 4, 1, 2, 10, x, w) == "grouped"  # training: G / k times the products is too much
    # few experts per slot (G <= 2 S): every expert is cheap even for many tokens
    assert choose(4096, 4, 1, 2, 6, x, w) == "all_experts"
    assert choose(4096, 4, 1, 2, 10, x.double(), w.double()) == "all_experts"  # no _grouped_mm for float64
    assert choose(0, 4, 1, 2, 10, x, w, "grouped") == "all_experts"
    for explicit in ("reference", "batched", "all_experts"):
        assert choose(4096, 4, 1, 2, 10, x, w, explicit) == explicit
    with pytest.raises(ValueError, match="implementation must be one of"):
        choose(1, 4, 1, 2, 10, x, w, "fast")


@pytest.mark.parametrize("use", ["value", "output", "mlp_keys", "mlp_values"])
def test_auto_under_torch_export_with_a_dynamic_token_count_is_one_graph_for_every_size(use):
    """A size-based choice would specialise the exported graph to the example's token count (torch.export refuses
    a dynamic dimension that the code fixed); under export "auto" is "all_experts" for every size."""
    def case(tokens):
        return random_case(torch.Generator().manual_seed(tokens), use, tokens=tokens, heads=2, experts=3, k=2,
                           d_in=16, d_out=16, dtype=torch.float32)

    example = case(8)
    gated, out_groups = example.gates is not None, example.out_groups

    class Ungated(torch.nn.Module):
        def forward(self, inputs, expert_index, weight, gates=None):
            return expert_projection_torch(inputs, expert_index, weight, gates, out_groups,
                                           grouped_routing=use in ("value", "output"))

    class Gated(Ungated):
        def forward(self, inputs, expert_index, weight, gates):
            return super().forward(inputs, expert_index, weight, gates)

    def arguments(c):
        return tuple(t.detach() for t in (c.inputs, c.expert_index, c.weight, *((c.gates,) if gated else ())))

    tokens = torch.export.Dim("tokens")
    shapes = ({0: tokens}, {0: tokens}, None, *(({0: tokens},) if gated else ()))
    program = torch.export.export((Gated if gated else Ungated)(), arguments(example), dynamic_shapes=shapes)
    for n in (1, 2, 600):  # eager "auto" takes "batched" / "per_head", "all_experts", "grouped" at these sizes
        with torch.no_grad():
            want = expert_projection_torch(*case(n).args(), implementation="reference")
            got = program.module()(*arguments(case(n)))
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_grouped_formulation_saves_no_per_slot_tensor():
    # the lean backward keeps the arguments and the sort, nothing of size N * S * d (the sorted rows, the per-slot
    # outputs): what made SwitchHead's attention layer take more training memory than the dense one
    case = random_case(torch.Generator().manual_seed(4), "output", tokens=256, heads=2, experts=5, k=2, d_in=16,
                       d_out=64, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = expert_projection_torch(*case.args(), implementation="grouped")
    argument_bytes = sum(t.numel() * t.element_size() for t in case.leaves())
    slots = case.expert_index.numel()
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert saved_bytes <= argument_bytes + 2 * slots * 8 + 4 * case.weight.shape[0]  # + order (int64), ends
    assert all(t.numel() < slots * case.weight.shape[2] for t in saved)
    want = expert_projection_torch(*case.args(), implementation="reference")
    _assert_same(out, want, _grads(out, case.leaves()), _grads(want, case.leaves()), torch.float32)


def test_grouped_formulation_in_bfloat16_with_float32_gates():
    case = random_case(torch.Generator().manual_seed(5), "value", tokens=64, heads=2, experts=5, k=2, d_in=16,
                       d_out=8, dtype=torch.float64).as_dtype(torch.bfloat16)
    assert expert_ops.choose_expert_implementation(64, 4, 1, 2, 10, case.inputs, case.weight, "grouped") == "grouped"
    got = expert_projection_torch(*case.args(), implementation="grouped")
    want = expert_projection_torch(*case.args(), implementation="reference")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for g, w in zip(_grads(got, case.leaves()), _grads(want, case.leaves())):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)


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


def _per_head_case(generator, use, tokens, heads, experts, k, d_in, d_out, dtype, repeats):
    case = random_case(generator, use, tokens=tokens, heads=heads, experts=experts, k=k, d_in=d_in, d_out=d_out,
                       dtype=dtype)
    if repeats:  # each head's k picks drawn with replacement among its own experts: the same id twice in a head
        local = torch.randint(0, experts, (tokens, heads, k), generator=generator)
        case.expert_index = (local + torch.arange(heads)[:, None] * experts).reshape(tokens, heads * k)
    return case


def _per_head(case, use, heads, experts):
    """SwitchHead's per-head formulation on a CVMM case: dense gates, then head_expert_values / _output."""
    dense = expert_ops.dense_head_gates(case.expert_index, case.gates, heads, experts, case.inputs.dtype)
    if use == "value":
        return expert_ops.head_expert_values(case.inputs[:, 0], dense, case.weight)  # [N, H, d_out]
    return expert_ops.head_expert_output(case.inputs, dense, case.weight).unsqueeze(1)  # [N, 1, d_out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("use", ["value", "output"])
@pytest.mark.parametrize("repeats", [False, True], ids=["distinct", "repeated-ids"])
def test_per_head_formulation_matches_the_twin(use, repeats, dtype):
    # outputs and gradients w.r.t. inputs, weight and the router's gates, through the custom autograd functions
    # (grad mode) and the plain forward (no grad); one token (decoding's batched matrix-vector products) and more
    generator = torch.Generator().manual_seed(21 + repeats)
    heads, experts = 2, 5
    for tokens, k in ((0, 2), (1, 3), (1, 1), (7, 3), (33, 2)):
        case = _per_head_case(generator, use, tokens, heads, experts, k, 8, 12, dtype, repeats)
        if repeats and tokens >= 7:
            local = case.expert_index.view(tokens, heads, k)
            assert (local[..., :1] == local[..., 1:2]).any()  # repeats really occur
        want = _twin(case)
        got = _per_head(case, use, heads, experts)
        _assert_same(got, want, _grads(got, case.leaves()), _grads(want, case.leaves()), dtype)
        with torch.no_grad():
            _assert_same(_per_head(case, use, heads, experts), want, [], [], dtype)


def test_per_head_formulation_compiles_for_one_token():
    # decoding under torch.compile(fullgraph=True): one token takes the fused weight-streaming reduction
    generator = torch.Generator().manual_seed(8)
    heads, experts = 2, 5
    for use in ("value", "output"):
        case = _per_head_case(generator, use, 1, heads, experts, 3, 8, 12, torch.float32, True)
        want = _twin(case)
        torch._dynamo.reset()
        compiled = torch.compile(lambda c=case: _per_head(c, use, heads, experts), fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(), want, rtol=2e-5, atol=2e-5)


def test_per_head_functions_save_no_gated_rows():
    # the output side keeps its arguments only (the gated rows [N, H * E * dh] are recomputed), the value side its
    # arguments and the products of every expert: the all_experts formulation kept a permuted copy of those too
    generator = torch.Generator().manual_seed(6)
    heads, experts, k, tokens = 2, 5, 3, 64
    for use, extra in (("output", 0), ("value", tokens * heads * experts * 12)):
        case = _per_head_case(generator, use, tokens, heads, experts, k, 16, 12, torch.float32, False)
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _per_head(case, use, heads, experts)
        dense = tokens * heads * experts * 4 + case.expert_index.numel() * 8  # dense gates, ids (their scatter)
        argument_bytes = sum(t.numel() * t.element_size() for t in (case.inputs, case.weight)) + dense
        assert sum(t.numel() * t.element_size() for t in saved) <= argument_bytes + extra * 4, use
        if use == "output":
            assert all(t.numel() < tokens * heads * experts * case.inputs.shape[2] for t in saved)
        want = _twin(case)
        _assert_same(out, want, _grads(out, case.leaves()), _grads(want, case.leaves()), torch.float32)


def test_router_select_is_the_forward_routing():
    # `ExpertSelection.select` (what the per-head path calls) gives the module call's gates and ids, and the
    # forward's logits are unchanged: the top-k values are the gates (no gather), ids offset by group
    torch.manual_seed(0)
    router = modeling.ExpertSelection(16, 3, 4, 2, 0.0, False)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(9, 16)
    logits, gates, index = router(x)
    torch.testing.assert_close(logits, torch.nn.functional.linear(x, router.weight), rtol=0, atol=0)
    scores = torch.sigmoid(logits).view(9, 3, 4)
    _, want_index = scores.topk(2, dim=-1, sorted=False)
    assert torch.equal(index, (want_index + torch.arange(3)[:, None] * 4).flatten(1))
    assert torch.equal(gates, scores.gather(-1, want_index).flatten(1))
    _, local_gates, local_index = router.select(torch.nn.functional.linear(x, router.weight))
    assert torch.equal(local_gates.flatten(1), gates) and torch.equal(local_index, want_index)
    # dense=True (what the per-head path reads): the same gates scattered into [N, groups, E], zero elsewhere
    dense_logits, dense = router(x, dense=True)
    assert torch.equal(dense_logits, logits) and dense.shape == (9, 3, 4)
    assert torch.equal(dense, expert_ops.dense_head_gates(index, gates, 3, 4, torch.float32))
    assert torch.equal((dense > 0).sum(-1), torch.full((9, 3), 2))


def _two_paths(variant="switchhead-rope"):
    """Two copies of a model: SwitchHead's per-head path with the joint router, and the generic formulations."""
    per_head, generic = variant_model(variant), variant_model(variant)
    generic.set_experts_implementation("batched_mm")  # explicit: the CVMM formulation, each side routing itself
    return per_head, generic


@pytest.mark.parametrize("variant", ["switchhead-rope", "switchhead-xl"])
def test_joint_router_and_per_head_path_equal_the_generic_path(variant):
    per_head, generic = _two_paths(variant)
    attention = per_head.model.layers[0].self_attn
    ids = torch.randint(0, per_head.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    hidden = torch.randn(1, 1, per_head.config.hidden_size)
    assert attention.joint_gates(hidden) is not None  # one token: routed up front (no memory)
    assert generic.model.layers[0].self_attn.joint_gates(hidden) is None
    # more tokens: each side routes itself, through the dispatch that picks a formulation by size
    assert attention.joint_gates(torch.randn(2, 9, per_head.config.hidden_size)) is None
    for model in (per_head, generic):
        model.train()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout) or hasattr(module, "expert_dropout"):
                module.p = 0.0
                if hasattr(module, "expert_dropout"):
                    module.expert_dropout = 0.0
    outs = [model(input_ids=ids, labels=ids, use_cache=False) for model in (per_head, generic)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-5, atol=1e-5)
    grads = [torch.autograd.grad(out.loss, list(model.parameters())) for out, model in zip(outs, (per_head, generic))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    per_head.eval(), generic.eval()
    with torch.no_grad():  # decoding steps through the cache: one token per step (the batched mat-vec products)
        caches = [model(input_ids=ids[:1, :5], use_cache=True).past_key_values for model in (per_head, generic)]
        for t in range(5, 9):
            logits = [model(input_ids=ids[:1, t:t + 1], past_key_values=cache, use_cache=True).logits
                      for model, cache in zip((per_head, generic), caches)]
            torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


def test_recorded_router_logits_keep_each_router_call():
    # with output_router_logits the routers' hooks record their logits: each side routes through its own module
    # call (no joint matmul), so the recorded tensors are exactly the routers' own, and the outputs do not change
    per_head, generic = _two_paths()
    ids = torch.randint(0, per_head.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = per_head(input_ids=ids).logits
        recorded = per_head(input_ids=ids, output_router_logits=True)
        reference = generic(input_ids=ids, output_router_logits=True)
    torch.testing.assert_close(recorded.logits, plain, rtol=1e-5, atol=1e-5)
    assert len(recorded.router_logits) == len(reference.router_logits) == 2 * per_head.config.num_hidden_layers
    for layer, (got, want) in enumerate(zip(recorded.router_logits, reference.router_logits)):
        if layer < 2:  # the first layer's V and O routers read the same inputs in both models: bit for bit
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # later layers: inputs equal up to rounding
    # one token is routed up front for both sides (joint_gates), each router called once, so its hooks record it
    attention = per_head.model.layers[0].self_attn
    calls = []
    handles = [router.register_forward_hook(lambda module, args, out: calls.append(module))
               for router in (attention.value_selection, attention.output_selection)]
    routed = attention.joint_gates(torch.randn(1, 1, per_head.config.hidden_size))
    for handle in handles:
        handle.remove()
    assert routed is not None and calls == [attention.value_selection, attention.output_selection]


@pytest.mark.parametrize("project", [expert_projection_torch], ids=["hub-file"])
def test_many_token_formulations_compile_in_fp32(project):
    """"auto"/"grouped" with many tokens in fp32 under torch.compile: `_grouped_mm`'s fake kernel takes bf16 only,
    so the compiled graph must fall back to a formulation it can trace, with the eager values and gradients."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1, 64, generator=gen, requires_grad=True)
    w = torch.randn(8, 64, 32, generator=gen, requires_grad=True)
    g = torch.rand(512, 2, generator=gen, requires_grad=True)
    idx = torch.randint(0, 8, (512, 2), generator=gen)
    for implementation in ("auto", "grouped"):
        def loss(x, w, g, implementation=implementation):
            return (project(x, idx, w, g, 1, implementation=implementation) ** 2).sum()

        eager = loss(x, w, g)
        want = torch.autograd.grad(eager, (x, w, g))
        torch._dynamo.reset()
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(x, w, g)
        got = torch.autograd.grad(compiled, (x, w, g))
        torch.testing.assert_close(compiled, eager, rtol=2e-5, atol=2e-5)
        for a, b in zip(got, want):  # sums over 512 tokens in another order: fp32 rounding relative to the scale
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * float(b.abs().max()))
