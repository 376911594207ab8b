"""The Triton CVMM kernels on the CPU through the Triton interpreter, held against the naive twin.

Run by `test_kernels.py::test_triton_kernels_under_interpreter` in a child process with TRITON_INTERPRET=1 (the
flag must be set before Triton decorates the kernels, and must not leak into other tests). Small shapes, one
autotune config, fp32 / fp16 only (the interpreter has no bf16 dot).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run this file with TRITON_INTERPRET=1 (test_kernels.py does it in a child process)")

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402
from switchhead import kernels  # noqa: E402
from switchhead.expert_ops import expert_projection, naive  # noqa: E402

from helpers.cvmm_cases import USES, Case, random_case  # noqa: E402
from helpers.projection_precision import SIDES, errors_by_name, projection_call  # noqa: E402

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}


def _project(case: Case, backend: str):
    """"triton": the table's "cvmm" entry (the kernels, which run here); "torch": the naive twin."""
    return expert_projection(*case.args(), implementation="cvmm") if backend == "triton" else naive(*case.args())


def _run(case: Case, backend: str, upstream_seed: int = 11):
    out = _project(case, backend)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream_seed)).to(out.dtype)
    grads = torch.autograd.grad(out, case.leaves(), upstream)
    return out, grads


def _assert_matches_reference(case: Case, dtype: torch.dtype):
    """Triton in `dtype` against the float64 reference on the same values, forward and every gradient."""
    low = case.as_dtype(dtype)
    out, grads = _run(low, "triton")
    want_out, want_grads = _run(case.as_dtype(torch.float64, torch.float64), "torch")
    assert kernels.triton_runs(low.inputs.device, dtype)
    assert out.dtype == dtype and out.shape == want_out.shape
    torch.testing.assert_close(out.double(), want_out, **TOLERANCE[dtype])
    for name, got, want in zip(("inputs", "weight", "gates"), grads, want_grads):
        scale = want.abs().max().clamp_min(1.0)  # the sums over slots / tokens grow with the problem
        torch.testing.assert_close(got.double() / scale, want / scale, **TOLERANCE[dtype], msg=lambda m: f"{name}: {m}")


# seeded sweep: every use, odd sizes (not multiples of the 16-wide blocks), fp32 and fp16, atomic and
# deterministic reductions, contiguous and transposed layouts
SWEEP = [(use, seed) for use in sorted(USES) for seed in range(4)]


@pytest.mark.parametrize("use, seed", SWEEP)
def test_forward_and_gradients_match_reference(use, seed):
    generator = torch.Generator().manual_seed(100 + seed)
    draw = lambda low, high: int(torch.randint(low, high, (1,), generator=generator))  # noqa: E731
    heads, experts = draw(1, 4), draw(2, 6)
    case = random_case(generator, use, tokens=draw(1, 24), heads=heads, experts=experts, k=draw(1, experts + 1),
                       d_in=draw(3, 40), d_out=draw(3, 40), strided=seed % 2 == 1)
    kernels.set_deterministic(seed >= 2)
    try:
        _assert_matches_reference(case, torch.float16 if seed == 3 else torch.float32)
    finally:
        kernels.set_deterministic(None)


@pytest.mark.parametrize("name, kwargs", [
    ("single token", dict(use="value", tokens=1, heads=2, experts=4, k=2)),
    ("empty experts", dict(use="output", tokens=9, heads=2, experts=6, k=2, used_experts=2)),
    ("k equals E", dict(use="mlp_values", tokens=7, heads=1, experts=3, k=3)),
    ("k equals E, all heads", dict(use="value", tokens=5, heads=2, experts=2, k=2)),
    ("one expert block spans tiles", dict(use="mlp_keys", tokens=40, heads=1, experts=1, k=1)),
])
def test_edge_cases(name, kwargs):
    case = random_case(torch.Generator().manual_seed(len(name)), d_in=20, d_out=18, **kwargs)
    _assert_matches_reference(case, torch.float32)
    if name == "empty experts":
        _, (_, d_weight, _) = _run(case.as_dtype(torch.float32), "triton")
        unused = [e for e in range(12) if e % 6 >= 2]
        assert torch.count_nonzero(d_weight[unused]) == 0  # stored zeros, not left-over memory


