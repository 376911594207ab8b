"""The SwitchHead / SwitchAll / dense models: training, generation, caching, serialisation, and the paper's formula."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM, SwitchHeadModel
from switchhead.modeling_switchhead import SwitchHeadAttention, sigma_moe_entropy_loss
from helpers.models import tiny_model
from helpers.padding import generate_cached_and_uncached, left_padded_batch, positions_from_mask

VARIANTS = ["tiny-switchhead", "tiny-switchall", "tiny-dense"]


# ------------------------------------------------------------------------------------------ must-show 1
@pytest.mark.parametrize("preset", VARIANTS + ["tiny-switchhead-xl"])
def test_forward_backward_and_generate(preset):
    model = tiny_model(preset)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 12, model.config.vocab_size)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum())]
    assert not missing, f"parameters without gradient: {missing}"
    model.eval()
    generated = model.generate(ids[:, :5], max_new_tokens=6, do_sample=False)
    assert generated.shape == (2, 11)
    assert torch.equal(generated[:, :5], ids[:, :5])


def test_loss_is_shifted_cross_entropy_and_respects_num_items_in_batch():
    model = tiny_model("tiny-switchhead").eval()
    ids = torch.randint(0, 512, (2, 9))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels)
    expected = F.cross_entropy(out.logits[:, :-1].reshape(-1, 512), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)
    summed = model(ids, labels=labels, num_items_in_batch=torch.tensor(4)).loss
    total = F.cross_entropy(out.logits[:, :-1].reshape(-1, 512), labels[:, 1:].reshape(-1), ignore_index=-100,
                            reduction="sum")
    torch.testing.assert_close(summed, total / 4)


def test_switchall_adds_entropy_regulariser_only_in_training():
    model = tiny_model("tiny-switchall")
    ids = torch.randint(0, 512, (2, 10))
    model.eval()
    plain = model(ids, labels=ids)
    assert plain.aux_loss is None and plain.router_logits is None
    reported = model(ids, labels=ids, output_router_logits=True)
    # value + output selection per layer, then the sigma-MoE router
    assert len(reported.router_logits) == model.config.num_hidden_layers * 3
    mlp_logits = reported.router_logits[2::3]
    torch.testing.assert_close(reported.aux_loss, sigma_moe_entropy_loss(mlp_logits))
    torch.testing.assert_close(reported.loss, plain.loss)  # reported, not added, in eval
    model.train()
    trained = model(ids, labels=ids)
    assert trained.router_logits is None  # computed for the regulariser, not returned unless asked
    torch.testing.assert_close(trained.loss, plain.loss + model.config.entropy_reg_coef * trained.aux_loss)
    # sum_e p log p is minus the entropy: between -log(E) and 0 per layer
    layers, experts = model.config.num_hidden_layers, model.config.num_mlp_experts
    assert -layers * torch.log(torch.tensor(float(experts))) - 1e-5 <= trained.aux_loss <= 0


def test_entropy_regulariser_matches_definition_and_ignores_padding():
    logits = torch.randn(6, 5)
    p = torch.softmax(logits, -1).mean(0)
    torch.testing.assert_close(sigma_moe_entropy_loss((logits,)), (p * p.log()).sum())
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    kept = logits[mask.reshape(-1).bool()]
    q = torch.softmax(kept, -1).mean(0)
    torch.testing.assert_close(sigma_moe_entropy_loss((logits,), mask), (q * q.log()).sum())


def test_outputs_hidden_states_attentions_router_logits_and_logits_to_keep():
    model = tiny_model("tiny-switchhead", attn_implementation="eager").eval()
    ids = torch.randint(0, 512, (2, 8))
    out = model(ids, output_hidden_states=True, output_attentions=True, output_router_logits=True)
    layers = model.config.num_hidden_layers
    assert len(out.hidden_states) == layers + 1
    assert len(out.attentions) == layers and out.attentions[0].shape == (2, 2, 8, 8)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 2, 8))
    assert torch.all(out.attentions[0].triu(1) == 0)  # causal
    assert len(out.router_logits) == 2 * layers and out.router_logits[0].shape == (16, 2 * 4)
    last = model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, 512)
    torch.testing.assert_close(last[:, 0], out.logits[:, -1])


@pytest.mark.parametrize("preset", VARIANTS + ["tiny-switchhead-xl"])
def test_eager_and_sdpa_agree_with_padding(preset):
    model = tiny_model(preset).eval()
    ids, mask = left_padded_batch(512)
    positions = positions_from_mask(mask)
    model.set_attn_implementation("eager")
    eager = model(ids, attention_mask=mask, position_ids=positions).logits
    model.set_attn_implementation("sdpa")
    sdpa = model(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(sdpa[real], eager[real], atol=1e-5, rtol=1e-5)


def attention_inputs_and_outputs(model, ids, mask, positions, feed=None):
    """Each layer's attention input and output for one forward pass. With `feed` (a list of hidden states, one per
    layer), each layer's attention runs on `feed[i]` instead of what the layer below produced."""
    inputs, outputs, handles = [], [], []
    for index, layer in enumerate(model.model.layers):
        def replace_and_record(module, args, index=index):
            hidden = args[0] if feed is None else feed[index]
            inputs.append(hidden)
            return (hidden, *args[1:])

        handles.append(layer.self_attn.register_forward_pre_hook(replace_and_record))
        handles.append(layer.self_attn.register_forward_hook(lambda module, args, output: outputs.append(output[0])))
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=positions)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, outputs


