"""`switchhead convert moeut-to-hf` / `hf-to-moeut`: the authors' MoEUT module (RobertCsordas/moeut, `MoEUTLM`).

The files here are built only from the names and shapes of `MoEUTLM(**args).state_dict()` (what `torch.save` of it
holds), and `authors_logits` recomputes that module's forward from those tensors, under their names, the way the
module computes it: token embedding; per application of the G shared blocks, LN1(x) feeds query, key and both
routers, q and k are each scaled by d_head^-1/4 and rotated on their first int(d_head / 2) channels (the two halves
of that slice against each other, frequencies base^(-2i / n_rot)), values come from the raw stream through the top-k
sigmoid-gated experts of each head, the output experts are mixed over heads and top-k; the sigma-MoE router reads
LN2(x), its experts x; logits = lm_head(out_norm(x)). Dense over all experts (cheap at this size), independent of our
model and of the converter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main as cli_main
from switchhead.conversion import ConversionError, convert_moeut_checkpoint, export_moeut_checkpoint
from switchhead.conversion import moeut_format

ARGS = dict(n_tokens=61, d_model=24, n_layers=6, n_heads=2, ff_n_experts=5, att_n_experts=3, d_head=8,
            group_size=3, ff_k=2, att_k=2, ff_expert_size=8)
# the constructor's defaults for the arguments ARGS leaves out (MoEUTLM's signature)
DEFAULTS = dict(ff_expert_dropout=0.0, att_expert_dropout=0.0, dropout=0.0, entropy_reg=0.01, att_entropy_reg=0.001)


def authors_state(args: dict, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random tensors under `MoEUTLM(**args).state_dict()`'s names and shapes (layer norms away from 1 and 0)."""
    g = torch.Generator().manual_seed(seed)
    d, heads, dh = args["d_model"], args["n_heads"], args["d_head"]
    slots, experts, size, vocab = heads * args["att_n_experts"], args["ff_n_experts"], args["ff_expert_size"], \
        args["n_tokens"]

    def rand(*shape, std=1.0, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).to(dtype)

    state = {"embedding.weight": rand(vocab, d), "out_norm.weight": rand(d, std=0.2, mean=1.0),
             "out_norm.bias": rand(d, std=0.2), "lm_head.weight": rand(vocab, d, std=d ** -0.5),
             "lm_head.bias": rand(vocab, std=0.2)}
    for m in range(args["group_size"]):
        p = f"transformer.layers.{m}."
        state.update({
            p + "attention.q.weight": rand(heads * dh, d, std=d ** -0.5),
            p + "attention.k.weight": rand(heads * dh, d, std=d ** -0.5),
            p + "attention.v": rand(slots, d, dh, std=d ** -0.5), p + "attention.o": rand(slots, dh, d, std=dh ** -0.5),
            p + "attention.sel_v": rand(slots, d, std=d ** -0.5), p + "attention.sel_o": rand(slots, d, std=d ** -0.5),
            p + "ffn.keys": rand(experts, d, size, std=d ** -0.5),
            p + "ffn.values": rand(experts, size, d, std=(experts * size) ** -0.5),
            p + "ffn.expert_sel": rand(experts, d, std=d ** -0.5),
            p + "ln1.weight": rand(d, std=0.2, mean=1.0), p + "ln1.bias": rand(d, std=0.2),
            p + "ln2.weight": rand(d, std=0.2, mean=1.0), p + "ln2.bias": rand(d, std=0.2)})
    return state


