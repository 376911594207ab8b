"""torch.compile: full-graph training steps, recompilation, compiled XL decoding, the compile-only ReLU, inductor
on the Hub copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import StaticCache

from switchhead import expert_ops
from switchhead import positions as position_ops
from switchhead import modeling_switchhead as modeling

from helpers.decoding import next_step, prefill, variant_model
from helpers.padding import left_padded_batch, positions_from_mask


def _graph_ops(graph_module) -> set[str]:
    return {getattr(node.target, "__name__", str(node.target)) for node in graph_module.graph.nodes
            if node.op in ("call_function", "call_method")}


def _capturing_backend(graphs: list):
    """A torch.compile backend that appends each graph dynamo hands it to `graphs` and runs it as traced."""
    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    return capture


@pytest.mark.parametrize("variant", ["switchhead-xl", "dense-xl"])
def test_compiled_xl_decoding_reads_the_encoding_table(variant, monkeypatch):
    """Compiled, a decoding step reads the distances' sinusoidal encodings from the table an eager call built (a
    graph input) instead of computing sines and cosines in every layer; with no table yet it computes them."""
    model = variant_model(variant)
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(6, 3, 5))
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 2)
    graphs = []
    capture = _capturing_backend(graphs)

    def step(keep_table: bool) -> set[str]:
        monkeypatch.setattr(position_ops, "_PAST_ENCODINGS", {})
        cache.reset()
        prefilled = prefill(model, cache, ids, mask)  # eager: builds the table
        if not keep_table:
            position_ops._PAST_ENCODINGS.clear()
        _, step_mask, token = next_step(prefilled, ids, mask)
        step_mask = torch.cat([step_mask, torch.zeros_like(token)], 1)  # the static cache's full length
        kwargs = dict(input_ids=token, attention_mask=step_mask, cache=cache, use_cache=True,
                      position_ids=positions_from_mask(step_mask)[:, -2:-1])
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(model, backend=capture, fullgraph=True, dynamic=False)(**kwargs).logits
        cache.reset()
        prefill(model, cache, ids, mask)
        with torch.no_grad():
            want = model(**kwargs).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert len(graphs) == 1
        return _graph_ops(graphs.pop())

    assert not {"sin", "cos"} & step(keep_table=True)
    assert {"sin", "cos"} <= step(keep_table=False)  # no table yet: computed in the graph


def test_compiled_relu_gradient_and_what_its_forward_saves():
    """Under torch.compile the MLP's ReLU is `_ReluFromOutput`: the gradient of `F.relu` (zeros included), and
    inductor's partitioner saves no boolean mask for its backward (the slow CPU kernels of
    benchmarks/inductor_relu_mask.py)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    x = torch.tensor([[-2.0, -0.0, 0.0, 1e-30, 3.0, -1e-30]], requires_grad=True)
    grad = torch.randn(1, 6)
    (want,) = torch.autograd.grad(torch.nn.functional.relu(x), x, grad)
    (got,) = torch.autograd.grad(expert_ops._ReluFromOutput.apply(x), x, grad)
    assert torch.equal(got, want)

    up, down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
    saved_dtypes = []

    def forward_compiler(graph_module, example_inputs):
        outputs = next(node for node in graph_module.graph.nodes if node.op == "output").args[0]
        saved_dtypes.append({node.meta["val"].dtype for node in outputs[1:]})  # [0]: the forward's own output
        return graph_module.forward

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, inputs: gm.forward,
                           partition_fn=min_cut_rematerialization_partition,  # inductor's partitioner
                           decompositions=select_decomp_table())  # and decompositions
    inputs = torch.randn(2, 8, 16, requires_grad=True)  # [B, T, d], as in the model
    for activation in (modeling._ACTIVATIONS["relu"], torch.nn.functional.relu):
        torch._dynamo.reset()
        compiled = torch.compile(lambda t: down(activation(up(t))), backend=backend, fullgraph=True)
        (got,) = torch.autograd.grad(compiled(inputs).sum(), inputs)
        (want,) = torch.autograd.grad(down(torch.nn.functional.relu(up(inputs))).sum(), inputs)
        torch.testing.assert_close(got, want)
    ours, aten_relu = saved_dtypes
    assert torch.bool not in ours
    assert torch.bool in aten_relu  # what the test guards against: F.relu's mask saved by the forward


@pytest.mark.parametrize("variant, implementation", [("switchhead-rope", None), ("switchall-xl", None),
                                                     ("dense-rope", None), ("switchhead-rope", "switchhead_fused")])
def test_compile_fullgraph_training_step_on_a_fresh_model(variant, implementation):
    # a fresh model in training mode: SwitchAll records its router logits (entropy loss) through Transformers'
    # output hooks, which used to be installed inside the first compiled call under a lock dynamo cannot enter;
    # the fused attention block's hand-written backward traces too
    model = variant_model(variant).train()
    if implementation is not None:
        model.set_experts_implementation(implementation)
    model.config.hidden_dropout = 0.0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(8, 5))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(input_ids=ids, attention_mask=mask, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    eager_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, eager_loss)
    for got, want in zip(grads, eager_grads):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want)


def test_eager_calls_between_compiled_ones_do_not_recompile():
    """The per-head path's decisions are functions of shapes only (no state written by an eager call): an eager
    call between compiled ones does not invalidate the compiled graph."""
    model = variant_model("switchhead-rope")
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(1,))
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_capturing_backend(graphs), fullgraph=True, dynamic=False)
    with torch.no_grad():
        first = compiled(input_ids=ids, use_cache=False).logits
        eager = model(input_ids=ids, use_cache=False).logits
        again = compiled(input_ids=ids, use_cache=False).logits
    assert len(graphs) == 1
    torch.testing.assert_close(first, eager)
    torch.testing.assert_close(again, eager)


@pytest.mark.integration
def test_inductor_compiles_xl_forward_and_hub_copy_without_kernels(tmp_path, monkeypatch):
    """Inductor (C++ on the CPU) on the Hub copy of the model file, its kernels import switched off."""
    import importlib
    import shutil

    package = tmp_path / "hub_copy_fast_path"
    package.mkdir()
    (package / "__init__.py").write_text("")
    from transformers.dynamic_module_utils import get_relative_import_files

    model_file = Path(__file__).resolve().parents[2] / "modeling_switchhead" / "modeling_switchhead.py"
    for name in [model_file, *get_relative_import_files(model_file)]:  # the files a Hub folder carries
        shutil.copy(name, package / Path(name).name)
    monkeypatch.syspath_prepend(str(tmp_path))
    hub = importlib.import_module("hub_copy_fast_path.modeling_switchhead")
    # as where the switchhead package is not installed
    monkeypatch.setattr(importlib.import_module("hub_copy_fast_path.expert_ops"), "_kernels", None)
    reference = variant_model("switchhead-xl")
    model = hub.SwitchHeadForCausalLM(hub.SwitchHeadConfig(**reference.config.to_diff_dict())).eval()
    model.load_state_dict(reference.state_dict())
    ids, mask = left_padded_batch(model.config.vocab_size, lengths=(7, 4))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask).logits
        want = model(input_ids=ids, attention_mask=mask).logits
        package_logits = reference(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(want, package_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