# Half precision, layer by layer: the eager and sdpa attention round differently in fp16 / bf16, and a sigma-gated
# top-k router turns a rounding difference in one layer's output into a different expert choice further up for some
# inputs (a discrete jump that no tolerance covers; see tests/conformance/test_transformers_conformance.py). Fed the
# same input, an attention layer routes identically under both backends, so its outputs may differ by rounding only:
# here at most 2 units in the last place of the largest output (measured: under 1), for every input draw, padding
# and mask. A masking or position error differs by the size of the outputs themselves.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-switchall", "tiny-switchhead-xl"])
def test_eager_and_sdpa_attention_agree_layer_by_layer_in_half_precision(preset, dtype):
    model = tiny_model(preset, dtype=dtype).eval()
    for seed in range(4):
        ids, mask = left_padded_batch(512, lengths=(11, 6, 9, 11), seed=seed)
        for use_mask in (True, False):
            attention_mask = mask if use_mask else None
            positions = positions_from_mask(mask) if use_mask else None
            model.set_attn_implementation("eager")
            eager_inputs, eager_outputs = attention_inputs_and_outputs(model, ids, attention_mask, positions)
            model.set_attn_implementation("sdpa")
            _, sdpa_outputs = attention_inputs_and_outputs(model, ids, attention_mask, positions, feed=eager_inputs)
            real = mask.bool() if use_mask else torch.ones_like(mask, dtype=torch.bool)
            assert len(eager_outputs) == len(sdpa_outputs) == model.config.num_hidden_layers
            for layer, (eager, sdpa) in enumerate(zip(eager_outputs, sdpa_outputs)):
                assert eager.dtype == sdpa.dtype == dtype
                eager, sdpa = eager[real].float(), sdpa[real].float()
                bound = 2 * torch.finfo(dtype).eps * eager.abs().max()
                difference = (sdpa - eager).abs().max()
                assert difference <= bound, f"seed {seed}, mask {use_mask}, layer {layer}: {difference} > {bound}"


