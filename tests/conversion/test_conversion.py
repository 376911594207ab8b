"""Checkpoint conversion: the authors' formats in, safetensors folders out, and back.

The synthetic authors' checkpoints below are built only from the documented key names and shapes of the
authors' training code (RobertCsordas/moe_attention), and `authors_reference_logits` recomputes the forward
pass from those tensors the way that code does (q/k scaled by dh^-1/4 each, interleaved sinusoids shifted into
relative positions, sigmoid top-k gates, pre-LN blocks), independently of our model and of the converter.
"""

from __future__ import annotations

import math
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main as cli_main
from switchhead.conversion import (
    ConversionError,
    convert_authors_checkpoint,
    convert_module_checkpoint,
    export_authors_checkpoint,
    export_module_checkpoint,
    load_hf_folder,
)

VOCAB, D, HEADS, DH, EXPERTS, K, LAYERS, D_FF, T = 50, 32, 2, 12, 3, 2, 2, 48, 9
MLP_EXPERTS, MLP_SIZE, MLP_K = 6, 8, 2


# ================================================================================== synthetic authors' checkpoints
def authors_args(kind: str) -> dict:
    """The flat run arguments of a tiny run: 'xl' / 'rope' SwitchHead, or 'switchall' (XL + sigma-MoE MLP)."""
    args = {
        "state_size": D, "transformer.n_heads": HEADS, "transformer.encoder_n_layers": LAYERS,
        "transformer.head_projection_size": str(DH),  # the training code stores int-or-none args as strings
        "transformer.variant": "preln_moe" if kind == "switchall" else "preln_moeatt",
        "transformer.ff_multiplier": D_FF / D, "transformer.activation": "relu", "dropout": 0.1,
        "moe.att.enable": 1, "moe.att.variant": "full_rope" if kind == "rope" else "full",
        "moe.att.n_experts": EXPERTS, "moe.att.k": K, "moe.att.q_expert": 0, "moe.att.k_expert": 0,
        "moe.att.v_expert": 1, "moe.att.o_expert": 1, "moe.att.drop_expert": "none", "moe.drop_expert": 0.0,
        "rope.rotate_fraction": 0.5, "rope.base": 10000.0, "lm.unroll": 16, "lm.trafo.context_blocks": 1,
        "embedding_size": "none", "tied_embedding": 0, "task": "wikitext103_sp_transformer", "lr": 0.00025,
    }
    if kind == "switchall":
        args.update({"moe.n_experts": MLP_EXPERTS, "moe.expert_size": MLP_SIZE, "pkm.n_heads": MLP_K,
                     "moe.perplexity_reg": 0.001, "moe.reg_type": "entropy", "moe.selection_mode": "sigmoid"})
    return args


def authors_model_state(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the training code's key names, with its shapes."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    state = {"embedding.weight": rand(VOCAB, D), "out_norm.weight": rand(D, std=0.1, mean=1.0),
             "out_norm.bias": rand(D, std=0.1), "output.weight": rand(VOCAB, D, std=D ** -0.5),
             "output.bias": rand(VOCAB, std=0.1)}
    for i in range(LAYERS):
        p = f"unique_layers.{i}."
        state.update({
            p + "norm1.weight": rand(D, std=0.1, mean=1.0), p + "norm1.bias": rand(D, std=0.1),
            p + "norm2.weight": rand(D, std=0.1, mean=1.0), p + "norm2.bias": rand(D, std=0.1),
            p + "self_attn.projections.q": rand(HEADS * DH, D, std=D ** -0.5),
            p + "self_attn.projections.k": rand(HEADS * DH, D, std=D ** -0.5),
            p + "self_attn.projections.v": rand(HEADS * EXPERTS, D, DH, std=D ** -0.5),
            p + "self_attn.projections.o": rand(HEADS * EXPERTS, DH, D, std=(HEADS * DH) ** -0.5),
            p + "self_attn.selections.v": rand(HEADS * EXPERTS, D, std=D ** -0.5),
            p + "self_attn.selections.o": rand(HEADS * EXPERTS, D, std=D ** -0.5),
        })
        if kind != "rope":
            state[p + "self_attn.pos_to_pk"] = rand(HEADS * DH, D, std=D ** -0.5)
        if kind == "switchall":
            state.update({p + "pkm.keys": rand(MLP_EXPERTS, D, MLP_SIZE, std=D ** -0.5),
                          p + "pkm.values": rand(MLP_EXPERTS, MLP_SIZE, D, std=(MLP_EXPERTS * MLP_SIZE) ** -0.5),
                          p + "pkm.expert_sel": rand(MLP_EXPERTS, D, std=D ** -0.5),
                          p + "pkm.kv_sel_counts_100": torch.randint(0, 9, (MLP_EXPERTS, MLP_SIZE)).float()})
        else:
            state.update({p + "linear1.weight": rand(D_FF, D, std=D ** -0.5), p + "linear1.bias": rand(D_FF, std=0.1),
                          p + "linear2.weight": rand(D, D_FF, std=D_FF ** -0.5), p + "linear2.bias": rand(D, std=0.1)})
    return state


