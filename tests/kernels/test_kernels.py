"""switchhead.kernels on the CPU: when the kernels run, argument checks, the model through torch.compile.

The Triton kernels themselves run under TRITON_INTERPRET=1 in a child pytest process
(`cvmm_interpret_suite.py`, started by `test_triton_kernels_under_interpreter`), because the interpreter must be
switched on before Triton decorates the kernels and must not leak into the other tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from switchhead import kernels
from switchhead import expert_ops
from switchhead.expert_ops import expert_projection, naive

from helpers.cvmm_cases import random_case  # noqa: E402
from helpers.models import tiny_model  # noqa: E402

TESTS = Path(__file__).resolve().parent


def test_model_calls_the_kernels_package():
    # the model's try/except must have found our op, so the interpreter suite covers the model's "cvmm" entry
    assert expert_ops._kernels is kernels


def test_triton_runs_on_cuda_and_the_interpreter_only(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not kernels.triton_runs(cpu, torch.float32)
    assert kernels.triton_runs(torch.device("cuda"), torch.bfloat16)  # the answer needs no GPU
    assert not kernels.triton_runs(torch.device("cuda"), torch.float64)  # no fp64 Triton path
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):  # the op itself never falls back
        kernels.cvmm(torch.randn(2, 1, 3), torch.zeros(2, 1, dtype=torch.long), torch.randn(1, 3, 2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels.triton_runs(cpu, torch.float32)


def test_sort_keys_are_the_narrowest_that_hold_the_expert_count_and_sort_alike():
    from switchhead.kernels.cvmm import key_dtype

    assert key_dtype(None) is torch.int64
    assert [key_dtype(g) for g in (1, 32767, 32768, 2**31 - 1, 2**31)] == [
        torch.int16, torch.int16, torch.int32, torch.int32, torch.int64]
    index = torch.randint(0, 300, (257, 3), generator=torch.Generator().manual_seed(0))
    wide, narrow = kernels.sort_slots(index), kernels.sort_slots(index, 300)
    assert wide.sorted_expert.dtype is torch.int64 and narrow.sorted_expert.dtype is torch.int16
    assert torch.equal(narrow.order, wide.order) and torch.equal(narrow.sorted_expert.long(), wide.sorted_expert)
    assert torch.equal(narrow.expert_index, index)


def test_a_slot_order_too_narrow_for_the_weight_is_refused():
    slot_order = kernels.sort_slots(torch.zeros(2, 1, dtype=torch.long), 4)  # int16 keys
    with pytest.raises(ValueError, match="num_experts=40000"):
        kernels.cvmm(torch.randn(2, 1, 3), slot_order, torch.randn(40000, 3, 2))


def test_sorting_once_wraps_only_the_entries_that_run_the_kernels(monkeypatch):
    """A layer's shared sort is made only where the kernels will read it: "cvmm" / "switchhead_auto" on tensors the
    kernels run; every other entry, and tensors they do not run, get the table's function itself (no sort)."""
    table = expert_ops.EXPERTS_IMPLEMENTATIONS
    index = torch.zeros(3, 2, dtype=torch.long)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name in ("cvmm", "switchhead_auto", "eager", "switchhead_fused"):
        assert expert_ops.sorting_once(table[name], torch.randn(3, 1, 4), index, 5) is table[name]
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the answer only: nothing below launches a kernel
    for name in ("cvmm", "switchhead_auto"):
        assert expert_ops.sorting_once(table[name], torch.randn(3, 1, 4), index, 5) is not table[name]
        assert expert_ops.sorting_once(table[name], torch.randn(3, 1, 4, dtype=torch.float64), index, 5) \
            is table[name]
    for name in ("eager", "switchhead_batched", "switchhead_grouped", "switchhead_fused"):
        assert expert_ops.sorting_once(table[name], torch.randn(3, 1, 4), index, 5) is table[name]


def test_deterministic_switch(monkeypatch):
    """Slots summed in a fixed order by default; atomics only when asked for, and never under torch's flag."""
    monkeypatch.delenv(kernels.DETERMINISTIC_ENV, raising=False)
    assert kernels.is_deterministic()
    monkeypatch.setenv(kernels.DETERMINISTIC_ENV, "0")
    assert not kernels.is_deterministic()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert kernels.is_deterministic()
    finally:
        torch.use_deterministic_algorithms(previous)
    monkeypatch.setenv(kernels.DETERMINISTIC_ENV, "1")
    kernels.set_deterministic(False)
    try:
        assert not kernels.is_deterministic()
    finally:
        kernels.set_deterministic(None)
    assert kernels.is_deterministic()


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
])
def test_bad_arguments_say_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_index_check_mode_names_the_range(monkeypatch):
    monkeypatch.setenv(kernels.CHECK_INDEX_ENV, "1")
    with pytest.raises(ValueError, match="must lie in \\[0, 3\\)"):
        kernels.cvmm(torch.randn(2, 1, 3), torch.full((2, 1), 4), torch.randn(3, 3, 2))


def test_autocast_computes_in_the_autocast_dtype_like_the_reference():
    case = random_case(torch.Generator().manual_seed(4), "value", tokens=8, heads=2, experts=3, k=2, d_in=16,
                       d_out=8, dtype=torch.float32)
    want = naive(*case.as_dtype(torch.bfloat16).args())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = expert_projection(*case.args(), implementation="cvmm")
    assert ours.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(ours, want, rtol=2e-2, atol=2e-2)
    ours.float().sum().backward()
    assert case.weight.grad.dtype == torch.float32 and case.gates.grad.dtype == torch.float32


def test_compile_fullgraph_switchhead_layer_and_training_step():
    # aot_eager runs dynamo, the fake implementations and AOTAutograd (forward and backward graphs) without
    # inductor's C++ build, which takes minutes on 2 cores and is not what a graph break depends on
    model = tiny_model("tiny-switchall").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    torch._dynamo.reset()
    hidden = torch.randn(2, 12, model.config.hidden_size, requires_grad=True)
    # a layer compiled on its own: SwitchHead (SwitchAll's output hooks, installed for its entropy loss, read a
    # ContextVar that dynamo can trace only from the whole model's forward)
    attention = tiny_model("tiny-switchhead").eval().model.layers[0].self_attn
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


@pytest.mark.integration
def test_triton_kernels_under_interpreter():
    """Runs cvmm_interpret_suite.py (forward + three gradients vs the reference, opcheck, model fwd/bwd)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS / "cvmm_interpret_suite.py")],
        env=env, cwd=TESTS.parents[1], capture_output=True, text=True, timeout=600,
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    # pytest's last line counts the outcomes ("12 passed in 3.1s"); the run's banners may name skips of other
    # tests (the missing-data note), so only that line is read: every case ran and passed
    summary = [line for line in result.stdout.splitlines() if line.strip()][-1]
    counts = dict((word.strip(","), int(number)) for number, word in re.findall(r"(\d+) (\w+)", summary))
    assert counts.get("passed", 0) > 0 and set(counts) <= {"passed", "warning", "warnings"}, report


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