def test_plain_causal_sdpa_gets_no_dense_mask(monkeypatch):
    """Without padding the sdpa backend sees no mask, so it can dispatch to flash / efficient kernels."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seen = []
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recording)
    model = tiny_model("tiny-switchhead", attn_implementation="sdpa").eval()
    model(torch.randint(0, 512, (2, 8)))
    assert seen and all(mask is None for mask in seen)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 512, (2, 10))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model("tiny-switchall", hidden_dropout=0.0)
        if checkpointing:
            model.activation_checkpointing_enable()
        model.config.entropy_reg_coef = 0.0
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


def test_bf16_autocast_forward_backward():
    model = tiny_model("tiny-switchall")
    ids = torch.randint(0, 512, (2, 10))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)


# ------------------------------------------------------------------------------------------ must-show 2
def test_auto_classes_are_registered():
    fields = {k: v for k, v in SwitchHeadConfig.from_preset("tiny-switchhead").to_diff_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("switchhead", **fields)
    assert isinstance(config, SwitchHeadConfig)
    assert isinstance(AutoModelForCausalLM.from_config(config), SwitchHeadForCausalLM)
    assert isinstance(AutoModel.from_config(config), SwitchHeadModel)


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-switchhead-xl"])
def test_save_and_reload_gives_identical_logits(preset, tmp_path):
    model = tiny_model(preset).eval()
    ids = torch.randint(0, 512, (2, 9))
    expected = model(ids).logits
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_switchhead.SwitchHeadConfig",
        "AutoModel": "modeling_switchhead.SwitchHeadModel",
        "AutoModelForCausalLM": "modeling_switchhead.SwitchHeadForCausalLM",
        "AutoModelForSequenceClassification": "modeling_switchhead.SwitchHeadForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_switchhead.SwitchHeadForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_switchhead.SwitchHeadForQuestionAnswering",
    }
    assert (tmp_path / "modeling_switchhead.py").is_file() and (tmp_path / "configuration_switchhead.py").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, SwitchHeadForCausalLM)
    assert torch.equal(reloaded(ids).logits, expected)


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["switchhead"] = None  # make `import switchhead` fail, as on a machine without our package
    try:
        import switchhead  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("switchhead was importable")
    import torch
    from transformers import AutoModelForCausalLM
    folder, ids_path, out_path = sys.argv[1:]
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    ids = torch.load(ids_path)
    torch.save(model(ids).logits, out_path)
    """
)


