"""Every entry of the expert op's one table (switchhead.expert_ops.EXPERTS_IMPLEMENTATIONS) and every formulation
its "eager" rule picks among, held to the naive twin: outputs and gradients w.r.t. inputs, weight and gates; the
per-head formulation; the routers."""

from __future__ import annotations

import unittest.mock

import pytest
import torch

from switchhead import expert_ops
from switchhead import modeling_switchhead as modeling
from switchhead.expert_ops import EXPERTS_IMPLEMENTATIONS, expert_projection, naive
from switchhead.transformers_compat import output_cache

from helpers.cvmm_cases import USES, every_projection, random_case
from helpers.decoding import variant_model


SYNC_OPS = ("aten::item", "aten::_local_scalar_dense")


def _twin(case):
    return naive(*case.args())


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


def test_the_table_is_keyed_by_the_experts_implementations():
    # one naming scheme: the values of `config.experts_implementation`; ours are not Transformers' names
    assert set(EXPERTS_IMPLEMENTATIONS) == {"eager", "switchhead_batched", "switchhead_grouped", "cvmm",
                                            "switchhead_auto", "switchhead_fused"}
    assert EXPERTS_IMPLEMENTATIONS["switchhead_batched"] is expert_ops._batched
    assert EXPERTS_IMPLEMENTATIONS["switchhead_grouped"] is expert_ops._grouped
    assert expert_ops.default_experts_implementation({"switchhead_auto": None}) == "switchhead_auto"
    assert expert_ops.default_experts_implementation({"cvmm": None}) == "eager"
    assert expert_ops.default_experts_implementation({}) == "eager"


@pytest.mark.parametrize("grouped_routing, kernel_calls", [(True, 0), (False, 1)])
def test_the_default_runs_the_kernel_only_where_it_was_measured_faster(monkeypatch, grouped_routing, kernel_calls):
    """"switchhead_auto": where the Triton kernels run, SwitchHead's per-head projections (grouped routing) take the
    PyTorch formulation ("eager"'s rule) and any other routing takes the kernel; the result is the naive twin's."""
    calls = []

    class FakeKernels:  # the kernels "run" here; what they compute is the PyTorch formulation's result
        @staticmethod
        def triton_runs(device, dtype):
            return True

        @staticmethod
        def cvmm(inputs, expert_index, weight, gates, out_groups):
            calls.append(1)
            return expert_ops.naive(inputs, expert_index, weight, gates, out_groups)

    monkeypatch.setattr(expert_ops, "_kernels", FakeKernels)
    torch.manual_seed(0)
    heads, experts, k, n = 2, 3, 2, 5
    inputs, weight = torch.randn(n, 1, 8), torch.randn(heads * experts, 8, 4)
    index = torch.stack([torch.randint(0, experts, (n, k)) + h * experts for h in range(heads)], 1).view(n, -1)
    gates = torch.rand(n, heads * k)
    got = EXPERTS_IMPLEMENTATIONS["switchhead_auto"](inputs, index, weight, gates, heads, grouped_routing)
    assert len(calls) == kernel_calls
    torch.testing.assert_close(got, expert_ops.naive(inputs, index, weight, gates, heads))
    for name in ("batched_mm", "grouped_mm", "another-registered-experts-function"):
        with pytest.raises(ValueError, match="switchhead_batched"):
            expert_ops.lookup(name)


def test_naive_twin_is_the_definition():
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
def test_every_entry_and_formulation_matches_the_twin(use, k, dtype):
    generator = torch.Generator().manual_seed(10 * k + len(use))
    for tokens, used in ((0, None), (1, None), (9, 2 if k <= 2 else None), (33, None)):
        case = random_case(generator, use, tokens=tokens, heads=2, experts=5, k=k, d_in=8, d_out=12, dtype=dtype,
                           used_experts=used, strided=tokens == 9)
        want = _twin(case)
        want_grads = _grads(want, case.leaves())
        for name, project in every_projection().items():
            got = project(*case.args())
            assert got.dtype == want.dtype, name
            _assert_same(got, want, _grads(got, case.leaves()), want_grads, dtype)


