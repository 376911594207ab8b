"""MoEUT (Csordás, Irie, Schmidhuber, Potts, Manning, NeurIPS 2024) as a configuration of the one model: shared layers
(`layer_group_size`), peri-LayerNorm and the group-wide entropy regulariser.

The model is held to `_reference`, a plain loop written from the paper in torch on the same weights: G distinct
blocks applied n_layers / G times; attention's query, key and routers read LN1(x), its values x; the sigma-MoE router
reads LN2(x), its experts x; the stream is normalised only before the output layer.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from switchhead import PRESETS, SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.modeling_switchhead import MoEUTDecoderLayer, SwitchHeadDecoderLayer

TOL = dict(rtol=1e-5, atol=1e-5)


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-moeut", **overrides)).eval()


def _rope(x, positions, rotary, theta=10000.0):
    """Rotary encoding of the first `rotary` channels of x `[B, H, T, dh]` (halves rotated against each other)."""
    frequencies = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)
    angles = positions[:, None].float() * frequencies[None]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    part, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    turned = torch.cat((-part[..., half:], part[..., :half]), -1)
    return torch.cat((part * cos + turned * sin, rest), -1)


def _top_k_gates(logits, groups, experts, k):
    """sigmoid scores per group of experts `[N, groups, E]`, and a dense gate matrix holding only the top-k."""
    scores = torch.sigmoid(logits.float()).view(-1, groups, experts)
    values, index = scores.topk(k, dim=-1)
    return torch.zeros_like(scores).scatter(-1, index, values)


def _reference(model, ids):
    """Logits and, per distinct block, its routers' logits per application: the paper's MoEUT as a plain loop."""
    config, weights = model.config, dict(model.state_dict())
    heads, dh, experts, d = config.num_attention_heads, config.head_dim, config.num_attention_experts, config.hidden_size
    batch, length = ids.shape
    x = F.embedding(ids, weights["model.embed_tokens.weight"])
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    recorded = {}
    for repeat in range(config.num_hidden_layers // config.layer_group_size):
        for member in range(config.layer_group_size):
            w = {name[len(f"model.layers.{member}."):]: tensor for name, tensor in weights.items()
                 if name.startswith(f"model.layers.{member}.")}
            normed = F.layer_norm(x, (d,), w["input_layernorm.weight"], w["input_layernorm.bias"])
            q = (normed @ w["self_attn.q_proj.weight"].T).view(batch, length, heads, dh).transpose(1, 2)
            k = (normed @ w["self_attn.k_proj.weight"].T).view(batch, length, heads, dh).transpose(1, 2)
            positions = torch.arange(length)
            q, k = _rope(q, positions, config.num_rotary_channels), _rope(k, positions, config.num_rotary_channels)
            value_logits = normed.reshape(-1, d) @ w["self_attn.value_selection.weight"].T
            value_gates = _top_k_gates(value_logits, heads, experts, config.num_attention_experts_per_tok)
            per_expert = torch.einsum("nd,hedv->nhev", x.reshape(-1, d),
                                      w["self_attn.value_experts"].view(heads, experts, d, dh))
            v = (per_expert * value_gates[..., None]).sum(2).view(batch, length, heads, dh).transpose(1, 2)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            attended = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # [B, H, T, dh]
            output_logits = normed.reshape(-1, d) @ w["self_attn.output_selection.weight"].T
            output_gates = _top_k_gates(output_logits, heads, experts, config.num_attention_experts_per_tok)
            rows = attended.transpose(1, 2).reshape(-1, heads, dh)
            per_expert = torch.einsum("nhv,hevd->nhed", rows, w["self_attn.output_experts"].view(heads, experts, dh, d))
            x = x + (per_expert * output_gates[..., None]).sum((1, 2)).view(batch, length, d)
            normed = F.layer_norm(x, (d,), w["post_attention_layernorm.weight"], w["post_attention_layernorm.bias"])
            mlp_logits = normed.reshape(-1, d) @ w["mlp.gate.weight"].T
            mlp_gates = _top_k_gates(mlp_logits, 1, config.num_mlp_experts, config.num_mlp_experts_per_tok)[:, 0]
            hidden = torch.relu(torch.einsum("nd,eds->nes", x.reshape(-1, d), w["mlp.experts.expert_keys"]))
            out = torch.einsum("nes,esd->ned", hidden, w["mlp.experts.expert_values"])
            x = x + (out * mlp_gates[..., None]).sum(1).view(batch, length, d)
            for slot, logits in enumerate((value_logits, output_logits, mlp_logits)):
                recorded.setdefault((member, slot), []).append(logits)
    x = F.layer_norm(x, (d,), weights["model.norm.weight"], weights["model.norm.bias"])
    return x @ weights["lm_head.weight"].T + weights["lm_head.bias"], recorded


def _reference_regulariser(config, recorded, batch):
    """The MoEUT regulariser as the paper states it: per distinct block and router, the entropy of the mean expert
    distribution over one sequence's tokens in all the block's applications (per head), averaged over sequences
    and heads; minus it, weighted 0.001 (attention) / 0.01 (MLP), summed."""
    total = 0.0
    for (member, slot), uses in recorded.items():
        experts = config.num_mlp_experts if slot == 2 else config.num_attention_experts
        coef = config.entropy_reg_coef if slot == 2 else config.attention_entropy_reg_coef
        probs = torch.cat([F.softmax(l.view(batch, -1, l.shape[-1] // experts, experts), -1) for l in uses], 1)
        mean = probs.mean(1)  # [B, groups, E]
        total = total + coef * (mean * mean.log()).sum(-1).mean()
    return total


# ------------------------------------------------------------------------------------------------------- config
def test_a_config_without_the_moeut_fields_gives_todays_model():
    fields = SwitchHeadConfig.from_preset("tiny-switchall").to_dict()
    for name in ("layer_group_size", "layernorm_placement", "entropy_reg_scope", "attention_entropy_reg_coef"):
        fields.pop(name)
    config = SwitchHeadConfig.from_dict(fields)
    assert (config.layer_group_size, config.layernorm_placement, config.entropy_reg_scope) == (None, "pre", "layer")
    assert config.attention_entropy_reg_coef == 0.0 and config.num_distinct_layers == config.num_hidden_layers
    model = SwitchHeadForCausalLM(config)
    assert len(model.model.layers) == 2 and all(type(layer) is SwitchHeadDecoderLayer for layer in model.model.layers)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_group_size=3), "num_hidden_layers (4) must be a multiple of layer_group_size (3)"),
    (dict(layer_group_size=0), "layer_group_size (0) must be >= 1"),
    (dict(layer_group_size=2.0), "layer_group_size must be None or an integer"),
    (dict(layernorm_placement="post"), "layernorm_placement must be one of 'pre', 'peri'"),
    (dict(mlp_type="dense"), "layernorm_placement='peri' needs mlp_type='sigma_moe'"),
    (dict(position_encoding="xl"), "layernorm_placement='peri' needs position_encoding='rope'"),
    (dict(entropy_reg_scope="layer"), "attention_entropy_reg_coef (0.001) needs entropy_reg_scope='group'"),
    (dict(entropy_reg_scope="model"), "entropy_reg_scope must be one of 'layer', 'group'"),
    (dict(attention_entropy_reg_coef=-1.0), "attention_entropy_reg_coef must be a finite number >= 0"),
])
def test_invalid_moeut_settings_are_refused_with_the_rule(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SwitchHeadConfig.from_preset("tiny-moeut", **overrides)


def test_moeut_presets_are_the_authors_profiles():
    config = SwitchHeadConfig.from_preset("moeut-1b")
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_mlp_experts,
            config.num_attention_experts, config.head_dim, config.num_mlp_experts_per_tok,
            config.layer_group_size) == (1536, 36, 6, 565, 12, 128, 24, 4)
    assert config.num_layer_groups == 9 and config.init_scale == pytest.approx(math.sqrt(2 / 36))
    assert {name for name in PRESETS if "moeut" in name} == {
        "moeut-44m", "moeut-126m", "moeut-244m", "moeut-318m", "moeut-727m", "moeut-1b", "tiny-moeut"}


# -------------------------------------------------------------------------------------------------------- model
def test_moeut_equals_the_reference_loop_and_its_regulariser():
    model = _model()
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    expected, recorded = _reference(model, ids)
    torch.testing.assert_close(model(ids).logits, expected, **TOL)
    out = model(ids, output_router_logits=True)
    torch.testing.assert_close(out.aux_loss, _reference_regulariser(model.config, recorded, 2), **TOL)
    model.train()  # dropout is 0: the training loss is the language-model loss plus the regulariser
    trained = model(ids, labels=ids)
    plain = F.cross_entropy(expected[:, :-1].reshape(-1, 512), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(trained.loss, plain + _reference_regulariser(model.config, recorded, 2), **TOL)


def test_padding_is_left_out_of_the_group_regulariser():
    model = _model()
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding of the second sequence
    with_padding = model(ids, attention_mask=mask, output_router_logits=True).aux_loss
    alone = [model(ids[i:i + 1, 3 * i:], output_router_logits=True).aux_loss for i in range(2)]
    torch.testing.assert_close(with_padding, (alone[0] + alone[1]) / 2, **TOL)


def test_shared_layers_have_one_parameter_each_and_save_once(tmp_path):
    model = _model()
    assert len(model.model.layers) == 2 and all(isinstance(l, MoEUTDecoderLayer) for l in model.model.layers)
    assert {int(name.split(".")[2]) for name in model.state_dict() if name.startswith("model.layers.")} == {0, 1}
    model.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        layer_keys = [name for name in saved.keys() if ".layers." in name]
    assert {int(name.split(".")[2]) for name in layer_keys} == {0, 1}
    loaded = SwitchHeadForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 512, (1, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_cached_greedy_decoding_equals_the_full_forward():
    model = _model()
    prompt = torch.randint(0, 512, (2, 5), generator=torch.Generator().manual_seed(3))
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    tokens = prompt
    for _ in range(8):  # no cache: the argmax of a full forward, token by token
        tokens = torch.cat((tokens, model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)), 1)
    assert torch.equal(generated, tokens)
    out = model(prompt, use_cache=True)
    assert len(out.past_key_values.layers) == model.config.num_hidden_layers  # one slot per application
    step = model(tokens[:, 5:6], past_key_values=out.past_key_values, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, model(tokens[:, :6]).logits[:, -1], **TOL)


def test_gradient_checkpointing_gives_the_same_gradients():
    def gradients(model):
        model.train()
        ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(4))
        model(ids, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}
    plain = gradients(_model())
    checkpointed = _model()
    checkpointed.activation_checkpointing_enable()
    for name, grad in gradients(checkpointed).items():
        torch.testing.assert_close(grad, plain[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("implementation", ["switchhead_batched", "switchhead_grouped", "cvmm", "switchhead_auto",
                                            "switchhead_fused"])
def test_every_experts_implementation_matches_eager_for_attention_and_mlp(implementation):
    ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(5))

    def run(name):
        model = _model()
        model.set_experts_implementation(name)
        model.train()
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}
    eager, other = run("eager"), run(implementation)
    torch.testing.assert_close(other[0], eager[0], **TOL)
    for name, grad in eager[1].items():
        torch.testing.assert_close(other[1][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_shared_layers_with_pre_layernorm_apply_the_group_in_order():
    """Sharing alone (pre-LayerNorm SwitchAll): equal to the unshared model whose blocks repeat the group's weights."""
    shared = _model(layernorm_placement="pre", entropy_reg_scope="layer", attention_entropy_reg_coef=0.0)
    unshared = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(
        "tiny-moeut", layernorm_placement="pre", entropy_reg_scope="layer", attention_entropy_reg_coef=0.0,
        layer_group_size=None)).eval()
    weights = shared.state_dict()
    state = {}
    for name in unshared.state_dict():
        index = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        state[name] = weights[name if index is None else name.replace(f"layers.{index}.", f"layers.{index % 2}.", 1)]
    unshared.load_state_dict(state)
    ids = torch.randint(0, 512, (2, 8))
    torch.testing.assert_close(shared(ids).logits, unshared(ids).logits, rtol=0, atol=0)