def authors_checkpoint_file(tmp_path, kind: str, state=None, args=None, name="model-1000.pth") -> str:
    path = str(tmp_path / name)
    torch.save({"model": state if state is not None else authors_model_state(kind),
                "run_invariants": {"args": args if args is not None else authors_args(kind), "wandb_id": None},
                "state": {"iter": 1000}}, path)
    return path


# ================================================================================== independent reference forward
def _sinusoids(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """The authors' encoding: interleaved channels, sin(p * w_c) at 2c and cos(p * w_c) at 2c + 1."""
    w = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    out = torch.zeros(len(positions), dim, dtype=torch.float64)
    out[:, 0::2] = torch.sin(positions[:, None].double() * w)
    out[:, 1::2] = torch.cos(positions[:, None].double() * w)
    return out


def _relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """[..., n, 2n-1] scores against positions -(n-1)..(n-1) -> [..., n, n] where entry (i, j) is position j - i.

    Done as the training code does it: flatten the rows, drop the first element, re-cut the rows one shorter and
    keep the last n columns, so each row slides one step left of the row above.
    """
    n = scores.shape[-2]
    flat = scores.flatten(-2).narrow(-1, 1, n * (2 * n - 2))
    return flat.view(*scores.shape[:-2], n, 2 * n - 2)[..., n - 2:]


def _rope(x: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """NeoX rotate-half RoPE on the first n_rot channels of x [B, H, T, dh] at positions 0..T-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, n_rot, 2).double() / n_rot))
    angles = torch.arange(x.shape[-2]).double()[:, None] * inv_freq[None]
    angles = torch.cat((angles, angles), -1)
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    half = torch.cat((-rot[..., n_rot // 2:], rot[..., : n_rot // 2]), -1)
    return torch.cat((rot * angles.cos() + half * angles.sin(), rest), -1)


def _top_k_gates(x: torch.Tensor, selection: torch.Tensor, groups: int, k: int, cast_float: bool):
    """(gates, expert index) [B, T, groups, k]: sigmoid of the top-k selection logits of each group."""
    logits = x @ selection.T
    if cast_float:  # the attention selections are computed in float32 by the authors' code
        logits = logits.float()
    logits = logits.view(*x.shape[:-1], groups, -1)
    index = logits.topk(k, dim=-1).indices
    return logits.gather(-1, index).sigmoid().double(), index


def authors_reference_logits(state: dict, kind: str, tokens: torch.Tensor) -> torch.Tensor:
    s = {key: t.double() for key, t in state.items()}
    batch, length = tokens.shape
    x = s["embedding.weight"][tokens]  # pre-LN models use no embedding scale
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    scale = DH ** -0.25  # the authors scale q and k by sqrt(1/sqrt(dh)) each
    for i in range(LAYERS):
        p = f"unique_layers.{i}."
        h = F.layer_norm(x, (D,), s[p + "norm1.weight"], s[p + "norm1.bias"], 1e-5)
        heads = lambda t: t.view(batch, length, HEADS, DH).transpose(1, 2)  # noqa: E731
        q = heads(h @ s[p + "self_attn.projections.q"].T * scale)
        k = heads(h @ s[p + "self_attn.projections.k"].T * scale)
        v_gate, v_index = _top_k_gates(h, s[p + "self_attn.selections.v"], HEADS, K, cast_float=True)
        o_gate, o_index = _top_k_gates(h, s[p + "self_attn.selections.o"], HEADS, K, cast_float=True)
        v = torch.zeros(batch, length, HEADS, DH, dtype=torch.float64)
        for head in range(HEADS):
            for slot in range(K):
                w = s[p + "self_attn.projections.v"][head * EXPERTS + v_index[:, :, head, slot]]  # [B, T, d, dh]
                v[:, :, head] += v_gate[:, :, head, slot, None] * torch.einsum("btd,btde->bte", h, w)
        v = v.transpose(1, 2)
        if kind == "rope":
            n_rot = int(0.5 * DH)
            q, k = _rope(q, n_rot, 10000.0), _rope(k, n_rot, 10000.0)
            scores = q @ k.transpose(-1, -2)
        else:
            encoding = _sinusoids(torch.arange(-(length - 1), length), D) * scale
            k_pos = (encoding @ s[p + "self_attn.pos_to_pk"].T).view(2 * length - 1, HEADS, DH).transpose(0, 1)
            scores = _relative_shift(q @ k_pos.transpose(-1, -2)) + q @ k.transpose(-1, -2)
        attended = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v  # [B, H, T, dh]
        out = torch.zeros(batch, length, D, dtype=torch.float64)
        for head in range(HEADS):
            for slot in range(K):
                w = s[p + "self_attn.projections.o"][head * EXPERTS + o_index[:, :, head, slot]]  # [B, T, dh, d]
                out += o_gate[:, :, head, slot, None] * torch.einsum("bte,bted->btd", attended[:, head], w)
        x = x + out
        h = F.layer_norm(x, (D,), s[p + "norm2.weight"], s[p + "norm2.bias"], 1e-5)
        if kind == "switchall":
            gate, index = _top_k_gates(h, s[p + "pkm.expert_sel"], 1, MLP_K, cast_float=False)
            mlp = torch.zeros_like(x)
            for slot in range(MLP_K):
                e = index[:, :, 0, slot]
                inner = torch.relu(torch.einsum("btd,btds->bts", h, s[p + "pkm.keys"][e]))
                mlp += gate[:, :, 0, slot, None] * torch.einsum("bts,btsd->btd", inner, s[p + "pkm.values"][e])
        else:
            mlp = F.linear(torch.relu(F.linear(h, s[p + "linear1.weight"], s[p + "linear1.bias"])),
                           s[p + "linear2.weight"], s[p + "linear2.bias"])
        x = x + mlp
    x = F.layer_norm(x, (D,), s["out_norm.weight"], s["out_norm.bias"], 1e-5)
    return x @ s["output.weight"].T + s["output.bias"]


# ================================================================================== must-show 1
@pytest.mark.parametrize("kind", ["xl", "rope", "switchall"])
def test_converted_authors_checkpoint_matches_reference_forward_in_fp64(tmp_path, kind):
    state = authors_model_state(kind)
    folder = str(tmp_path / "hf")
    config = convert_authors_checkpoint(authors_checkpoint_file(tmp_path, kind, state), folder)
    assert (config.position_encoding, config.mlp_type) == {
        "xl": ("xl", "dense"), "rope": ("rope", "dense"), "switchall": ("xl", "sigma_moe")}[kind]
    assert (config.hidden_size, config.num_attention_heads, config.head_dim, config.num_attention_experts,
            config.num_attention_experts_per_tok, config.num_hidden_layers) == (D, HEADS, DH, EXPERTS, K, LAYERS)
    model = SwitchHeadForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens).logits
    reference = authors_reference_logits(state, kind, tokens)
    assert ours.dtype == torch.float64
    assert reference.std() > 0.1  # a real signal, not a degenerate all-equal output
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)


def test_old_key_names_and_statistics_buffers_convert_to_the_same_model(tmp_path):
    state = authors_model_state("switchall")
    old = {}
    renames = {"projections.q": "data_to_q.weight", "projections.k": "data_to_k", "projections.v": "data_to_v",
               "projections.o": "out_proj", "selections.v": "sel_src", "selections.o": "sel_dst"}
    for key, tensor in state.items():
        for new, legacy in renames.items():
            key = key.replace(f"self_attn.{new}", f"self_attn.{legacy}")
        old[key] = tensor
    old["unique_layers.0.pkm.kv_sel_counts"] = torch.zeros(MLP_EXPERTS, MLP_SIZE)
    convert_authors_checkpoint(authors_checkpoint_file(tmp_path, "switchall", state, name="new.pth"),
                               str(tmp_path / "new"))
    convert_authors_checkpoint(authors_checkpoint_file(tmp_path, "switchall", old, name="old.pth"),
                               str(tmp_path / "old"))
    _, new_tensors = load_hf_folder(str(tmp_path / "new"))
    _, old_tensors = load_hf_folder(str(tmp_path / "old"))
    assert new_tensors.keys() == old_tensors.keys()
    assert all(torch.equal(new_tensors[k], old_tensors[k]) for k in new_tensors)


def test_real_checkpoint_dotdict_state_loads_without_pickle(tmp_path):
    """The authors' checkpoints store a framework DotDict under 'state'; it must load with weights_only=True."""
    module = types.ModuleType("framework.data_structures.dotdict")

    class DotDict(dict):
        pass

    DotDict.__module__, DotDict.__qualname__ = module.__name__, "DotDict"
    module.DotDict = DotDict
    names = ["framework", "framework.data_structures", "framework.data_structures.dotdict"]
    for name in names:
        sys.modules[name] = module if name == module.__name__ else types.ModuleType(name)
    try:
        path = str(tmp_path / "real.pth")
        torch.save({"model": authors_model_state("xl"), "state": DotDict(iter=5),
                    "run_invariants": {"args": authors_args("xl"), "wandb_id": None}}, path)
    finally:
        for name in names:
            del sys.modules[name]
    convert_authors_checkpoint(path, str(tmp_path / "hf"))
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")


# ================================================================================== must-show 2
def _random_model(preset: str, seed: int = 0) -> SwitchHeadForCausalLM:
    torch.manual_seed(seed)
    config = SwitchHeadConfig.from_preset(preset, pad_token_id=0, eos_token_id=2, xl_memory_length=0)
    model = SwitchHeadForCausalLM(config)
    with torch.no_grad():  # LayerNorms and biases start at 1 / 0: randomise them so that every tensor is checked
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@pytest.mark.parametrize("preset", ["tiny-switchhead-xl", "tiny-switchhead", "tiny-switchall"])
def test_round_trip_ours_authors_ours_is_bit_exact(tmp_path, preset):
    _random_model(preset).save_pretrained(tmp_path / "ours")
    export_authors_checkpoint(str(tmp_path / "ours"), str(tmp_path / "authors.pth"))
    exported = torch.load(tmp_path / "authors.pth", weights_only=True)  # our export is safe to load
    assert "unique_layers.0.self_attn.projections.v" in exported["model"]
    assert exported["run_invariants"]["args"]["moe.att.q_expert"] is False
    convert_authors_checkpoint(str(tmp_path / "authors.pth"), str(tmp_path / "back"))
    config_a, tensors_a = load_hf_folder(str(tmp_path / "ours"))
    config_b, tensors_b = load_hf_folder(str(tmp_path / "back"))
    assert tensors_a.keys() == tensors_b.keys()
    for key in tensors_a:
        assert tensors_a[key].dtype == tensors_b[key].dtype and torch.equal(tensors_a[key], tensors_b[key]), key
    assert config_a.to_diff_dict() == config_b.to_diff_dict()


def test_module_layout_round_trip_is_bit_exact_and_uses_module_names(tmp_path):
    _random_model("tiny-switchhead-xl").save_pretrained(tmp_path / "ours")
    prefix = "blocks.{i}.attn.core."
    renames = {"tok.": "model.embed_tokens.", "final_ln.": "model.norm.", "head.": "lm_head.",
               "blocks.{i}.ln1.": "model.layers.{i}.input_layernorm.",
               "blocks.{i}.ln2.": "model.layers.{i}.post_attention_layernorm.",
               "blocks.{i}.ff.": "model.layers.{i}.mlp."}
    export_module_checkpoint(str(tmp_path / "ours"), str(tmp_path / "user.safetensors"), prefix, renames)
    from safetensors.torch import load_file

    user = load_file(str(tmp_path / "user.safetensors"))
    assert {"blocks.1.attn.core.v", "blocks.1.attn.core.sel_o", "blocks.1.attn.core.pos_to_pk",
            "blocks.0.attn.core.q.weight", "tok.weight", "blocks.0.ff.up_proj.bias"} <= user.keys()
    config, _ = load_hf_folder(str(tmp_path / "ours"))
    convert_module_checkpoint(str(tmp_path / "user.safetensors"), str(tmp_path / "back"), config, prefix, renames)
    _, tensors_a = load_hf_folder(str(tmp_path / "ours"))
    _, tensors_b = load_hf_folder(str(tmp_path / "back"))
    assert tensors_a.keys() == tensors_b.keys() and all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)


def test_sharded_output_with_dtype_conversion_loads_back(tmp_path):
    path = authors_checkpoint_file(tmp_path, "switchall")
    assert cli_main(["convert", "authors-to-hf", path, str(tmp_path / "hf"), "--dtype", "bfloat16",
                     "--max-shard-size", "20KB"]) == 0
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors")]) > 1
    _, tensors = load_hf_folder(str(tmp_path / "hf"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    expected = authors_model_state("switchall")["unique_layers.1.pkm.keys"].to(torch.bfloat16)
    assert torch.equal(tensors["model.layers.1.mlp.experts.expert_keys"], expected)
    model = SwitchHeadForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.model.layers[1].mlp.experts.expert_keys.dtype == torch.bfloat16


def test_folders_under_either_sigma_moe_name_export_the_same(tmp_path):
    """`save_pretrained` writes the sigma-MoE tensors as `mlp.keys` / `mlp.values` (their checkpoint names in every
    release); with `save_original_format=False`, as `mlp.experts.expert_keys` / `mlp.experts.expert_values` (the
    parameters' names).
    Both folders read under the parameters' names and export the same authors' checkpoint."""
    from safetensors.torch import load_file

    model = _random_model("tiny-switchall")
    model.save_pretrained(tmp_path / "checkpoint_names")
    model.save_pretrained(tmp_path / "parameter_names", save_original_format=False)
    assert "model.layers.0.mlp.keys" in load_file(str(tmp_path / "checkpoint_names" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.expert_keys" in load_file(str(tmp_path / "parameter_names" /
                                                                      "model.safetensors"))
    read = {name: load_hf_folder(str(tmp_path / name))[1] for name in ("checkpoint_names", "parameter_names")}
    assert read["checkpoint_names"].keys() == read["parameter_names"].keys() == model.state_dict().keys()
    for name in read:
        export_authors_checkpoint(str(tmp_path / name), str(tmp_path / f"{name}.pth"))
    first, second = (torch.load(tmp_path / f"{name}.pth", weights_only=True)["model"] for name in read)
    assert first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)
    assert torch.equal(first["unique_layers.1.pkm.values"], model.model.layers[1].mlp.experts.expert_values.detach())


# ================================================================================== must-show 3
class _Payload:
    """An arbitrary Python object: a weights_only load must refuse to construct it."""

    def __init__(self):
        self.note = "arbitrary object"


def _bad_checkpoints(tmp_path):
    state = authors_model_state("xl")
    unknown = dict(state, **{"unique_layers.0.self_attn.mystery": torch.zeros(3)})
    missing = {k: v for k, v in state.items() if k != "unique_layers.1.self_attn.selections.o"}
    mismatched = dict(state, **{"unique_layers.0.self_attn.projections.v": torch.zeros(HEADS * EXPERTS, D, DH + 1)})
    pickled = str(tmp_path / "pickled.pth")
    torch.save({"model": state, "run_invariants": {"args": authors_args("xl")}, "extra": _Payload()}, pickled)
    return {
        "unknown": (authors_checkpoint_file(tmp_path, "xl", unknown, name="unknown.pth"),
                    ["unknown keys", "unique_layers.0.self_attn.mystery"]),
        "missing": (authors_checkpoint_file(tmp_path, "xl", missing, name="missing.pth"),
                    ["missing keys", "unique_layers.1.self_attn.selections.o"]),
        "shape": (authors_checkpoint_file(tmp_path, "xl", mismatched, name="shape.pth"),
                  ["unique_layers.0.self_attn.projections.v", "shape [6, 32, 13]", "[6, 32, 12]"]),
        "pickle": (pickled, ["weights_only", "--allow-pickle"]),
    }


@pytest.mark.parametrize("problem", ["unknown", "missing", "shape", "pickle"])
def test_bad_checkpoint_gives_clear_error_and_writes_nothing(tmp_path, capsys, problem):
    path, words = _bad_checkpoints(tmp_path)[problem]
    before = sorted(os.listdir(tmp_path))
    output = tmp_path / "out"
    with pytest.raises(ConversionError) as error:
        convert_authors_checkpoint(path, str(output))
    assert all(word in str(error.value) for word in words), str(error.value)
    # the command line: exit 2, one line naming the problem, and still nothing written
    assert cli_main(["convert", "authors-to-hf", path, str(output)]) == 2
    stderr = capsys.readouterr().err.strip()
    assert len(stderr.splitlines()) == 1 and all(word in stderr for word in words), stderr
    assert sorted(os.listdir(tmp_path)) == before  # no output folder and no leftover staging folder


def test_allow_pickle_is_required_and_sufficient_for_pickled_files(tmp_path):
    path, _ = _bad_checkpoints(tmp_path)["pickle"]
    with pytest.warns(UserWarning, match="allow-pickle"):
        convert_authors_checkpoint(path, str(tmp_path / "hf"), allow_pickle=True)
    assert os.path.isfile(tmp_path / "hf" / "config.json")


def test_unsupported_architecture_and_existing_output_are_refused(tmp_path):
    args = dict(authors_args("xl"), **{"moe.att.q_expert": 1})
    path = authors_checkpoint_file(tmp_path, "xl", args=args)
    with pytest.raises(ConversionError, match=r"moe\.att\.q_expert=True"):
        convert_authors_checkpoint(path, str(tmp_path / "hf"))
    dense = dict(authors_args("xl"), **{"transformer.variant": "preln_relative"})
    with pytest.raises(ConversionError, match="preln_relative"):
        convert_authors_checkpoint(authors_checkpoint_file(tmp_path, "xl", args=dense, name="d.pth"),
                                   str(tmp_path / "hf"))
    good = authors_checkpoint_file(tmp_path, "xl", name="good.pth")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        convert_authors_checkpoint(good, str(tmp_path / "taken"))
    assert os.listdir(tmp_path / "taken") == ["keep.txt"]


def test_module_state_dict_errors_name_the_key(tmp_path):
    _random_model("tiny-switchhead").save_pretrained(tmp_path / "ours")
    prefix = "layers.{i}.attn."
    renames = {"emb.": "model.embed_tokens.", "norm.": "model.norm.", "out.": "lm_head.",
               "layers.{i}.n1.": "model.layers.{i}.input_layernorm.",
               "layers.{i}.n2.": "model.layers.{i}.post_attention_layernorm.",
               "layers.{i}.mlp.": "model.layers.{i}.mlp."}
    export_module_checkpoint(str(tmp_path / "ours"), str(tmp_path / "user.pt"), prefix, renames)
    config, _ = load_hf_folder(str(tmp_path / "ours"))
    user = torch.load(tmp_path / "user.pt", weights_only=True)
    user["layers.0.attn.sel_q"] = torch.zeros(1)
    torch.save(user, tmp_path / "bad.pt")
    with pytest.raises(ConversionError, match=r"unknown key layers\.0\.attn\.sel_q"):
        convert_module_checkpoint(str(tmp_path / "bad.pt"), str(tmp_path / "hf"), config, prefix, renames)
    del user["layers.0.attn.sel_q"], user["emb.weight"]
    torch.save(user, tmp_path / "bad.pt")
    with pytest.raises(ConversionError, match=r"missing keys: model\.embed_tokens\.weight"):
        convert_module_checkpoint(str(tmp_path / "bad.pt"), str(tmp_path / "hf"), config, prefix, renames)
    assert not os.path.exists(tmp_path / "hf")


def test_cli_module_directions_round_trip(tmp_path):
    _random_model("tiny-switchall").save_pretrained(tmp_path / "ours")
    layout = ["--layer-prefix", "h.{i}.sh.", "--map", "wte.=model.embed_tokens.", "--map", "ln_f.=model.norm.",
              "--map", "head.=lm_head.", "--map", "h.{i}.=model.layers.{i}."]
    assert cli_main(["convert", "hf-to-module", str(tmp_path / "ours"), str(tmp_path / "user.pt"), *layout]) == 0
    assert "h.1.sh.sel_v" in torch.load(tmp_path / "user.pt", weights_only=True)
    config_path = str(tmp_path / "ours" / "config.json")
    assert cli_main(["convert", "module-to-hf", str(tmp_path / "user.pt"), str(tmp_path / "back"),
                     "--config", config_path, *layout]) == 0
    _, tensors_a = load_hf_folder(str(tmp_path / "ours"))
    _, tensors_b = load_hf_folder(str(tmp_path / "back"))
    assert tensors_a.keys() == tensors_b.keys() and all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)
    assert cli_main(["convert", "module-to-hf", str(tmp_path / "user.pt"), str(tmp_path / "other"),
                     "--preset", "tiny-switchhead", *layout]) == 2  # wrong architecture: shapes/keys do not fit
    assert not os.path.exists(tmp_path / "other")


def test_xl_conversion_refuses_a_model_whose_sinusoid_layout_differs(tmp_path, monkeypatch):
    """pos_to_pk is copied as is, which is only right while our encoding interleaves sin/cos like the authors'."""
    import switchhead.positions as positions

    original = positions.sinusoidal_embedding

    def sines_then_cosines(positions, dim, *args, **kwargs):
        encoding = original(positions, dim, *args, **kwargs)
        return torch.cat((encoding[:, 0::2], encoding[:, 1::2]), dim=-1)

    monkeypatch.setattr(positions, "sinusoidal_embedding", sines_then_cosines)
    with pytest.raises(ConversionError, match="sinusoidal encoding differs"):
        convert_authors_checkpoint(authors_checkpoint_file(tmp_path, "xl"), str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


# ================================================================================== the one-expert module
def one_expert_config(position: str) -> SwitchHeadConfig:
    return SwitchHeadConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            head_dim=DH, attention_type="dense", attention_output_gate=True,
                            position_encoding=position, partial_rotary_factor=0.5, intermediate_size=D_FF,
                            layer_norm_eps=1e-5, mlp_bias=True, lm_head_bias=True, tie_word_embeddings=False,
                            xl_memory_length=0)


def one_expert_module_state(position: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A user's model around the authors' module with n_experts=1: `v` [H*dh, d], `o` [d, H*dh], `sel_o` [H, d]."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.3, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean
    state = {"emb.weight": rand(VOCAB, D, std=1.0), "final.weight": rand(D, mean=1.0, std=0.1),
             "final.bias": rand(D, std=0.1), "head.weight": rand(VOCAB, D), "head.bias": rand(VOCAB, std=0.1)}
    for i in range(LAYERS):
        p = f"blocks.{i}."
        state.update({
            p + "attn.q.weight": rand(HEADS * DH, D), p + "attn.k.weight": rand(HEADS * DH, D),
            p + "attn.v": rand(HEADS * DH, D), p + "attn.o": rand(D, HEADS * DH), p + "attn.sel_o": rand(HEADS, D),
            p + "ln1.weight": rand(D, mean=1.0, std=0.1), p + "ln1.bias": rand(D, std=0.1),
            p + "ln2.weight": rand(D, mean=1.0, std=0.1), p + "ln2.bias": rand(D, std=0.1),
            p + "ff.up_proj.weight": rand(D_FF, D), p + "ff.up_proj.bias": rand(D_FF, std=0.1),
            p + "ff.down_proj.weight": rand(D, D_FF), p + "ff.down_proj.bias": rand(D, std=0.1),
        })
        if position == "xl":
            state[p + "attn.pos_to_pk"] = rand(HEADS * DH, D)
    return state


ONE_EXPERT_RENAMES = {"emb.": "model.embed_tokens.", "final.": "model.norm.", "head.": "lm_head.",
                      "blocks.{i}.ln1.": "model.layers.{i}.input_layernorm.",
                      "blocks.{i}.ln2.": "model.layers.{i}.post_attention_layernorm.",
                      "blocks.{i}.ff.": "model.layers.{i}.mlp."}


def one_expert_reference_logits(state: dict, position: str, tokens: torch.Tensor) -> torch.Tensor:
    """The module's own arithmetic with one expert: q, k scaled by dh^-1/4 each, v = x v^T split into heads, each
    head's result times sigmoid(x sel_o^T)[h], then the concatenated heads times o^T; pre-LN blocks."""
    s = {key: t.double() for key, t in state.items()}
    batch, length = tokens.shape
    x = s["emb.weight"][tokens]
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    scale = DH ** -0.25
    for i in range(LAYERS):
        p = f"blocks.{i}."
        h = F.layer_norm(x, (D,), s[p + "ln1.weight"], s[p + "ln1.bias"], 1e-5)
        heads = lambda t: t.view(batch, length, HEADS, DH).transpose(1, 2)  # noqa: E731
        q, k = heads(h @ s[p + "attn.q.weight"].T * scale), heads(h @ s[p + "attn.k.weight"].T * scale)
        v = heads(h @ s[p + "attn.v"].T)
        if position == "rope":
            q, k = _rope(q, DH // 2, 10000.0), _rope(k, DH // 2, 10000.0)
            scores = q @ k.transpose(-1, -2)
        else:
            encoding = _sinusoids(torch.arange(-(length - 1), length), D) * scale
            k_pos = (encoding @ s[p + "attn.pos_to_pk"].T).view(2 * length - 1, HEADS, DH).transpose(0, 1)
            scores = _relative_shift(q @ k_pos.transpose(-1, -2)) + q @ k.transpose(-1, -2)
        attended = (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)  # [B, T, H, dh]
        gate = torch.sigmoid(h @ s[p + "attn.sel_o"].T)  # [B, T, H]
        x = x + (attended * gate[..., None]).flatten(2) @ s[p + "attn.o"].T
        h = F.layer_norm(x, (D,), s[p + "ln2.weight"], s[p + "ln2.bias"], 1e-5)
        x = x + F.linear(torch.relu(F.linear(h, s[p + "ff.up_proj.weight"], s[p + "ff.up_proj.bias"])),
                         s[p + "ff.down_proj.weight"], s[p + "ff.down_proj.bias"])
    x = F.layer_norm(x, (D,), s["final.weight"], s["final.bias"], 1e-5)
    return x @ s["head.weight"].T + s["head.bias"]


@pytest.mark.parametrize("position", ["rope", "xl"])
def test_one_expert_module_converts_both_ways_and_matches_its_own_forward(tmp_path, position):
    state = one_expert_module_state(position)
    torch.save(state, tmp_path / "user.pt")
    config = one_expert_config(position)
    convert_module_checkpoint(str(tmp_path / "user.pt"), str(tmp_path / "hf"), config, "blocks.{i}.attn.",
                              ONE_EXPERT_RENAMES)
    model = SwitchHeadForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64).eval()
    assert model.config.attention_type == "dense" and model.config.attention_output_gate
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(tokens).logits
    torch.testing.assert_close(ours, one_expert_reference_logits(state, position, tokens), atol=1e-9, rtol=0)

    export_module_checkpoint(str(tmp_path / "hf"), str(tmp_path / "back.pt"), "blocks.{i}.attn.", ONE_EXPERT_RENAMES)
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_one_expert_module_cli_and_errors(tmp_path, capsys):
    state = one_expert_module_state("rope")
    torch.save(state, tmp_path / "user.pt")
    one_expert_config("rope").save_pretrained(tmp_path / "described")
    layout = ["--layer-prefix", "blocks.{i}.attn."] + [arg for theirs, ours in ONE_EXPERT_RENAMES.items()
                                                       for arg in ("--map", f"{theirs}={ours}")]
    assert cli_main(["convert", "module-to-hf", str(tmp_path / "user.pt"), str(tmp_path / "hf"),
                     "--config", str(tmp_path / "described"), *layout]) == 0
    assert cli_main(["convert", "hf-to-module", str(tmp_path / "hf"), str(tmp_path / "back.pt"), *layout]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
    capsys.readouterr()
    # a SwitchHead module's sel_v has no place in the one-expert form
    torch.save({**state, "blocks.0.attn.sel_v": torch.zeros(HEADS, D)}, tmp_path / "bad.pt")
    assert cli_main(["convert", "module-to-hf", str(tmp_path / "bad.pt"), str(tmp_path / "bad"),
                     "--config", str(tmp_path / "described"), *layout]) == 2
    assert "unknown key blocks.0.attn.sel_v: a one-expert" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad")
    # a dense model without the output gate is not the module
    plain = one_expert_config("rope")
    plain.attention_output_gate = False
    with pytest.raises(ConversionError, match="attention_output_gate=True"):
        convert_module_checkpoint(str(tmp_path / "user.pt"), str(tmp_path / "plain"), plain, "blocks.{i}.attn.",
                                  ONE_EXPERT_RENAMES)
    assert not os.path.exists(tmp_path / "plain")