def test_grouped_formulation_really_uses_grouped_mm_where_it_can():
    usable = expert_ops._grouped_mm_usable
    x32, w32 = torch.zeros(3, 1, 8), torch.zeros(4, 8, 12)
    assert usable(x32, w32)
    assert not usable(x32.double(), w32.double())
    assert not usable(torch.zeros(3, 1, 7), torch.zeros(4, 7, 12))  # rows not 16-byte aligned
    choose = expert_ops.choose_formulation  # (tokens, slots, rows, out groups, experts, grouped routing)
    assert choose(1, 1, 1, None, 4) is expert_ops._batched  # decoding
    assert choose(4096, 1, 1, None, 4) is expert_ops._grouped  # training


@pytest.mark.parametrize("use", sorted(USES))
def test_every_entry_with_repeated_and_cross_group_expert_ids(use):
    # any id in [0, G) for any slot: the same expert twice in one token, from one row or from several, and a
    # head's slot taking another head's expert (the contract allows it; the mixing matrix must add, not overwrite)
    generator = torch.Generator().manual_seed(7)
    case = random_case(generator, use, tokens=40, heads=2, experts=3, k=2, d_in=8, d_out=4, dtype=torch.float64)
    case.expert_index = torch.randint(0, case.weight.shape[0], case.expert_index.shape, generator=generator)
    assert (case.expert_index[:, :1] == case.expert_index[:, 1:2]).any()  # repeats really occur
    want = _twin(case)
    want_grads = _grads(want, case.leaves())
    for project in every_projection().values():
        got = project(*case.args())
        _assert_same(got, want, _grads(got, case.leaves()), want_grads, torch.float64)
    f32 = case.as_dtype(torch.float32)  # float32: the grouped formulation really runs torch._grouped_mm
    want32 = naive(*f32.args())
    got32 = expert_projection(*f32.args(), implementation="switchhead_grouped")
    _assert_same(got32, want32, _grads(got32, f32.leaves()), _grads(want32, f32.leaves()), torch.float32)


def test_eager_picks_by_problem_size():
    choose, f = expert_ops.choose_formulation, expert_ops
    # SwitchHead values (R=1, S=H*k=4, H=2 groups, G=10): decoding while no more matrices are selected than there
    # are experts (N * S <= G) gathers the selected ones, per head or not, on either side, gated or not
    assert choose(1, 4, 1, 2, 10) is f._batched
    assert choose(1, 4, 1, 2, 10, grouped_routing=True) is f._batched
    assert choose(1, 4, 2, 1, 10, grouped_routing=True) is f._batched  # the output side
    assert choose(1, 4, 1, None, 10, grouped_routing=True) is f._batched  # no gates
    assert choose(2, 4, 1, 2, 10) is f._batched  # 8 of 10
    assert choose(1, 10, 1, 2, 10, grouped_routing=True) is f._batched  # every expert selected, once
    assert choose(2, 10, 1, 2, 10, grouped_routing=True) is f._per_head  # more slots than experts: no copies
    assert choose(3, 4, 1, 2, 10) is f._all_experts  # batch decoding: no weight copies
    assert choose(8, 4, 1, 2, 10, grouped_routing=True) is f._per_head
    assert choose(4096, 4, 1, 2, 10) is f._grouped  # training: G / k times the products is too much
    assert choose(4096, 4, 1, 2, 10, grouped_routing=True) is f._grouped
    # few experts per slot (G <= 2 S): every expert is cheap even for many tokens
    assert choose(4096, 4, 1, 2, 6) is f._all_experts


