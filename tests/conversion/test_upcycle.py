"""Upcycling dense models (ours and GPT-2 style) into SwitchHead models."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main as cli_main
from switchhead.conversion import ConversionError
from switchhead.conversion.upcycle import dense_from_gpt2, upcycle_state_dict

from helpers.models import logits_of


def _dense(preset: str = "tiny-dense", seed: int = 0, **overrides) -> SwitchHeadForCausalLM:
    torch.manual_seed(seed)
    config = SwitchHeadConfig.from_preset(preset, vocab_size=96, xl_memory_length=0, **overrides)
    model = SwitchHeadForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial LayerNorms and biases
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _build(result) -> SwitchHeadForCausalLM:
    model = SwitchHeadForCausalLM(result.config)
    model.load_state_dict(result.state_dict, strict=True)
    return model.eval()


IDS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("preset,gate", [("tiny-dense", False), ("tiny-dense-xl", False), ("tiny-dense", True)])
@pytest.mark.parametrize("expert_init", ["svd", "heads"])
@pytest.mark.parametrize("experts,k", [(4, 2), (3, 1)])
def test_keeping_every_head_reproduces_the_dense_model(preset, gate, expert_init, experts, k):
    dense = _dense(preset, attention_output_gate=gate)
    result = upcycle_state_dict(dense.config, dense.state_dict(), heads=4, experts=experts, k=k,
                                expert_init=expert_init, router_noise=0.0)
    model = _build(result)
    assert (model.config.attention_type, model.config.num_attention_heads, model.config.num_attention_experts,
            model.config.num_attention_experts_per_tok) == ("switchhead", 4, experts, k)
    torch.testing.assert_close(logits_of(model, IDS), logits_of(dense, IDS), atol=1e-5, rtol=0)
    # a little router noise (to tell experts apart in training) keeps the first forward close
    noisy = _build(upcycle_state_dict(dense.config, dense.state_dict(), 4, experts, k, expert_init, 0.01))
    assert (logits_of(noisy, IDS) - logits_of(dense, IDS)).abs().max() < 0.1
    assert not torch.equal(noisy.model.layers[0].self_attn.value_selection.weight,
                           torch.zeros_like(noisy.model.layers[0].self_attn.value_selection.weight))


def test_fewer_heads_keep_each_group_lead_qk_and_the_best_rank_dh_value_output_map():
    dense = _dense("tiny-dense-xl")
    state = dense.state_dict()
    result = upcycle_state_dict(dense.config, state, heads=2, experts=4, k=2, expert_init="svd", router_noise=0.0)
    dh, d = dense.config.head_dim, dense.config.hidden_size
    for i in range(dense.config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for name in ("q_proj.weight", "k_proj.weight", "position_key_proj.weight"):
            heads = state[p + name].view(4, dh, d)
            torch.testing.assert_close(result.state_dict[p + name], torch.cat((heads[0], heads[2])), atol=0, rtol=0)
        value = state[p + "v_proj.weight"].double().view(4, dh, d).transpose(1, 2)
        output = state[p + "o_proj.weight"].double().T.reshape(4, dh, d)
        for h, members in enumerate(([0, 1], [2, 3])):
            combined = sum(value[j] @ output[j] for j in members)
            singular = torch.linalg.svdvals(combined)
            for e in range(4):
                # each expert, unscaled (k gates of 1/2 on each side: 2/k = 1 here), is a rank-dh factorisation
                product = (result.state_dict[p + "value_experts"][h * 4 + e].double()
                           @ result.state_dict[p + "output_experts"][h * 4 + e].double())
                best_error = singular[dh:].pow(2).sum().sqrt()  # Eckart-Young: the smallest possible
                torch.testing.assert_close((combined - product).norm(), best_error, atol=1e-4, rtol=1e-4)
    # mapping each dense head to an expert instead: expert e of head h is dense head h*2 + e % 2
    heads_result = upcycle_state_dict(dense.config, state, 2, 4, 2, "heads", 0.0)
    v = heads_result.state_dict["model.layers.0.self_attn.value_experts"]
    dense_v = state["model.layers.0.self_attn.v_proj.weight"].view(4, dh, d).transpose(1, 2)
    torch.testing.assert_close(v[5] / v[5].norm() * dense_v[3].norm(), dense_v[3])


def test_upcycle_refuses_what_does_not_fit():
    dense = _dense()
    with pytest.raises(ConversionError, match="--heads must divide the dense model's 4 heads, got 3"):
        upcycle_state_dict(dense.config, dense.state_dict(), 3, 4, 2)
    with pytest.raises(ConversionError, match="1 <= --k <= --experts"):
        upcycle_state_dict(dense.config, dense.state_dict(), 2, 2, 3)
    switchhead = SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=96))
    with pytest.raises(ConversionError, match="must be a dense attention model"):
        upcycle_state_dict(switchhead.config, switchhead.state_dict(), 2, 4, 2)


def test_upcycle_cli_writes_a_loadable_folder_with_the_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    dense = _dense()
    dense.save_pretrained(tmp_path / "dense")
    vocab = {f"t{i}": i for i in range(96)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                            eos_token="t1").save_pretrained(tmp_path / "dense")
    assert cli_main(["upcycle", str(tmp_path / "dense"), str(tmp_path / "up"), "--heads", "2", "--experts", "4",
                     "--k", "2"]) == 0
    assert "first-forward max |logit difference|" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "up")
    assert (model.config.num_attention_heads, model.config.num_attention_experts) == (2, 4)
    assert os.path.isfile(tmp_path / "up" / "tokenizer.json")
    report = json.load(open(tmp_path / "up" / "upcycle.json"))
    assert report["expert_init"] == "svd" and report["first_forward_max_logit_difference"] > 0
    model.generate(IDS[:1, :4], max_new_tokens=3, do_sample=False)
    capsys.readouterr()

    assert cli_main(["upcycle", str(tmp_path / "dense"), str(tmp_path / "bad"), "--heads", "3", "--experts", "4",
                     "--k", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("switchhead upcycle: error: --heads must divide")
    assert not os.path.exists(tmp_path / "bad")
    assert cli_main(["upcycle", str(tmp_path / "dense"), str(tmp_path / "up"), "--heads", "2", "--experts", "4",
                     "--k", "2"]) == 2  # never overwrites
    assert "already exists" in capsys.readouterr().err


# ============================================================================================ GPT-2 style
def _tiny_gpt2(tmp_path, zero_positions_and_biases: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function="gelu",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "ln_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            if zero_positions_and_biases and ("wpe" in name or (".attn." in name and name.endswith("bias"))):
                parameter.zero_()
    model.save_pretrained(tmp_path / "gpt2")
    return model


def test_gpt2_weights_map_onto_our_dense_layout(tmp_path):
    gpt2 = _tiny_gpt2(tmp_path, zero_positions_and_biases=True)
    from safetensors.torch import load_file

    result = dense_from_gpt2(json.load(open(tmp_path / "gpt2" / "config.json")),
                             load_file(str(tmp_path / "gpt2" / "model.safetensors")))
    ours = _build(result)
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    assert "wpe.weight" in result.dropped and "h.0.attn.c_attn.bias" in result.dropped
    # one token: no position information and a single attended key, so with zero biases and no wpe both agree
    single = torch.arange(0, 96, 7)[:, None]
    with torch.no_grad():
        torch.testing.assert_close(ours(single).logits, gpt2(single).logits, atol=1e-5, rtol=0)


def test_gpt2_folder_upcycles_through_the_cli(tmp_path, capsys):
    _tiny_gpt2(tmp_path, zero_positions_and_biases=False)
    assert cli_main(["upcycle", str(tmp_path / "gpt2"), str(tmp_path / "up"), "--heads", "4", "--experts", "2",
                     "--k", "1", "--router-noise", "0"]) == 0
    out = capsys.readouterr().out
    assert "dropped" in out and "wpe.weight" in out and "continue training" in out
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "up")
    assert model.config.attention_type == "switchhead" and model.config.tie_word_embeddings
    model.generate(IDS[:1, :4], max_new_tokens=3, do_sample=False)