# the authors' profile names give each configuration's parameter count (the paper's model sizes); built from
# profiles.py with an 8000-token vocabulary, five of the six land on their name
NAMED_PARAMETERS = {"moeut-44m": 44e6, "moeut-126m": 126e6, "moeut-244m": 244e6, "moeut-318m": 318e6,
                    "moeut-727m": 727e6, "moeut-1b": 1.04e9}


@pytest.mark.parametrize("preset", sorted(NAMED_PARAMETERS))
def test_moeut_preset_parameter_counts_match_their_names(preset):
    with torch.device("meta"):
        model = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset))
    count = sum(p.numel() for p in model.parameters())  # shared blocks counted once
    assert abs(count - NAMED_PARAMETERS[preset]) / NAMED_PARAMETERS[preset] < 0.01, count


def test_the_727m_profile_builds_582m_parameters_and_the_preset_follows_the_paper_run():
    """profiles.py's MoEUT_727M (d_model 1024, 36 layers, G=4, 5 heads, 467 MLP / 13 attention experts) has 582M
    parameters with an 8000-token vocabulary, not 727M; the paper's 727M run has d_model 1280, which the preset
    follows (the 727M row above), and converting the profile uses the profile as written."""
    from switchhead.conversion import moeut_format
    with torch.device("meta"):
        model = SwitchHeadForCausalLM(moeut_format.profile_config("MoEUT_727M"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 582


def test_a_saved_moeut_folder_passes_the_load_checks_and_counts_distinct_blocks(tmp_path):
    from switchhead.integrity.loading import check_saved_model, parameter_count
    model = _model()
    model.save_pretrained(tmp_path)
    check_saved_model(str(tmp_path))  # the saved blocks (G of them) belong to this config.json
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters())


def test_the_vllm_plugin_refuses_shared_layers_in_one_sentence():
    from switchhead.vllm.support import check_supported
    with pytest.raises(ValueError, match="shared layers and peri-LayerNorm .* serve this model with `switchhead serve`"):
        check_supported(SwitchHeadConfig.from_preset("tiny-moeut"))


# ------------------------------------------------------------------------------------- the authors' module's names
def _authors_state(args, seed=0):
    """Random tensors under the names and shapes of the authors' `MoEUTLM(**args).state_dict()` (their module)."""
    g = torch.Generator().manual_seed(seed)
    d, heads, dh = args["d_model"], args["n_heads"], args["d_head"]
    he, experts, size = heads * args["att_n_experts"], args["ff_n_experts"], args.get("ff_expert_size", 128)
    shapes = {"embedding.weight": (args["n_tokens"], d), "out_norm.weight": (d,), "out_norm.bias": (d,),
              "lm_head.weight": (args["n_tokens"], d), "lm_head.bias": (args["n_tokens"],)}
    for m in range(args["group_size"]):
        p = f"transformer.layers.{m}."
        shapes.update({p + "attention.q.weight": (heads * dh, d), p + "attention.k.weight": (heads * dh, d),
                       p + "attention.v": (he, d, dh), p + "attention.o": (he, dh, d), p + "attention.sel_v": (he, d),
                       p + "attention.sel_o": (he, d), p + "ffn.keys": (experts, d, size),
                       p + "ffn.values": (experts, size, d), p + "ffn.expert_sel": (experts, d),
                       p + "ln1.weight": (d,), p + "ln1.bias": (d,), p + "ln2.weight": (d,), p + "ln2.bias": (d,)})
    return {name: torch.randn(shape, generator=g) / math.sqrt(shape[-1] if len(shape) < 3 else shape[-2])
            for name, shape in shapes.items()}


AUTHORS_ARGS = dict(n_tokens=97, d_model=32, n_layers=6, n_heads=2, ff_n_experts=6, att_n_experts=3, d_head=8,
                    group_size=3, ff_k=2, att_k=2, ff_expert_size=16)


def test_the_authors_state_dict_loads_strictly_runs_as_the_reference_and_goes_back_bit_exactly():
    from switchhead.conversion.moeut_format import config_from_moeut_args, state_dict_from_moeut, state_dict_to_moeut
    config = config_from_moeut_args(**AUTHORS_ARGS)
    assert (config.layer_group_size, config.num_layer_groups, config.entropy_reg_coef) == (3, 2, 0.01)
    theirs = _authors_state(AUTHORS_ARGS)
    model = SwitchHeadForCausalLM(config).eval()
    model.load_state_dict(state_dict_from_moeut(theirs, config), strict=True)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(model(ids).logits, _reference(model, ids)[0], **TOL)
    back = state_dict_to_moeut(model.state_dict(), config)
    assert back.keys() == theirs.keys() and all(torch.equal(back[name], theirs[name]) for name in theirs)


def test_the_authors_profiles_give_the_presets_and_unconvertible_variants_are_refused():
    from switchhead.conversion.moeut_format import config_from_moeut_args, state_dict_from_moeut
    profile_44m = dict(d_model=412, n_layers=16, n_heads=4, ff_n_experts=155, att_n_experts=8, d_head=82, ff_k=12,
                       group_size=2)  # profiles.py's MoEUT_44M
    converted = config_from_moeut_args(8000, **profile_44m, max_position_embeddings=1024).to_dict()
    preset = SwitchHeadConfig.from_preset("moeut-44m").to_dict()
    assert {k: v for k, v in converted.items() if k != "transformers_version"} == \
        {k: v for k, v in preset.items() if k != "transformers_version"}
    with pytest.raises(ValueError, match="att_n_experts=1: the authors' one-expert attention"):
        config_from_moeut_args(**{**AUTHORS_ARGS, "att_n_experts": 1})
    with pytest.raises(ValueError, match="missing .*transformer.layers.2.ffn.keys"):
        state = _authors_state(AUTHORS_ARGS)
        del state["transformer.layers.2.ffn.keys"]
        state_dict_from_moeut(state, config_from_moeut_args(**AUTHORS_ARGS))


# ------------------------------------------------------------------------------------------------ switchhead flops
def test_flops_counts_every_application_and_says_the_blocks_are_shared(capsys):
    from switchhead.cli import main
    from switchhead.evaluation.accounting import attention_macs, mlp_macs, model_forward_macs
    config = SwitchHeadConfig.from_preset("moeut-44m")
    macs = model_forward_macs(config, 1024)
    per_application = attention_macs(config, 1024) + mlp_macs(config, 1024)
    assert macs["total"] == 16 * per_application + 1024 * 412 * 8000  # 16 applications of the 2 blocks
    assert main(["flops", "moeut-44m"]) == 0
    text = capsys.readouterr().out
    assert "shared layers (MoEUT): 2 distinct blocks applied 8 times = 16 layer applications" in text
    assert "KV cache: 41,984 bytes per token" in text  # 16 applications x K,V x 4 heads x 82 x 4 bytes


# ----------------------------------------------------------------------------------------- static cache, PEFT
def test_a_static_cache_has_one_slot_per_application():
    """Static-cache decoding of MoEUT is held to the full forward in tests/model/test_static_cache.py ("moeut")."""
    from transformers import StaticCache
    model = _model()
    assert len(StaticCache(config=model.config, max_cache_len=8).layers) == model.config.num_hidden_layers


def test_peft_sees_each_shared_tensor_once():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(_model(), LoraConfig(r=2, target_modules=["q_proj", "k_proj"]))
    adapters = [name for name, _ in model.named_parameters() if "lora_A" in name]
    assert len(adapters) == 2 * model.config.layer_group_size  # q and k of each distinct block, not per application
    ids = torch.randint(0, 512, (1, 6))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for name, p in model.named_parameters() if "lora_" in name)