@pytest.mark.integration
@pytest.mark.parametrize("use", sorted(USES))
def test_compiled_decoding_reads_only_the_selected_experts(use):
    # compiled, a call with no more selected matrices than experts takes `_gathered` (the gather fused into the
    # product); its values and gradients are the twin's; more slots than experts keep the eager rule's choice
    choose, f = expert_ops.choose_formulation, expert_ops
    chosen = []

    def spy(*args, **kwargs):
        chosen.append(choose(*args, **kwargs))
        return chosen[-1]

    generator = torch.Generator().manual_seed(11)
    for tokens in (1, 6):
        case = random_case(generator, use, tokens=tokens, heads=2, experts=5, k=2, d_in=8, d_out=12,
                           dtype=torch.float32)
        want = _twin(case)
        torch._dynamo.reset()
        compiled = torch.compile(lambda c=case: expert_projection(*c.args(), implementation="eager"),
                                 fullgraph=True)
        with unittest.mock.patch.object(expert_ops, "choose_formulation", spy):
            got = compiled()
        _assert_same(got, want, _grads(got, case.leaves()), _grads(want, case.leaves()), torch.float32)
    slots, experts = case.expert_index.shape[1], case.weight.shape[0]
    assert chosen[0] is f._gathered and slots <= experts  # one token: no more selected matrices than experts
    assert chosen[1] is not f._gathered and 6 * slots > experts


def test_grouped_mm_falls_back_where_grouped_mm_cannot_run():
    # float64 (no _grouped_mm) and no tokens: the "switchhead_grouped" entry runs _all_experts, with the same values
    for tokens, dtype in ((4096, torch.float64), (0, torch.float32)):
        case = random_case(torch.Generator().manual_seed(2), "value", tokens=tokens, heads=2, experts=5, k=2,
                           d_in=8, d_out=4, dtype=dtype)
        assert torch.equal(expert_projection(*case.args(), implementation="switchhead_grouped"),
                           expert_ops._all_experts(*case.args()))


def test_cvmm_entry_runs_eager_where_triton_does_not():
    case = random_case(torch.Generator().manual_seed(3), "output", tokens=5, heads=2, experts=3, k=2, d_in=8,
                       d_out=4, dtype=torch.float64)
    assert expert_ops._kernels is None or not expert_ops._kernels.triton_runs(case.inputs.device, case.inputs.dtype)
    assert torch.equal(expert_projection(*case.args(), implementation="cvmm"),
                       expert_projection(*case.args(), implementation="eager"))


@pytest.mark.parametrize("use", ["value", "output", "mlp_keys", "mlp_values"])
def test_eager_under_torch_export_with_a_dynamic_token_count_is_one_graph_for_every_size(use):
    """A size-based choice would specialise the exported graph to the example's token count (torch.export refuses
    a dynamic dimension that the code fixed); under export "eager" is `_all_experts` for every size."""
    def case(tokens):
        return random_case(torch.Generator().manual_seed(tokens), use, tokens=tokens, heads=2, experts=3, k=2,
                           d_in=16, d_out=16, dtype=torch.float32)

    example = case(8)
    gated, out_groups = example.gates is not None, example.out_groups

    class Ungated(torch.nn.Module):
        def forward(self, inputs, expert_index, weight, gates=None):
            return expert_projection(inputs, expert_index, weight, gates, out_groups, "eager",
                                     grouped_routing=use in ("value", "output"))

    class Gated(Ungated):
        def forward(self, inputs, expert_index, weight, gates):
            return super().forward(inputs, expert_index, weight, gates)

    def arguments(c):
        return tuple(t.detach() for t in (c.inputs, c.expert_index, c.weight, *((c.gates,) if gated else ())))

    tokens = torch.export.Dim("tokens")
    shapes = ({0: tokens}, {0: tokens}, None, *(({0: tokens},) if gated else ()))
    program = torch.export.export((Gated if gated else Ungated)(), arguments(example), dynamic_shapes=shapes)
    for n in (1, 2, 600):  # eager takes _batched / _per_head, _all_experts, _grouped at these sizes
        with torch.no_grad():
            want = _twin(case(n))
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
        out = expert_projection(*case.args(), implementation="switchhead_grouped")
    argument_bytes = sum(t.numel() * t.element_size() for t in case.leaves())
    slots = case.expert_index.numel()
    saved_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert saved_bytes <= argument_bytes + 2 * slots * 8 + 4 * case.weight.shape[0]  # + order (int64), ends
    assert all(t.numel() < slots * case.weight.shape[2] for t in saved)
    want = _twin(case)
    _assert_same(out, want, _grads(out, case.leaves()), _grads(want, case.leaves()), torch.float32)


