"""Every `switchhead train` / `finetune` output folder carries a model card (README.md with Hub metadata), and its
saved tokenizer truncates to the model's context instead of the 1e30 placeholder."""

import csv
import json
import os
from pathlib import Path

import pytest
import yaml

from switchhead.cli import main
from switchhead.training.run_card import CARD_MARKER, with_context, write_card

RUN = ["--vocab-size", "512", "--block-size", "32", "--batch-size", "8", "--log-every", "1", "--eval-every", "2",
       "--eval-batches", "2", "--save-every", "2", "--no-progress", "--no-tensorboard"]


def _metadata(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    text = tmp_path_factory.mktemp("corpus") / "lobsters.txt"
    text.write_text("".join(f"Line {i} of a small corpus about lobsters and games.\n" for i in range(3000)))
    return text


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus) -> Path:
    run = tmp_path_factory.mktemp("card") / "run"
    assert main(["train", *RUN, "--max-steps", "4", "--data", str(corpus), "--output-dir", str(run)]) == 0
    return run


@pytest.mark.integration
def test_trained_folder_has_a_card_with_hub_metadata_and_the_runs_numbers(trained_run):
    from huggingface_hub import ModelCard

    text = (trained_run / "README.md").read_text()
    metadata = _metadata(text)
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert metadata["license"] == "apache-2.0" and "switchhead" in metadata["tags"]
    assert ModelCard(text).data.model_name == "run"
    settings = json.loads((trained_run / "training_config.json").read_text())
    assert f"| learning_rate | {settings['learning_rate']} |" in text and "| max_steps | 4 |" in text
    with open(trained_run / "log.csv", newline="") as handle:
        evaluated = [row for row in csv.DictReader(handle) if row["valid_loss"]]
    assert [row["step"] for row in evaluated] == ["2", "4"]
    for row in evaluated:  # the card's results are the log's validation rows
        assert f"| {row['step']} | {float(row['loss']):.4f} | {float(row['valid_loss']):.4f} |" in text
    assert "Trained on `lobsters.txt`" in text and "- Transformers " in text and "- PyTorch " in text
    assert "PAPER.md" not in text and str(trained_run) not in text  # no local path, no unshipped reference
    assert text.rstrip().endswith(CARD_MARKER)
    assert "README.md" not in (trained_run / "SHA256SUMS").read_text()  # editing the card breaks no manifest


@pytest.mark.integration
def test_trained_tokenizer_truncates_to_the_model_context(trained_run):
    from transformers import AutoConfig, AutoTokenizer

    import switchhead  # noqa: F401 - registers the config class

    context = AutoConfig.from_pretrained(trained_run).max_position_embeddings
    saved = json.loads((trained_run / "tokenizer_config.json").read_text())
    assert saved["model_max_length"] == context
    tokenizer = AutoTokenizer.from_pretrained(trained_run)
    assert tokenizer.model_max_length == context
    long_text = " ".join(["lobster"] * (context * 4))
    assert len(tokenizer(long_text, truncation=True)["input_ids"]) == context


@pytest.mark.integration
def test_resume_rewrites_its_own_card_and_keeps_the_users(tmp_path, corpus):
    run = tmp_path / "run"
    assert main(["train", *RUN, "--max-steps", "2", "--data", str(corpus), "--output-dir", str(run)]) == 0
    assert "| max_steps | 2 |" in (run / "README.md").read_text()
    assert main(["train", "--output-dir", str(run), "--resume", "--max-steps", "4", "--no-progress"]) == 0
    text = (run / "README.md").read_text()
    assert "| max_steps | 4 |" in text and "| 4 |" in text  # ours: rewritten with the longer run
    # `switchhead card` replaces the run's card without --overwrite; its card is the user's from then on
    assert main(["card", str(run)]) == 0
    card = (run / "README.md").read_text()
    assert CARD_MARKER not in card and "Attention cost per layer" in card and "| max_steps | 4 |" in card
    assert main(["train", "--output-dir", str(run), "--resume", "--max-steps", "6", "--no-progress"]) == 0
    assert (run / "README.md").read_text() == card
    (run / "README.md").write_text("# my own notes\n")
    assert main(["train", "--output-dir", str(run), "--resume", "--max-steps", "8", "--no-progress"]) == 0
    assert (run / "README.md").read_text() == "# my own notes\n"  # the user's card is never replaced
    assert main(["card", str(run)]) == 2  # nor by `switchhead card` without --overwrite


@pytest.mark.integration
def test_finetune_writes_an_adapter_card_and_a_merged_model_card(trained_run, corpus, tmp_path):
    out = tmp_path / "adapter"
    assert main(["finetune", str(trained_run), "--data", str(corpus), "--output-dir", str(out), "--rank", "2",
                 "--max-steps", "2", "--batch-size", "4", "--block-size", "32", "--merge"]) == 0
    adapter = (out / "README.md").read_text()
    metadata = _metadata(adapter)
    assert metadata["library_name"] == "peft" and metadata["license"] == "apache-2.0"
    assert "base_model" not in metadata  # a local folder is no Hub id
    assert "PeftModel.from_pretrained" in adapter and 'from_pretrained("run")' in adapter
    assert "[More Information Needed]" not in adapter  # PEFT's placeholder card was replaced
    report = json.loads((out / "finetune.json").read_text())
    assert f"{report['valid_loss_before']:.4f} before, {report['valid_loss_after']:.4f} after" in adapter
    assert "| rank | 2 |" in adapter and "| lora_alpha | 4 |" in adapter
    merged = (out / "merged" / "README.md").read_text()
    assert _metadata(merged)["library_name"] == "transformers" and "merged into its weights" in merged
    context = json.loads((trained_run / "config.json").read_text())["max_position_embeddings"]
    for folder in (out, out / "merged"):
        assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == context


class _Tokenizer:
    def __init__(self, limit):
        self.model_max_length = limit


def test_with_context_replaces_the_placeholder_and_keeps_a_smaller_limit():
    from switchhead import SwitchHeadConfig

    config = SwitchHeadConfig.from_preset("tiny-switchhead")
    assert with_context(_Tokenizer(int(1e30)), config).model_max_length == config.max_position_embeddings
    assert with_context(_Tokenizer(16), config).model_max_length == 16


def test_write_card_replaces_only_its_own_card_and_follows_no_link(tmp_path):
    card = tmp_path / "README.md"
    assert write_card(str(tmp_path), f"first\n{CARD_MARKER}\n") == str(card)
    assert write_card(str(tmp_path), f"second\n{CARD_MARKER}\n") == str(card)
    assert card.read_text().startswith("second")
    card.write_text("mine\n")
    assert write_card(str(tmp_path), f"third\n{CARD_MARKER}\n") is None and card.read_text() == "mine\n"
    assert write_card(str(tmp_path), f"fourth\n{CARD_MARKER}\n", replace=True) == str(card)
    target = tmp_path / "elsewhere.md"
    target.write_text(f"theirs\n{CARD_MARKER}\n")
    card.unlink()
    os.symlink(target, card)
    assert write_card(str(tmp_path), f"fifth\n{CARD_MARKER}\n") is None
    assert target.read_text() == f"theirs\n{CARD_MARKER}\n"
