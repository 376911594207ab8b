"""switchhead.kernels on the CPU: the PyTorch twin, the torch.library registration, dispatch, torch.compile.

The Triton kernels themselves run under TRITON_INTERPRET=1 in a child pytest process
(`cvmm_interpret_suite.py`, started by `test_triton_kernels_under_interpreter`), because the interpreter must be
switched on before Triton decorates the kernels and must not leak into the other tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead import kernels
from switchhead import expert_ops
from switchhead.expert_ops import expert_projection_torch

from helpers.cvmm_cases import USES, random_case  # noqa: E402

TESTS = Path(__file__).resolve().parent


def _grads(out, leaves, seed=1):
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, leaves, upstream)


def test_model_calls_the_kernels_package():
    # the modeling file's try/except must have found our op, so every test below covers the model's path
    assert expert_ops._kernels is kernels
    assert kernels.resolve_backend(torch.device("cpu"), torch.float32) == "torch"


@pytest.mark.parametrize("use", sorted(USES))
@pytest.mark.parametrize("seed", range(3))
def test_reference_twin_equals_expert_projection_torch(use, seed):
    generator = torch.Generator().manual_seed(seed)
    heads, experts = 1 + seed % 3, 3 + seed
    k = 1 + (seed % experts)
    case = random_case(generator, use, tokens=5 + 4 * seed, heads=heads, experts=experts, k=k, d_in=7, d_out=6,
                       strided=seed == 2)
    ours = kernels.cvmm(*case.args())
    reference = expert_projection_torch(*case.args())
    assert ours.shape == reference.shape
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(ours, case.leaves()), _grads(reference, case.leaves())):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("use", sorted(USES))
def test_gradcheck_inputs_weight_and_gates_float64(use):
    case = random_case(torch.Generator().manual_seed(7), use, tokens=3, heads=2, experts=3, k=2, d_in=4, d_out=3)
    index, out_groups = case.expert_index, case.out_groups
    if case.gates is None:
        assert torch.autograd.gradcheck(lambda x, w: kernels.cvmm(x, index, w), (case.inputs, case.weight))
    else:
        assert torch.autograd.gradcheck(lambda x, w, g: kernels.cvmm(x, index, w, g, out_groups),
                                        (case.inputs, case.weight, case.gates))


def test_edge_cases_single_token_empty_experts_all_experts_no_tokens():
    generator = torch.Generator().manual_seed(3)
    cases = [
        random_case(generator, "value", tokens=1, heads=2, experts=4, k=2, d_in=5, d_out=3),  # a single token
        random_case(generator, "output", tokens=6, heads=2, experts=5, k=2, d_in=3, d_out=5, used_experts=2),
        random_case(generator, "mlp_values", tokens=4, heads=1, experts=3, k=3, d_in=4, d_out=4),  # k = E
    ]
    for case in cases:
        ours, reference = kernels.cvmm(*case.args()), expert_projection_torch(*case.args())
        torch.testing.assert_close(ours, reference)
        for got, want in zip(_grads(ours, case.leaves()), _grads(reference, case.leaves())):
            torch.testing.assert_close(got, want)
    empty_weight_grad = torch.autograd.grad(kernels.cvmm(*cases[1].args()).sum(), cases[1].weight)[0]
    unused = [e for e in range(10) if e % 5 >= 2]  # experts 2..4 of each head never selected
    assert torch.count_nonzero(empty_weight_grad[unused]) == 0
    assert torch.count_nonzero(empty_weight_grad[[0, 1, 5, 6]]) > 0
    no_tokens = random_case(generator, "value", tokens=0, heads=2, experts=3, k=2, d_in=4, d_out=3)
    out = kernels.cvmm(*no_tokens.args())
    assert out.shape == expert_projection_torch(*no_tokens.args()).shape == (0, 2, 3)
    d_inputs, d_weight, d_gates = torch.autograd.grad(out.sum(), no_tokens.leaves())
    assert d_inputs.shape == (0, 1, 4) and d_gates.shape == (0, 4) and torch.count_nonzero(d_weight) == 0


@pytest.mark.parametrize("with_gates", [True, False])
def test_opcheck_forward_and_backward_ops(with_gates):
    case = random_case(torch.Generator().manual_seed(5), "value" if with_gates else "mlp_keys", tokens=4, heads=2,
                       experts=3, k=2, d_in=5, d_out=3, dtype=torch.float32)
    args = (case.inputs, case.expert_index, case.weight, case.gates, case.out_groups)
    torch.library.opcheck(torch.ops.switchhead.cvmm_forward.default, args)
    out, sorted_expert, order = torch.ops.switchhead.cvmm_forward(*args)
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.switchhead.cvmm_backward.default,
                          (grad, case.inputs.detach(), case.weight.detach(),
                           None if case.gates is None else case.gates.detach(), sorted_expert, order,
                           case.out_groups, True, True))


def test_fake_implementation_returns_true_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = random_case(torch.Generator().manual_seed(2), "output", tokens=6, heads=3, experts=4, k=2, d_in=5,
                       d_out=7, dtype=torch.float32)
    real = torch.ops.switchhead.cvmm_forward(*case.args())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in case.args()]
        fake = torch.ops.switchhead.cvmm_forward(*fake_args)
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in real] == [(6, 1, 7), (36,), (36,)]
    assert [t.dtype for t in fake] == [t.dtype for t in real]


def test_backend_switch_function_context_and_env(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.BACKEND_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernels.get_backend() == "auto"
    assert kernels.resolve_backend(cpu, torch.float32) == "torch"
    assert kernels.resolve_backend(torch.device("cuda"), torch.bfloat16) == "triton"  # resolution needs no GPU
    assert kernels.resolve_backend(torch.device("cuda"), torch.float64) == "torch"  # no fp64 Triton path
    monkeypatch.setenv(kernels.BACKEND_ENV, "torch")
    assert kernels.resolve_backend(torch.device("cuda"), torch.float16) == "torch"
    monkeypatch.setenv(kernels.BACKEND_ENV, "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):  # no silent fallback when forced
        kernels.cvmm(torch.randn(2, 1, 3), torch.zeros(2, 1, dtype=torch.long), torch.randn(1, 3, 2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.resolve_backend(cpu, torch.float32) == "triton"
    monkeypatch.setenv(kernels.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="SWITCHHEAD_CVMM_BACKEND must be one of auto, triton, torch"):
        kernels.get_backend()
    monkeypatch.delenv(kernels.BACKEND_ENV)
    with kernels.use_backend("torch"):
        assert kernels.resolve_backend(cpu, torch.float32) == "torch"
        kernels.set_backend("triton")
        assert kernels.get_backend() == "triton"
    assert kernels.get_backend() == "auto"  # the context manager restores the previous setting
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.set_backend("fast")


def test_deterministic_switch(monkeypatch):
    monkeypatch.delenv(kernels.DETERMINISTIC_ENV, raising=False)
    assert not kernels.is_deterministic()
    monkeypatch.setenv(kernels.DETERMINISTIC_ENV, "1")
    assert kernels.is_deterministic()
    kernels.set_deterministic(False)
    try:
        assert not kernels.is_deterministic()
    finally:
        kernels.set_deterministic(None)


@pytest.mark.parametrize("call, message", [
    (lambda: kernels.cvmm(torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.long), torch.randn(1, 3, 2)),
     "inputs \\[N, R, d_in\\]"),
    (lambda: kernels.cvmm(torch.randn(2, 1, 3), torch.zeros(3, 1, dtype=torch.long), torch.randn(1, 3, 2)),
     "inputs has 2 tokens but expert_index has 3"),
    (lambda: kernels.cvmm(torch.randn(2, 2, 3), torch.zeros(2, 3, dtype=torch.long), torch.randn(1, 3, 2)),
     "multiple of the input rows"),
    (lambda: kernels.cvmm(torch.randn(2, 1, 4), torch.zeros(2, 1, dtype=torch.long), torch.randn(1, 3, 2)),
     "d_in=4"),
    (lambda: kernels.cvmm(torch.randn(2, 1, 3), torch.zeros(2, 4, dtype=torch.long), torch.randn(1, 3, 2),
                          torch.rand(2, 4), out_groups=3), "out_groups=3 must divide"),
    (lambda: kernels.cvmm(torch.randn(2, 1, 3), torch.zeros(2, 2), torch.randn(1, 3, 2)), "integer tensor"),
    (lambda: kernels.cvmm(torch.randn(2, 1, 3), torch.full((2, 1), 4), torch.randn(3, 3, 2)),
     "must lie in \\[0, 3\\)"),
])
def test_bad_arguments_say_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_autocast_computes_in_the_autocast_dtype_like_the_reference():
    case = random_case(torch.Generator().manual_seed(4), "value", tokens=8, heads=2, experts=3, k=2, d_in=16,
                       d_out=8, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, reference = kernels.cvmm(*case.args()), expert_projection_torch(*case.args())
    assert ours.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(ours, reference, rtol=2e-2, atol=2e-2)
    ours.float().sum().backward()
    assert case.weight.grad.dtype == torch.float32 and case.gates.grad.dtype == torch.float32


def _tiny_model(preset):
    torch.manual_seed(0)
    return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset)).eval()


def test_compile_fullgraph_switchhead_layer_and_training_step():
    # aot_eager runs dynamo, the fake implementations and AOTAutograd (forward and backward graphs) without
    # inductor's C++ build, which takes minutes on 2 cores and is not what a graph break depends on
    model = _tiny_model("tiny-switchall")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    torch._dynamo.reset()
    hidden = torch.randn(2, 12, model.config.hidden_size, requires_grad=True)
    # a layer compiled on its own: SwitchHead (SwitchAll's output hooks, installed for its entropy loss, read a
    # ContextVar that dynamo can trace only from the whole model's forward)
    attention = _tiny_model("tiny-switchhead").model.layers[0].self_attn
    eager_values = attention.project_values(hidden)
    compiled_values = torch.compile(attention.project_values, fullgraph=True, backend="aot_eager")(hidden)
    torch.testing.assert_close(compiled_values, eager_values)

    def loss_fn(ids):
        return model(input_ids=ids, labels=ids).loss

    eager_loss = loss_fn(ids)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled_loss = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")(ids)
    compiled_grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


def test_triton_kernels_under_interpreter():
    """Runs cvmm_interpret_suite.py (forward + three gradients vs the reference, opcheck, model fwd/bwd)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(kernels.BACKEND_ENV, None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "cvmm_interpret_suite.py")],
        env=env, cwd=TESTS.parents[1], capture_output=True, text=True, timeout=600,
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert " passed" in report and "skipped" not in report and "failed" not in report, report