def test_no_tokens_gives_empty_results_and_zero_weight_grad():
    case = random_case(torch.Generator().manual_seed(0), "value", tokens=0, heads=2, experts=3, k=2, d_in=5,
                       d_out=4, dtype=torch.float32)
    out, (d_inputs, d_weight, d_gates) = _run(case, "triton")
    assert out.shape == (0, 2, 4) and d_inputs.shape == (0, 1, 5) and d_gates.shape == (0, 4)
    assert torch.count_nonzero(d_weight) == 0


def test_deterministic_mode_is_bitwise_reproducible_is_the_default_and_agrees_with_atomics():
    case = random_case(torch.Generator().manual_seed(9), "output", tokens=12, heads=2, experts=3, k=2, d_in=17,
                       d_out=19, dtype=torch.float32)
    kernels.set_deterministic(True)
    try:
        first, second = _run(case, "triton"), _run(case, "triton")
        kernels.set_deterministic(False)
        atomic = _run(case, "triton")
    finally:
        kernels.set_deterministic(None)
    default = _run(case, "triton")
    for a, b, c, d in zip([first[0], *first[1]], [second[0], *second[1]], [atomic[0], *atomic[1]],
                          [default[0], *default[1]]):
        assert torch.equal(a, b) and torch.equal(a, d)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use", ["value", "mlp_keys"])
def test_opcheck_on_triton_path(use):
    case = random_case(torch.Generator().manual_seed(1), use, tokens=5, heads=2, experts=3, k=2, d_in=9, d_out=7,
                       dtype=torch.float32)
    torch.library.opcheck(torch.ops.switchhead.cvmm_forward.default, _op_args(case))


def _op_args(case: Case) -> tuple:
    """`switchhead::cvmm_forward`'s arguments for a case: its slots sorted by expert outside the op."""
    slot_order = kernels.sort_slots(case.expert_index, case.weight.shape[0])
    return (case.inputs, case.weight, case.gates, slot_order.sorted_expert, slot_order.order,
            case.expert_index.shape[1], case.out_groups)


@pytest.mark.parametrize("use", sorted(USES))
def test_a_shared_sort_gives_what_a_sort_per_call_gives(use):
    """`cvmm(inputs, sort_slots(index, G), ...)`, the call that reuses a sort, is bitwise the call that sorts itself,
    forward and every gradient; so is a sort on int64 keys (`sort_slots(index)`) rather than the narrow ones."""
    case = random_case(torch.Generator().manual_seed(6), use, tokens=9, heads=2, experts=3, k=2, d_in=11, d_out=13,
                       dtype=torch.float32)
    results = []
    experts = case.weight.shape[0]
    for index in (case.expert_index, kernels.sort_slots(case.expert_index, experts),
                  kernels.sort_slots(case.expert_index)):
        out = kernels.cvmm(case.inputs, index, case.weight, case.gates, case.out_groups)
        results.append([out, *torch.autograd.grad(out, case.leaves(), torch.ones_like(out))])
    for own, *shared in zip(*results):
        assert all(torch.equal(own, other) for other in shared)