@pytest.mark.integration
def test_saved_folder_loads_with_trust_remote_code_without_the_package(tmp_path):
    model = tiny_model("tiny-switchall").eval()
    ids = torch.randint(0, 512, (2, 9))
    expected = model(ids).logits
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------ must-show 3
@pytest.mark.parametrize("preset", VARIANTS + ["tiny-switchhead-xl"])
def test_cached_decoding_equals_uncached_and_full_forward(preset):
    model = tiny_model(preset).eval()
    ids, mask = left_padded_batch(512)
    cached = generate_cached_and_uncached(model, ids, mask, new_tokens=8)

    # every cached step's logits equal one full forward over the final sequence
    sequences = cached.sequences
    full_mask = torch.cat([mask, torch.ones(3, sequences.shape[1] - ids.shape[1], dtype=mask.dtype)], 1)
    full = model(sequences, attention_mask=full_mask, position_ids=positions_from_mask(full_mask)).logits
    prompt = ids.shape[1]
    for step, logits in enumerate(cached.logits):
        torch.testing.assert_close(logits, full[:, prompt - 1 + step], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ must-show 4
def slow_switchhead_attention(x, q_w, k_w, w_s, w_d, w_v, w_o, heads, experts, top_k, rotary):
    """PAPER.md section 1 written as loops over batch, positions, heads and experts (RoPE variant, causal).

    x [B, T, d]; q_w, k_w [H*dh, d]; w_s, w_d [H*E, d]; w_v [H*E, d, dh]; w_o [H*E, dh, d].
    """
    batch, length, d = x.shape
    dh = w_v.shape[-1]
    y = torch.zeros(batch, length, d, dtype=x.dtype)
    positions = torch.arange(length, dtype=x.dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2, dtype=x.dtype) / rotary))

    def rope(vector, position):  # NeoX rotate-half on the first `rotary` channels
        angles = position * inv_freq
        cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
        part = vector[:rotary]
        half = rotary // 2
        rotated = torch.cat([-part[half:], part[:half]])
        return torch.cat([part * cos + rotated * sin, vector[rotary:]])

    for b in range(batch):
        source_gate = torch.sigmoid(x[b] @ w_s.T).view(length, heads, experts)
        dest_gate = torch.sigmoid(x[b] @ w_d.T).view(length, heads, experts)
        for h in range(heads):
            q = torch.stack([rope(x[b, t] @ q_w[h * dh:(h + 1) * dh].T, positions[t]) for t in range(length)])
            k = torch.stack([rope(x[b, t] @ k_w[h * dh:(h + 1) * dh].T, positions[t]) for t in range(length)])
            values = []
            for t in range(length):
                v = torch.zeros(dh, dtype=x.dtype)
                for e in torch.topk(source_gate[t, h], top_k).indices.tolist():
                    v = v + source_gate[t, h, e] * (x[b, t] @ w_v[h * experts + e])
                values.append(v)
            values = torch.stack(values)
            for t in range(length):
                scores = (q[t] @ k[: t + 1].T) / dh**0.5
                attended = torch.softmax(scores, -1) @ values[: t + 1]
                for e in torch.topk(dest_gate[t, h], top_k).indices.tolist():
                    y[b, t] = y[b, t] + dest_gate[t, h, e] * (attended @ w_o[h * experts + e])
    return y


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_switchhead_attention_matches_slow_formula_with_gradients(implementation):
    torch.manual_seed(1)
    config = SwitchHeadConfig(hidden_size=16, num_attention_heads=2, head_dim=8, num_attention_experts=4,
                              num_attention_experts_per_tok=2, num_hidden_layers=1, vocab_size=32,
                              intermediate_size=32, attn_implementation=implementation)
    model = SwitchHeadModel(config).double()
    layer = model.layers[0].self_attn
    assert isinstance(layer, SwitchHeadAttention)
    x = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    position_ids = torch.arange(6)[None].expand(2, -1)
    cos_sin = model.rotary_emb(x, position_ids)
    fast, _ = layer(x, position_embeddings=cos_sin, attention_mask=None)
    params = [layer.q_proj.weight, layer.k_proj.weight, layer.value_selection.weight, layer.output_selection.weight,
              layer.value_experts, layer.output_experts]
    grad_out = torch.randn_like(fast)
    fast_grads = torch.autograd.grad(fast, [x] + params, grad_out)

    x_slow = x.detach().clone().requires_grad_(True)
    slow_params = [p.detach().clone().requires_grad_(True) for p in params]
    slow = slow_switchhead_attention(x_slow, *slow_params, heads=2, experts=4, top_k=2,
                                     rotary=config.num_rotary_channels)
    slow_grads = torch.autograd.grad(slow, [x_slow] + slow_params, grad_out)

    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=1e-10)
    names = ["input", "q", "k", "value gate (W_S)", "output gate (W_D)", "value experts", "output experts"]
    for name, got, want in zip(names, fast_grads, slow_grads):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10, msg=f"gradient of {name}")


def test_expert_dropout_changes_selection_only_in_training():
    model = tiny_model("tiny-switchhead", attention_expert_dropout=0.5)
    ids = torch.randint(0, 512, (2, 10))
    model.eval()
    first, second = model(ids).logits, model(ids).logits
    assert torch.equal(first, second)
    model.train()
    torch.manual_seed(3)
    dropped = model(ids).logits
    assert not torch.allclose(dropped, first)


def test_selection_rows_are_renormalised_at_init():
    model = tiny_model("tiny-switchhead")
    weight = model.model.layers[0].self_attn.value_selection.weight
    norms = weight.norm(dim=-1)
    torch.testing.assert_close(norms, norms.mean().expand_as(norms))  # every row has the same norm
    expected_std = model.config.init_scale / model.config.hidden_size**0.5
    assert abs(weight.std().item() - expected_std) / expected_std < 0.2