def test_benchmark_script_runs_and_writes_json(tmp_path):
    sys.path.insert(0, str(TESTS.parents[1] / "benchmarks"))
    import bench_cvmm

    out = tmp_path / "bench.json"
    assert bench_cvmm.main(["--tokens", "8", "--only", "47m-switchall", "--reps", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] and report["machine"] and report["cvmm_backend"] == "torch"
    timed = {(row["problem"].split("/")[1], row["impl"], row["mode"]) for row in report["results"] if "ms" in row}
    for impl in ("dense_mm", "cvmm", "reference", "per_expert_loop"):
        for mode in ("forward", "backward", "forward+backward"):
            assert ("mlp_values", impl, mode) in timed
    checks = [r for r in report["results"] if r["mode"] == "check"]
    assert len(checks) == 2 and all(r["ok"] and set(r["relative_errors"]) == {"output", "d_inputs", "d_weight"}
                                    | ({"d_gates"} if "values" in r["problem"] else set()) for r in checks)
    layers = [r for r in report["results"] if r["mode"] == "layer forward+backward"]
    assert [r["problem"] for r in layers] == ["wt103-47m-switchall-xl/layer"]
    assert all(r["ms"] > 0 and r["reference_ms"] > 0 for r in layers)
    dense = [r for r in report["results"] if r["impl"] == "dense_mm"]
    assert all(r["fraction_of_dense"] == 1.0 and r["tflops"] > 0 for r in dense)
    # the full paper shapes: tokens = batch x context of the preset
    problems = {p["name"]: p for p in bench_cvmm.paper_problems(None)}
    assert problems["wt103-262m-switchhead-xl/value"]["tokens"] == 64 * 512
    assert problems["wt103-262m-switchhead-xl/output"]["d_in"] == 132