def test_grouped_formulation_in_bfloat16_with_float32_gates():
    case = random_case(torch.Generator().manual_seed(5), "value", tokens=64, heads=2, experts=5, k=2, d_in=16,
                       d_out=8, dtype=torch.float64).as_dtype(torch.bfloat16)
    assert expert_ops._grouped_mm_usable(case.inputs, case.weight)
    got = expert_projection(*case.args(), implementation="switchhead_grouped")
    want = _twin(case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for g, w in zip(_grads(got, case.leaves()), _grads(want, case.leaves())):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.float(), w.float(), rtol=5e-2, atol=5e-2)


def test_out_of_range_expert_ids_raise_without_a_sync():
    x, w = torch.randn(3, 1, 8), torch.randn(4, 8, 4)
    for bad in (4, -1):
        index = torch.tensor([[0], [bad], [1]])
        for name, project in every_projection().items():
            with pytest.raises(IndexError):
                project(x, index, w, None, 1)
        with pytest.raises(IndexError):
            naive(x, index, w)


def _per_head_case(generator, use, tokens, heads, experts, k, d_in, d_out, dtype, repeats):
    case = random_case(generator, use, tokens=tokens, heads=heads, experts=experts, k=k, d_in=d_in, d_out=d_out,
                       dtype=dtype)
    if repeats:  # each head's k picks drawn with replacement among its own experts: the same id twice in a head
        local = torch.randint(0, experts, (tokens, heads, k), generator=generator)
        case.expert_index = (local + torch.arange(heads)[:, None] * experts).reshape(tokens, heads * k)
    return case


def _per_head(case, use, heads, experts, via="per_head"):
    """SwitchHead's per-head formulation on a CVMM case: dense gates, then head_expert_values / _output; or the
    "switchhead_fused" entry for one per-head projection (the recomputing value mix, the lean output)."""
    if via == "fused":
        return EXPERTS_IMPLEMENTATIONS["switchhead_fused"](*case.args(), grouped_routing=True)
    dense = expert_ops.dense_head_gates(case.expert_index, case.gates, heads, experts, case.inputs.dtype)
    if use == "value":
        return expert_ops.head_expert_values(case.inputs[:, 0], dense, case.weight)  # [N, H, d_out]
    return expert_ops.head_expert_output(case.inputs, dense, case.weight).unsqueeze(1)  # [N, 1, d_out]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("use", ["value", "output"])
@pytest.mark.parametrize("repeats", [False, True], ids=["distinct", "repeated-ids"])
@pytest.mark.parametrize("via", ["per_head", "fused"])
def test_per_head_formulation_matches_the_twin(use, repeats, dtype, via):
    # outputs and gradients w.r.t. inputs, weight and the router's gates, through the custom autograd functions
    # (grad mode) and the plain forward (no grad); no token, one token (every expert selected, or not) and more
    generator = torch.Generator().manual_seed(21 + repeats)
    heads, experts = 2, 5
    for tokens, k in ((0, 2), (1, 3), (1, 1), (7, 3), (33, 2)):
        case = _per_head_case(generator, use, tokens, heads, experts, k, 8, 12, dtype, repeats)
        if repeats and tokens >= 7:
            local = case.expert_index.view(tokens, heads, k)
            assert (local[..., :1] == local[..., 1:2]).any()  # repeats really occur
        want = _twin(case)
        got = _per_head(case, use, heads, experts, via)
        _assert_same(got, want, _grads(got, case.leaves()), _grads(want, case.leaves()), dtype)
        with torch.no_grad():
            _assert_same(_per_head(case, use, heads, experts, via), want, [], [], dtype)


