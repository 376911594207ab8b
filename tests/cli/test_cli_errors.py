"""The CLI error contract, table-driven: every expected failure of every subcommand exits 2 with exactly one line
`switchhead <command>: error: ...` on stderr, no traceback, and writes nothing. Unexpected failures keep their
traceback (checked with a deliberate bug at the end)."""

from pathlib import Path

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import build_parser, main
from switchhead.integrity import write_manifest

COVERED = ("train", "eval", "flops", "card", "publish", "convert", "generate", "finetune", "export", "serve")


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """A model folder (with tokenizer), a damaged run folder, a user's folder, plain and damaged files."""
    root = tmp_path_factory.mktemp("cli")
    from switchhead.training import train_tokenizer

    model = root / "model"
    torch.manual_seed(0)
    tokenizer = train_tokenizer(["The sea is calm and the lobsters walk along the sandy floor.\n" * 50], 300)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=len(tokenizer))
                          ).save_pretrained(model)
    tokenizer.save_pretrained(model)
    damaged = root / "damaged-run"
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead")).save_pretrained(damaged)
    (damaged / "training_config.json").write_text("{}")
    write_manifest(str(damaged), ["config.json", "model.safetensors"])
    weights = bytearray((damaged / "model.safetensors").read_bytes())
    weights[-10] ^= 0xFF
    (damaged / "model.safetensors").write_bytes(bytes(weights))
    user = root / "user-folder"
    user.mkdir()
    (user / "config.json").write_text('{"mine": 1}')
    (root / "empty").mkdir()
    (root / "existing.txt").write_text("the user's file")
    (root / "text.txt").write_text("A line of text about lobsters and the sea.\n" * 300)
    (root / "bad.json").write_text("{not json")
    good = root / "good.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1000)}, good)
    (root / "truncated.safetensors").write_bytes(good.read_bytes()[:200])
    torch.save({"model": {"x": torch.zeros(1000)}}, root / "good.pth")
    (root / "truncated.pth").write_bytes((root / "good.pth").read_bytes()[:300])
    wrong = root / "wrong-shapes"  # weights of one config under another config.json
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=len(tokenizer))
                          ).save_pretrained(wrong)
    tokenizer.save_pretrained(wrong)
    config = (wrong / "config.json").read_text().replace('"num_attention_experts": 4', '"num_attention_experts": 2')
    assert '"num_attention_experts": 2' in config
    (wrong / "config.json").write_text(config)
    (root / "binary.txt").write_bytes(bytes(range(256)) * 64)
    bad_tokenizer = root / "bad-tokenizer"
    bad_tokenizer.mkdir()
    (bad_tokenizer / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "')  # cut off
    return {"WRONG": str(wrong), "BINARY": str(root / "binary.txt"), "BADTOK": str(bad_tokenizer),
            "ROOT": str(root), "MODEL": str(model), "DAMAGED": str(damaged), "USER": str(user),
            "EMPTY": str(root / "empty"), "FILE": str(root / "existing.txt"), "TEXT": str(root / "text.txt"),
            "BADJSON": str(root / "bad.json"), "TRUNC_ST": str(root / "truncated.safetensors"),
            "TRUNC_PTH": str(root / "truncated.pth"), "MISSING": str(root / "missing"), "NEW": str(root / "new-out")}


LAYER = ["--layer-prefix", "blocks.{i}.attn."]
CASES = [
    # train
    ("train", ["--output-dir", "FILE"], "is a file"),
    ("train", ["--data", "MISSING", "--output-dir", "NEW"], "does not exist"),
    ("train", ["--data", "TEXT", "--set", "foo_bar=3", "--output-dir", "NEW"], "unknown --set field 'foo_bar'"),
    ("train", ["--data", "TEXT", "--set", "hiden_size=32", "--output-dir", "NEW"], "did you mean hidden_size"),
    ("train", ["--data", "TEXT", "--set", "layer_norm_eps=nan", "--output-dir", "NEW"], "layer_norm_eps"),
    ("train", ["--data", "TEXT", "--learning-rate", "nan", "--output-dir", "NEW"], "learning_rate"),
    ("train", ["--max-steps", "abc"], "invalid int value"),
    ("train", ["--skip-nonfinite", "-1", "--output-dir", "NEW"], "--skip-nonfinite must be >= 0"),
    ("train", ["--data", "TEXT", "--output-dir", "USER"], "is not a switchhead training run"),
    ("train", ["--data", "TEXT", "--output-dir", "USER", "--overwrite"], "is not a switchhead training run"),
    ("train", ["--resume", "--output-dir", "EMPTY"], "no complete checkpoint"),
    ("train", ["--resume", "--overwrite", "--output-dir", "USER"], "give only one"),
    ("train", ["--resume", "MISSING"], "does not exist"),
    ("train", ["--data", "BINARY", "--output-dir", "NEW"], "is binary (it holds NUL bytes)"),
    ("train", ["--data", "TEXT", "--tokenizer", "BADTOK", "--output-dir", "NEW"], "does not load"),  # no marker left
    ("train", ["--data", "TEXT", "--allow-pickle", "--output-dir", "NEW"], "--allow-pickle only applies to --resume"),
    # eval
    ("eval", ["MISSING"], "has no config.json"),
    ("eval", ["FILE"], "has no config.json"),
    ("eval", ["DAMAGED", "--tasks", "none"], "damaged or incomplete (changed model.safetensors)"),
    ("eval", ["MODEL", "--tasks", "none", "--output", "FILE"], "already exists; pass --overwrite"),
    ("eval", ["MODEL", "--tasks", "none", "--output", "EMPTY"], "is a folder"),
    ("eval", ["MODEL", "--batch-size", "0"], "--batch-size must be >= 1"),
    ("eval", ["MODEL", "--limit", "-1"], "--limit must be > 0"),
    ("eval", ["MODEL", "--limit", "1.5"], "neither a whole number of examples nor a fraction < 1"),
    ("eval", ["MODEL", "--tasks", "none", "--perplexity", "TEXT", "--context", "0"], "--context must be >= 1"),
    ("eval", ["MODEL", "--tasks", "none", "--perplexity", "TEXT", "--stride", "0"], "--stride must be >= 1"),
    ("eval", ["MODEL", "--tasks", "none", "--perplexity", "TEXT", "--context", "100000"],
     "longer than the model reads (128"),
    ("eval", ["MODEL", "--tasks", "none", "--perplexity", "MISSING"], "does not exist"),
    # flops
    ("flops", ["gpt-7"], "neither a preset"),
    ("flops", ["tiny-switchhead", "--set", "foo=1"], "unknown --set field 'foo'"),
    ("flops", ["tiny-switchhead", "--set", "layer_norm_eps=nan"], "layer_norm_eps"),
    ("flops", ["tiny-switchhead", "--set", "hidden_size=30", "--set", "head_dim=null", "--set",
               "num_attention_heads=4"], "not divisible"),
    ("flops", ["tiny-switchhead", "--context", "0"], "--context must be >= 1"),
    ("flops", ["BADJSON"], "Expecting property name"),
    # card
    ("card", ["MISSING"], "has no config.json"),
    ("card", ["MODEL", "--output", "FILE"], "already exists; pass --overwrite"),
    ("card", ["MODEL", "--output", "EMPTY"], "is a folder"),
    ("card", ["MODEL", "--results", "MISSING", "--output", "NEW"], "does not exist"),
    ("card", ["MODEL", "--results", "BADJSON", "--output", "NEW"], "Expecting property name"),
    # publish (the tests run with HF_HUB_OFFLINE=1)
    ("publish", ["MODEL", "me/model"], "HF_HUB_OFFLINE is set"),
    ("publish", ["MODEL", "not a repo id"], "repository id must look like 'owner/name'"),
    ("publish", ["MISSING", "me/model"], "has no config.json"),
    # convert
    ("convert", ["authors-to-hf", "MISSING", "NEW"], "no such checkpoint file"),
    ("convert", ["authors-to-hf", "TRUNC_PTH", "NEW"], "not a readable torch checkpoint"),
    ("convert", ["authors-to-hf", "TRUNC_ST", "NEW"], "TRUNC_ST"),
    ("convert", ["hf-to-authors", "MODEL", "FILE"], "already exists"),
    ("convert", ["hf-to-authors", "USER", "NEW"], "has no model.safetensors"),
    ("convert", ["hf-to-authors", "EMPTY", "NEW"], "is not a saved model folder"),
    ("convert", ["module-to-hf", "TRUNC_ST", "NEW", "--preset", "tiny-switchhead", *LAYER],
     "is a damaged or unreadable .safetensors file"),
    ("convert", ["module-to-hf", "MISSING", "NEW", "--config", "MISSING", *LAYER], "does not exist"),
    ("convert", ["hf-to-module", "MODEL", "FILE", *LAYER], "already exists"),
    ("convert", ["authors-to-hf", "TRUNC_PTH"], "required: output"),
    # generate
    ("generate", ["MISSING"], "does not exist"),
    ("generate", ["FILE"], "is a file"),
    ("generate", ["EMPTY"], "has no config.json"),
    ("generate", ["MODEL", "--prompt", ""], "--prompt is empty"),
    ("generate", ["MODEL", "--temperature", "-1"], "--temperature must be >= 0"),
    ("generate", ["MODEL", "--temperature", "nan"], "--temperature must be >= 0"),
    ("generate", ["MODEL", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("generate", ["DAMAGED"], "damaged or incomplete"),
    ("generate", ["MODEL", "--max-new-tokens", "100000"], "reads at most 128 (max_position_embeddings)"),
    ("generate", ["WRONG", "--no-verify"], "but config.json makes it"),
    # finetune
    ("finetune", ["MODEL", "--data", "TEXT", "--output-dir", "NEW", "--rank", "1000"],
     "exceeds the model width (hidden_size 64)"),
    ("finetune", ["MODEL", "--data", "TEXT", "--output-dir", "NEW", "--alpha", "0"], "LoRA alpha must be"),
    ("finetune", ["MISSING", "--data", "TEXT", "--output-dir", "NEW"], "no config.json"),
    # export (refused before the model is loaded)
    ("export", ["MISSING", "NEW"], "no config.json"),
    ("export", ["MODEL", "FILE"], "already exists; pass --overwrite"),
    ("export", ["MODEL", "EMPTY"], "is a folder"),
    # serve (refused before anything listens)
    ("serve", ["MISSING"], "neither an existing folder"),
    ("serve", ["WRONG"], "but config.json makes it"),
    ("serve", ["MODEL", "--port", "0"], "--port must be in 1..65535"),
]


def run_case(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse errors
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("switchhead")]
    assert len(lines) == 1, err
    return code, lines[0]


@pytest.mark.parametrize("command, args, expected", CASES,
                         ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_expected_failure_exits_2_with_one_line(command, args, expected, paths, capsys):
    argv = [command] + [paths.get(a, a) for a in args]
    before = {p: sorted(Path(p).rglob("*")) if Path(p).is_dir() else Path(p).read_bytes()
              for key in ("USER", "EMPTY", "FILE") for p in [paths[key]]}
    code, line = run_case(argv, capsys)
    assert code == 2, line
    assert line.startswith(f"switchhead {command}") and ": error: " in line, line
    assert paths.get(expected, expected) in line, line
    assert not Path(paths["NEW"]).exists()  # nothing was written
    after = {p: sorted(Path(p).rglob("*")) if Path(p).is_dir() else Path(p).read_bytes() for p in before}
    assert after == before


def test_the_table_walks_every_subcommand(capsys):
    registered = set(build_parser()._subparsers._group_actions[0].choices)
    assert set(COVERED) <= registered
    assert {command for command, _, _ in CASES} == set(COVERED)
    # every registered subcommand, ours and those added later, keeps the one-line contract for a bad option
    for command in sorted(registered):
        code, line = run_case([command, "--no-such-option"], capsys)
        assert code == 2 and line.startswith(f"switchhead {command}: error:"), (command, line)


def test_an_unexpected_failure_keeps_its_traceback(paths, monkeypatch):
    from switchhead.cli import evaluate as evaluation_cli

    def broken(*args, **kwargs):
        raise KeyError("a bug, not the user's fault")

    monkeypatch.setattr(evaluation_cli, "load_config", broken)
    with pytest.raises(KeyError):
        main(["flops", "tiny-switchhead"])

