"""A newcomer without the data folder: the errors for a missing data path say what the path may hold and, in a
checkout, which script fetches the data the README's examples use."""

from __future__ import annotations

from pathlib import Path

import pytest

from switchhead.cli import main

REPO = Path(__file__).resolve().parents[2]


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"switchhead {command}: error: "), err
    return lines[0]


@pytest.mark.parametrize("flag", ["--data", "--valid-data"])
def test_train_without_the_data_folder_says_where_it_comes_from(flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no ../shared/data here
    argv = ["train", "--preset", "tiny-switchhead", "--output-dir", str(tmp_path / "run"), "--max-steps", "1"]
    argv += [flag, "../shared/data/wikitext-2"]  # --valid-data alone: the training text is the embedded corpus
    assert main(argv) == 2
    line = _error_line(capsys, "train")
    assert "'../shared/data/wikitext-2' does not exist" in line
    assert "wiki.train.tokens" in line and ".jsonl" in line
    assert "python scripts/fetch_test_data.py" in line and (REPO / "scripts" / "fetch_test_data.py").is_file()


def test_finetune_without_the_data_folder_says_where_it_comes_from(tmp_path, capsys):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.training.data import train_tokenizer

    model = tmp_path / "model"
    tokenizer = train_tokenizer(["a small text to train a tokenizer on"] * 20, vocab_size=300)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=len(tokenizer))
                          ).save_pretrained(model)
    tokenizer.save_pretrained(model)
    assert main(["finetune", str(model), "--data", str(tmp_path / "wikitext-2"), "--output-dir",
                 str(tmp_path / "out")]) == 2
    line = _error_line(capsys, "finetune")
    assert "does not exist" in line and "python scripts/fetch_test_data.py" in line, line


def test_eval_tasks_without_the_data_folder_say_what_it_holds_and_where_it_comes_from(tmp_path):
    from switchhead.evaluation.tasks import utils

    with pytest.raises(FileNotFoundError) as error:
        utils.data_path("lambada_path", {"data_dir": str(tmp_path / "nowhere")})
    message = str(error.value)
    assert "lambada/lambada_test.jsonl" in message and "blimp" in message and "wikitext-2" in message
    assert "python scripts/fetch_test_data.py" in message