# ----------------------------------------------------------------------------- tied embeddings, tensor parallelism
def test_tied_embeddings_with_shared_blocks_save_one_tensor_each(tmp_path):
    from safetensors import safe_open
    model = _model(tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [name for name, _ in model.named_parameters()]  # each shared tensor once, the tied one once
    assert len(names) == len({id(p) for p in model.parameters()}) and "lm_head.weight" not in names
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved:
        keys = set(saved.keys())
    assert "lm_head.weight" not in keys and {int(k.split(".")[2]) for k in keys if ".layers." in k} == {0, 1}
    loaded = SwitchHeadForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 512, (1, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_tensor_parallel_training_with_the_attention_regulariser_is_refused(monkeypatch):
    """Tensor parallelism splits the attention routers by head (exact for inference: tests/model/test_tp.py), but
    the group regulariser over them averages all heads: a tensor-parallel model refuses to train with it (a forward
    pre-hook the load installs), and `switchhead train --tp-size` refuses before anything starts."""
    from switchhead.tensor_parallel import refuse_split_attention_regulariser, splits_attention_regulariser
    from switchhead.training.errors import TrainingError
    from switchhead.training.placement import check_sizes

    config = SwitchHeadConfig.from_preset("tiny-moeut")
    assert splits_attention_regulariser(config)
    assert not splits_attention_regulariser(SwitchHeadConfig.from_preset("tiny-moeut", attention_entropy_reg_coef=0.0))
    assert not splits_attention_regulariser(SwitchHeadConfig.from_preset("tiny-switchall"))
    model = _model()
    model.register_forward_pre_hook(refuse_split_attention_regulariser, with_kwargs=True)
    ids = torch.randint(0, 512, (1, 6))
    model(ids)  # inference runs
    with pytest.raises(RuntimeError, match="MoEUT's attention entropy regulariser .* averages over all heads"):
        model(ids, output_router_logits=True)
    model.train()
    with pytest.raises(RuntimeError, match="train with fsdp_size instead, or set attention_entropy_reg_coef=0"):
        model(ids, labels=ids)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainingError, match="--tp-size 2: tensor parallelism splits the attention routers by head"):
        check_sizes({"tp_size": 2}, config)
    check_sizes({"fsdp_size": 2}, config)  # sharding whole tensors keeps every head's router in one computation