def _sort_count(run) -> int:
    """How many `torch.sort` calls reach the dispatcher while `run()` runs (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountSorts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.sort:
                CountSorts.count += 1
            return func(*args, **(kwargs or {}))

    with CountSorts():
        run()
    return CountSorts.count


@pytest.mark.parametrize("implementation", ["cvmm", "switchhead_auto"])
def test_sigma_moe_sorts_once_per_layer_and_equals_its_reference(implementation):
    """SwitchAll's MLP on the kernels: its keys and values route by one index and share one sort for the forward and
    backward of both (a sort per projection would count 2), with the loss and every gradient of "eager"."""
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset("tiny-switchall")
    model = SwitchHeadForCausalLM(config).eval()
    mlp = model.model.layers[0].mlp
    tokens = torch.randn(2, 7, config.hidden_size, requires_grad=True)
    results = {}
    for name in ("eager", implementation):
        model.set_experts_implementation(name)

        def step():
            out = mlp(tokens)
            results[name] = (out, *torch.autograd.grad(out.square().sum(), [tokens, *mlp.parameters()]))

        sorts = _sort_count(step)
        assert sorts == (0 if name == "eager" else 1), (name, sorts)
    for got, want in zip(results[implementation], results["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-switchhead-xl"])
def test_model_forward_backward_triton_equals_reference(preset):
    """Must-show 2: the whole model on the Triton path equals the PyTorch path (logits, loss, every gradient)."""
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    results = {}
    for backend, implementation in (("torch", "eager"), ("triton", "cvmm")):
        model.set_experts_implementation(implementation)
        out = model(input_ids=ids, labels=ids)
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        results[backend] = (out.logits, out.loss, grads)
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = results["triton"], results["torch"]
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    names = [name for name, _ in model.named_parameters()]
    assert any("experts" in n for n in names) and len(grads) == len(names)
    for name, got, want in zip(names, grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_stride_zero_upstream_gradient_from_sum():
    # out.sum() sends an expanded (all strides 0) gradient into the backward kernels
    case = random_case(torch.Generator().manual_seed(4), "output", tokens=6, heads=2, experts=3, k=2, d_in=18,
                       d_out=20, dtype=torch.float32)
    grads = {}
    for backend in ("triton", "torch"):
        grads[backend] = torch.autograd.grad(_project(case, backend).sum(), case.leaves())
    for got, want in zip(grads["triton"], grads["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_gates", [True, False])
def test_opcheck_forward_and_backward_ops(with_gates):
    case = random_case(torch.Generator().manual_seed(5), "value" if with_gates else "mlp_keys", tokens=4, heads=2,
                       experts=3, k=2, d_in=5, d_out=3, dtype=torch.float32)
    args = _op_args(case)
    torch.library.opcheck(torch.ops.switchhead.cvmm_forward.default, args)
    out = torch.ops.switchhead.cvmm_forward(*args)
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.switchhead.cvmm_backward.default,
                          (grad, case.inputs.detach(), case.weight.detach(),
                           None if case.gates is None else case.gates.detach(), *args[3:5], case.out_groups, True,
                           True))


def test_fake_implementation_returns_true_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = random_case(torch.Generator().manual_seed(2), "output", tokens=6, heads=3, experts=4, k=2, d_in=5,
                       d_out=7, dtype=torch.float32)
    args = _op_args(case)
    real = torch.ops.switchhead.cvmm_forward(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.switchhead.cvmm_forward(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                                   for t in args])
    assert tuple(fake.shape) == tuple(real.shape) == (6, 1, 7) and fake.dtype == real.dtype
    for use, shape in (("mlp_keys", (6, 2, 7)), ("value", (6, 3, 7))):  # no gates: a row per slot; gates: per group
        other = _op_args(random_case(torch.Generator().manual_seed(3), use, tokens=6, heads=3, experts=4, k=2, d_in=5,
                                     d_out=7, dtype=torch.float32))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = torch.ops.switchhead.cvmm_forward(*[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                                                       for t in other])
        assert tuple(fake.shape) == tuple(torch.ops.switchhead.cvmm_forward(*other).shape) == shape


def test_compiled_switchall_on_the_kernels_shares_the_sort_and_equals_eager_mode():
    """`torch.compile(fullgraph=True)` traces SwitchAll's layers with the kernels running (the custom ops, the sort
    outside them, the MLP's shared sort): one sort per projection of attention and one per sigma-MoE MLP reach the
    graph, and the loss and every gradient equal the uncompiled model's."""
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchall")).eval()
    model.set_experts_implementation("cvmm")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    want = loss_fn(ids)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch._dynamo.reset()
    sorts = []

    def count_sorts(graph_module, example_inputs):  # the graph dynamo hands its backend: count its sorts, run it
        sorts.append(sum(node.target in (torch.sort, torch.ops.aten.sort.stable) for node in graph_module.graph.nodes))
        return graph_module.forward

    torch.compile(loss_fn, fullgraph=True, backend=count_sorts)(ids)
    layers = model.config.num_hidden_layers
    assert sorts == [3 * layers], sorts  # values, output (their own routers) and the MLP's one sort, per layer
    torch._dynamo.reset()
    got = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(ids)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("side", list(SIDES))
def test_kernels_under_autocast_round_as_eager_does(side):
    """Under fp16 autocast (the interpreter has no bf16 dot) the kernels, which gate and sum slots in fp32 and round
    once, are within 1.25x of eager's relative RMS error against float64 on each side's call (the factor of
    tests/model/test_autocast_precision.py; they measured 0.70-1.00)."""
    call = projection_call(side, 2, 4, 2, 16, torch.float16, tokens=32)
    assert kernels.triton_runs(call[0].device, torch.float16)
    errors = errors_by_name(call, torch.float16, names=("eager", "cvmm"))
    assert 0 < errors["cvmm"] <= 1.25 * errors["eager"], errors