def authors_logits(state: dict[str, torch.Tensor], args: dict, ids: torch.Tensor) -> torch.Tensor:
    """The forward of the authors' `MoEUTLM(**args)` holding `state`, in fp32 (see the module docstring)."""
    s = {name: tensor.float() for name, tensor in state.items()}
    d, heads = args["d_model"], args["n_heads"]
    dh = args["d_head"] or d // heads
    experts, k, rot = args["att_n_experts"], args["att_k"], int(0.5 * dh)
    batch, length = ids.shape
    angles = torch.outer(torch.arange(length, dtype=torch.float32),
                         10000.0 ** (-torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    angles = torch.cat((angles, angles), -1)

    def rotate(t):  # [B, H, T, dh]: the first `rot` channels, halves against each other
        part, rest = t[..., :rot], t[..., rot:]
        swapped = torch.cat((-part[..., rot // 2:], part[..., :rot // 2]), -1)
        return torch.cat((part * angles.cos() + swapped * angles.sin(), rest), -1)

    def gates(logits, groups, n, top):  # sigmoid scores, the top ones kept per group: [..., groups, n]
        scores = logits.view(*logits.shape[:-1], groups, n).sigmoid()
        kept = scores.topk(top, -1).indices
        return torch.zeros_like(scores).scatter(-1, kept, scores.gather(-1, kept))

    def norm(t, name):
        return F.layer_norm(t, (d,), s[name + ".weight"], s[name + ".bias"])

    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    x = s["embedding.weight"][ids]
    for _ in range(args["n_layers"] // args["group_size"]):
        for m in range(args["group_size"]):
            p = f"transformer.layers.{m}."
            h = norm(x, p + "ln1")
            q, key = ((h @ s[p + f"attention.{w}.weight"].T) * dh ** -0.25 for w in "qk")
            q, key = (rotate(t.view(batch, length, heads, dh).transpose(1, 2)) for t in (q, key))
            value_gates = gates(h @ s[p + "attention.sel_v"].T, heads, experts, k)  # [B, T, H, E]
            values = torch.einsum("btd,hedc,bthe->bhtc", x, s[p + "attention.v"].view(heads, experts, d, dh),
                                  value_gates)
            weights = (q @ key.transpose(-1, -2)).masked_fill(future, float("-inf")).softmax(-1)
            output_gates = gates(h @ s[p + "attention.sel_o"].T, heads, experts, k)
            x = x + torch.einsum("bhtc,hecd,bthe->btd", weights @ values,
                                 s[p + "attention.o"].view(heads, experts, dh, d), output_gates)
            mlp_gates = gates(norm(x, p + "ln2") @ s[p + "ffn.expert_sel"].T, 1, args["ff_n_experts"],
                              args["ff_k"])[..., 0, :]
            hidden = torch.relu(torch.einsum("btd,eds->btes", x, s[p + "ffn.keys"]))
            x = x + torch.einsum("btes,esd,bte->btd", hidden, s[p + "ffn.values"], mlp_gates)
    return norm(x, "out_norm") @ s["lm_head.weight"].T + s["lm_head.bias"]


def _files(tmp_path, state=None, args=None, name="moeutlm.pt"):
    """The user's two files: `torch.save(model.state_dict())` and the constructor arguments as JSON."""
    torch.save(authors_state(ARGS) if state is None else state, tmp_path / name)
    (tmp_path / "args.json").write_text(json.dumps(ARGS if args is None else args))
    return str(tmp_path / name), str(tmp_path / "args.json")


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("switchhead convert: error: "), captured.err
    return lines[0]


# ------------------------------------------------------------------------------------------- round trip, logits
def test_cli_round_trip_gives_the_authors_logits_and_their_tensors_back_bit_exactly(tmp_path, capsys):
    state_file, args_file = _files(tmp_path)
    assert cli_main(["convert", "moeut-to-hf", state_file, str(tmp_path / "hf"), "--moeut-args", args_file]) == 0
    assert "3 distinct blocks applied 2 times, 6 layers" in capsys.readouterr().out
    model = SwitchHeadForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert len(model.model.layers) == 3 and model.config.num_hidden_layers == 6
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        difference = (model(ids).logits - authors_logits(authors_state(ARGS), ARGS, ids)).abs().max().item()
    assert difference <= 1e-5, difference

    assert cli_main(["convert", "hf-to-moeut", str(tmp_path / "hf"), str(tmp_path / "back.pt"),
                     "--args-output", str(tmp_path / "back.json")]) == 0
    assert "build it with MoEUTLM(**{" in capsys.readouterr().out
    theirs, back = authors_state(ARGS), torch.load(tmp_path / "back.pt", weights_only=True)
    assert list(back) == list(moeut_format.moeut_shapes({**ARGS, **DEFAULTS}))
    assert back.keys() == theirs.keys() and all(
        back[name].dtype == theirs[name].dtype and torch.equal(back[name], theirs[name]) for name in theirs)
    assert json.loads((tmp_path / "back.json").read_text()) == {**ARGS, **DEFAULTS}


def test_safetensors_and_bfloat16_keep_their_dtype_both_ways(tmp_path):
    state = authors_state(ARGS, seed=3, dtype=torch.bfloat16)
    save_file(state, tmp_path / "moeutlm.safetensors")
    config, args = convert_moeut_checkpoint(str(tmp_path / "moeutlm.safetensors"), str(tmp_path / "hf"), ARGS)
    assert args == {**ARGS, **DEFAULTS} and config.layer_group_size == 3
    model = SwitchHeadForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.bfloat16  # the file's dtype, not fp32
    assert export_moeut_checkpoint(str(tmp_path / "hf"), str(tmp_path / "back.safetensors")) == args
    back = load_file(tmp_path / "back.safetensors")
    assert all(back[name].dtype == torch.bfloat16 and torch.equal(back[name], state[name]) for name in state)
    model.float().eval()
    ids = torch.randint(0, 61, (1, 9))
    assert (model(ids).logits - authors_logits(state, ARGS, ids)).abs().max() <= 1e-5


def test_defaults_fill_in_and_a_profile_name_reads_n_tokens_from_the_embedding(tmp_path, monkeypatch):
    # d_head left out: d_model // n_heads, as their module; group_size / ff_k / att_k / ff_expert_size defaults
    args = dict(n_tokens=50, d_model=32, n_layers=4, n_heads=2, ff_n_experts=9, att_n_experts=2)
    full = moeut_format.moeut_arguments(args)
    assert (full["d_head"], full["group_size"], full["ff_k"], full["att_k"], full["ff_expert_size"]) == \
        (None, 2, 8, 2, 128)
    state = authors_state({**full, "d_head": 16}, seed=4)
    state_file, args_file = _files(tmp_path, state, args)
    assert cli_main(["convert", "moeut-to-hf", state_file, str(tmp_path / "hf"), "--moeut-args", args_file]) == 0
    ids = torch.randint(0, 50, (2, 7))
    model = SwitchHeadForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert (model(ids).logits - authors_logits(state, full, ids)).abs().max() <= 1e-5
    # a profile is the preset built from it; here a tiny stand-in for profiles.py's dicts, built the same way
    monkeypatch.setitem(moeut_format.PROFILE_PRESETS, "TINY", "tiny-moeut")
    tiny = moeut_format.moeut_args_from_config(SwitchHeadConfig.from_preset("tiny-moeut"))
    tiny_state = authors_state({**tiny, "n_tokens": 77}, seed=5)
    torch.save(tiny_state, tmp_path / "tiny.pt")
    assert cli_main(["convert", "moeut-to-hf", str(tmp_path / "tiny.pt"), str(tmp_path / "tiny"),
                     "--profile", "TINY"]) == 0
    model = SwitchHeadForCausalLM.from_pretrained(tmp_path / "tiny").eval()
    assert model.config.vocab_size == 77
    ids = torch.randint(0, 77, (1, 8))
    assert (model(ids).logits - authors_logits(tiny_state, {**tiny, "n_tokens": 77}, ids)).abs().max() <= 1e-5


def test_every_moeut_preset_gives_its_profile_arguments_and_back():
    # profiles.py's MoEUT_1B and MoEUT_244M, as the constructor receives them with a vocabulary of 8000
    assert moeut_format.profile_arguments("MoEUT_1B", 8000) == {
        "n_tokens": 8000, "d_model": 1536, "n_layers": 36, "n_heads": 6, "ff_n_experts": 565, "att_n_experts": 12,
        "d_head": 128, "group_size": 4, "ff_k": 24, "att_k": 2, "ff_expert_size": 128, **DEFAULTS}
    assert moeut_format.profile_arguments("MoEUT_244M", 8000) == {
        "n_tokens": 8000, "d_model": 1024, "n_layers": 18, "n_heads": 4, "ff_n_experts": 387, "att_n_experts": 10,
        "d_head": 128, "group_size": 2, "ff_k": 16, "att_k": 2, "ff_expert_size": 128, **DEFAULTS}
    # profiles.py's MoEUT_727M as written (d_model 1024), not the paper's run that the preset follows (1280)
    assert moeut_format.profile_arguments("MoEUT_727M", 8000)["d_model"] == 1024
    assert SwitchHeadConfig.from_preset("moeut-727m").hidden_size == 1280
    for profile in moeut_format.PROFILE_PRESETS:
        config = moeut_format.profile_config(profile)
        if profile == "MoEUT_44M":  # d_head 82: see the refusal test
            continue
        args = moeut_format.profile_arguments(profile, config.vocab_size)
        rebuilt = moeut_format.config_from_moeut_args(**args, max_position_embeddings=config.max_position_embeddings)
        assert rebuilt.to_dict() == config.to_dict(), profile


# ------------------------------------------------------------------------------------------------------ refusals
def _problem(tmp_path, problem):
    """(command line, words the one error line must hold) for each refused input."""
    state = authors_state(ARGS)
    out = str(tmp_path / "hf")
    if problem == "missing key":
        del state["transformer.layers.2.ffn.values"]
        words = ["lacks transformer.layers.2.ffn.values"]
    elif problem == "unknown key":
        state["transformer.layers.0.attention.scale"] = torch.ones(1)
        words = ["does not: transformer.layers.0.attention.scale"]
    elif problem == "compiled model's names":
        state = {"_orig_mod." + name: tensor for name, tensor in state.items()}
        words = ["does not: _orig_mod.embedding.weight"]
    elif problem == "shape against the arguments":
        state["transformer.layers.1.attention.v"] = torch.zeros(2 * 4, 24, 8)  # built with att_n_experts=4
        words = ["transformer.layers.1.attention.v has shape [8, 24, 8], but the arguments give [6, 24, 8]"]
    elif problem == "integer tensor":
        state["lm_head.bias"] = torch.zeros(61, dtype=torch.long)
        words = ["lm_head.bias is not a floating-point tensor"]
    elif problem == "the MoEUT body alone":
        state = {name[len("transformer."):]: t for name, t in state.items() if name.startswith("transformer.")}
        words = ["MoEUT body (layers.*)", "convert the MoEUTLM around it"]
    state_file, args_file = _files(tmp_path, state)
    command = ["convert", "moeut-to-hf", state_file, out, "--moeut-args", args_file]
    if problem == "n_layers not a multiple of group_size":
        _files(tmp_path, args={**ARGS, "n_layers": 7})
        words = ["n_layers (7) is not a multiple of group_size (3)", "apply only 6 layers", "n_layers=6"]
    elif problem == "odd rotated half (profile MoEUT_44M)":
        command = ["convert", "moeut-to-hf", state_file, out, "--profile", "MoEUT_44M"]
        words = ["int(82 / 2) = 41 rotated channels", "odd count", "no logits to match"]
    elif problem == "unknown profile":
        command = ["convert", "moeut-to-hf", state_file, out, "--profile", "MoEUT_2B"]
        words = ["unknown MoEUT profile 'MoEUT_2B'", "MoEUT_1B"]
    elif problem == "unknown argument":
        _files(tmp_path, args={**ARGS, "n_experts": 4})
        words = ["unknown MoEUTLM argument(s) n_experts"]
    elif problem == "missing argument":
        _files(tmp_path, args={k: v for k, v in ARGS.items() if k != "n_tokens"})
        words = ["lack n_tokens"]
    elif problem == "non-integer argument":
        _files(tmp_path, args={**ARGS, "d_model": 24.0})
        words = ["d_model must be a positive integer, got 24.0"]
    elif problem == "one-expert attention":
        _files(tmp_path, args={**ARGS, "att_n_experts": 1})
        words = ["att_n_experts=1"]
    elif problem == "top-k above the experts":
        _files(tmp_path, args={**ARGS, "ff_k": 9})
        words = ["no valid model", "num_mlp_experts_per_tok (9) must be <= num_mlp_experts (5)"]
    elif problem == "arguments not JSON":
        (tmp_path / "args.json").write_text("n_tokens=61")
        words = ["--moeut-args", "args.json"]
    elif problem == "output exists":
        os.makedirs(out)
        (tmp_path / "hf" / "keep.txt").write_text("mine")
        words = ["already exists"]
    elif problem == "pickled object":
        torch.save({"state_dict": state, "note": _Payload()}, state_file)
        words = ["weights_only", "--allow-pickle"]
    return command, words


class _Payload:
    """An arbitrary Python object: a weights_only load must refuse to build it."""


PROBLEMS = ["missing key", "unknown key", "compiled model's names", "shape against the arguments", "integer tensor",
            "the MoEUT body alone", "n_layers not a multiple of group_size", "odd rotated half (profile MoEUT_44M)",
            "unknown profile", "unknown argument", "missing argument", "non-integer argument", "one-expert attention",
            "top-k above the experts", "arguments not JSON", "output exists", "pickled object"]


@pytest.mark.parametrize("problem", PROBLEMS)
def test_a_refused_input_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, problem):
    command, words = _problem(tmp_path, problem)
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "hf")) if (tmp_path / "hf").exists() else None
    assert cli_main(command) == 2
    line = _one_error_line(capsys)
    assert all(word in line for word in words), line
    after = sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "hf")) if (tmp_path / "hf").exists() else None
    assert after == before  # no folder, no staging leftovers, the existing folder untouched


def test_export_refuses_what_their_module_cannot_be_and_an_existing_args_output(tmp_path, capsys):
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchall")).save_pretrained(tmp_path / "switchall")
    assert cli_main(["convert", "hf-to-moeut", str(tmp_path / "switchall"), str(tmp_path / "a.pt")]) == 2
    assert "not a MoEUT configuration" in _one_error_line(capsys)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(
        "tiny-moeut", lm_head_bias=False)).save_pretrained(tmp_path / "nobias")
    assert cli_main(["convert", "hf-to-moeut", str(tmp_path / "nobias"), str(tmp_path / "a.pt")]) == 2
    assert "cannot express this configuration's lm_head_bias=False (theirs: True)" in _one_error_line(capsys)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-moeut")).save_pretrained(tmp_path / "tiny")
    (tmp_path / "args.json").write_text("{}")
    assert cli_main(["convert", "hf-to-moeut", str(tmp_path / "tiny"), str(tmp_path / "a.pt"),
                     "--args-output", str(tmp_path / "args.json")]) == 2
    assert "--args-output" in _one_error_line(capsys)
    assert not (tmp_path / "a.pt").exists() and (tmp_path / "args.json").read_text() == "{}"


@pytest.mark.integration
def test_the_installed_command_converts_and_refuses_in_one_line(tmp_path):
    state_file, args_file = _files(tmp_path)
    run = [sys.executable, "-m", "switchhead.cli", "convert", "moeut-to-hf", state_file]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([*run, str(tmp_path / "hf"), "--moeut-args", args_file], capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0, done.stderr
    refused = subprocess.run([*run, str(tmp_path / "hf"), "--moeut-args", args_file], capture_output=True, text=True,
                             env=env)
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "already exists" in refused.stderr
    model = SwitchHeadForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 61, (1, 6))
    assert (model(ids).logits - authors_logits(authors_state(ARGS), ARGS, ids)).abs().max() <= 1e-5