@pytest.mark.integration
def test_per_head_formulation_compiles_for_one_token():
    # one token (every expert selected: the rule gathers fewer) under torch.compile(fullgraph=True)
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
    # what the per-head formulation reads: the same gates scattered into [N, groups, E], zero elsewhere
    dense = expert_ops.dense_head_gates(index, gates, 3, 4, torch.float32)
    assert torch.equal(dense.gather(-1, want_index), gates.view(9, 3, 2))
    assert torch.equal((dense > 0).sum(-1), torch.full((9, 3), 2))


def _two_paths(variant="switchhead-rope"):
    """Two copies of a model: "eager" (the per-head formulation where its rule picks it), "switchhead_batched"."""
    per_head, generic = variant_model(variant), variant_model(variant)
    generic.set_experts_implementation("switchhead_batched")  # explicit: the selected matrices gathered, one bmm
    return per_head, generic


@pytest.mark.parametrize("variant", ["switchhead-rope", "switchhead-xl"])
def test_per_head_path_equals_the_generic_path(variant):
    per_head, generic = _two_paths(variant)
    per_head.set_experts_implementation("eager")
    ids = torch.randint(0, per_head.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    chosen = []
    choose = expert_ops.choose_formulation

    def spy(*args, **kwargs):
        chosen.append(choose(*args, **kwargs))
        return chosen[-1]
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
    # decoding steps through the cache: three sequences select more matrices than there are experts (3 * H * k > H * E,
    # the per-head formulation), one sequence fewer (the selected matrices gathered)
    for rows, formulation in ((3, expert_ops._per_head), (1, expert_ops._batched)):
        chosen.clear()
        with torch.no_grad():
            caches = [output_cache(model(input_ids=ids[:rows, :5], use_cache=True)) for model in (per_head, generic)]
            for t in range(5, 9):
                with unittest.mock.patch.object(expert_ops, "choose_formulation", spy):
                    stepped = per_head(input_ids=ids[:rows, t:t + 1], cache=caches[0], use_cache=True).logits
                reference = generic(input_ids=ids[:rows, t:t + 1], cache=caches[1], use_cache=True).logits
                torch.testing.assert_close(stepped, reference, rtol=1e-5, atol=1e-5)
        assert len(chosen) == 4 * 2 * per_head.config.num_hidden_layers and set(chosen) == {formulation}


def test_recorded_router_logits_keep_each_router_call():
    # with output_router_logits the routers' hooks record their logits: each side routes through its own module
    # call, so the recorded tensors are exactly the routers' own, and the outputs do not change
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
    # one token: each router is called once as a module, so its hooks record it
    attention = per_head.model.layers[0].self_attn
    calls = []
    handles = [router.register_forward_hook(lambda module, args, out: calls.append(module))
               for router in (attention.value_selection, attention.output_selection)]
    with torch.no_grad():
        per_head(input_ids=ids[:1, :1])
    for handle in handles:
        handle.remove()
    assert calls == [attention.value_selection, attention.output_selection]


def test_many_token_formulations_compile_in_fp32():
    """"eager"/"switchhead_grouped", many tokens, fp32, under torch.compile: `_grouped_mm`'s fake kernel takes bf16,
    so the compiled graph must fall back to a formulation it can trace, with the eager values and gradients."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 1, 64, generator=gen, requires_grad=True)
    w = torch.randn(8, 64, 32, generator=gen, requires_grad=True)
    g = torch.rand(512, 2, generator=gen, requires_grad=True)
    idx = torch.randint(0, 8, (512, 2), generator=gen)
    for implementation in ("eager", "switchhead_grouped"):
        def loss(x, w, g, implementation=implementation):
            return (expert_projection(x, idx, w, g, 1, implementation=implementation) ** 2).sum()

        eager = loss(x, w, g)
        want = torch.autograd.grad(eager, (x, w, g))
        torch._dynamo.reset()
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(x, w, g)
        got = torch.autograd.grad(compiled, (x, w, g))
        torch.testing.assert_close(compiled, eager, rtol=2e-5, atol=2e-5)
        for a, b in zip(got, want):  # sums over 512 tokens in another order: fp32 rounding relative to the scale
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * float(b.abs().max()))
