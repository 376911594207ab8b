"""Hostile argument values for `train`, `finetune`, `eval` and `serve`, run in this process: every one ends with exit
status 2 and exactly one line `switchhead <command>: error: ...` naming the option, before anything is loaded or
written (the output folder does not exist afterwards). Values a typo or a script produces: NaN, infinities,
negatives, zero, huge numbers, empty strings, whitespace, NUL bytes, settings that contradict each other.

Before these checks, `train --preset ''` trained the default preset, `--output-dir ''` trained into the current
folder, `--block-size 0` hung, `--seed` beyond NumPy's range failed only after the run marker was written (so the
corrected rerun was refused), `--set vocab_size=4096 --vocab-size 512` silently used 512, `finetune
--learning-rate inf` exited 0, `eval --tasks ''` exited 0 having evaluated nothing, `serve --log-level loud` ended
in a traceback and `--cb-block-size 1000000000` in a MemoryError inside the server.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from switchhead.cli import main

HUGE = str(10**70)


def run(argv: list[str]) -> int:
    """`main(argv)`'s exit status, also when argparse ends the process (SystemExit) over a bad value."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"switchhead {command}: error: "), err
    return err


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i} of a small corpus about lobsters.\n" for i in range(200)))
    return path


# (extra train arguments, words the error line must hold)
TRAIN_CASES = [
    (["--preset", ""], "--preset is empty"),
    (["--preset", "   "], "--preset is empty"),
    (["--preset", "tiny-nonexistent"], "unknown preset"),
    (["--output-dir", ""], "--output-dir is empty"),
    (["--output-dir", "  "], "--output-dir is empty"),
    (["--seed", HUGE], "seed must be an integer in [0, 4294967295]"),
    (["--seed", "-1"], "seed must be an integer in [0"),
    (["--seed", "1e70"], "invalid int value"),
    (["--block-size", "0"], "block_size must be an integer >= 1"),
    (["--block-size", "-5"], "block_size must be an integer >= 1"),
    (["--block-size", HUGE], "block_size"),
    (["--batch-size", "0"], "batch_size must be an integer >= 1"),
    (["--max-steps", "0"], "max_steps must be an integer >= 1"),
    (["--max-steps", "-3"], "max_steps must be an integer >= 1"),
    (["--gradient-accumulation-steps", "0"], "gradient_accumulation_steps"),
    (["--log-every", "0"], "log_every"),
    (["--eval-every", "-1"], "eval_every"),
    (["--save-every", "0"], "save_every"),
    (["--keep-checkpoints", "0"], "keep_checkpoints"),
    (["--warmup-steps", "-1"], "warmup_steps must be an integer >= 0"),
    (["--eval-batches", "-2"], "eval_batches must be an integer >= 0"),
    (["--learning-rate", "nan"], "learning_rate must be a finite number"),
    (["--learning-rate", "inf"], "learning_rate must be a finite number"),
    (["--learning-rate=-inf"], "learning_rate must be a finite number"),
    (["--learning-rate", "0"], "learning_rate > 0"),
    (["--learning-rate=-1e-3"], "learning_rate > 0"),
    (["--min-learning-rate", "nan"], "min_learning_rate must be a finite number"),
    (["--min-learning-rate", "1"], "min_learning_rate"),
    (["--grad-clip", "inf"], "grad_clip must be a finite number"),
    (["--grad-clip", "-1"], "grad_clip and weight_decay must be >= 0"),
    (["--weight-decay", "nan"], "weight_decay must be a finite number"),
    (["--weight-decay", "-0.1"], "grad_clip and weight_decay must be >= 0"),
    (["--valid-fraction", "0"], "valid_fraction must be a number in (0, 1)"),
    (["--valid-fraction", "1"], "valid_fraction must be a number in (0, 1)"),
    (["--valid-fraction", "nan"], "valid_fraction must be a number in (0, 1)"),
    (["--valid-fraction=-inf"], "valid_fraction must be a number in (0, 1)"),
    (["--vocab-size", "0"], "vocab_size must be an integer in [2,"),
    (["--vocab-size", "1000000000"], "vocab_size must be an integer in [2,"),
    (["--set", "vocab_size=4096", "--vocab-size", "512"], "vocab_size=4096 conflicts with 512"),
    (["--set", "vocab_size=4096"], "vocab_size=4096 conflicts with 2048"),
    (["--text-field", ""], "text_field must be a non-empty string"),
    (["--tokenizer", ""], "tokenizer must be a path or a name"),
    (["--valid-data", " "], "valid_data must be a path or a name"),
    (["--mixed-precision", "fp8"], "mixed_precision must be 'no', 'bf16' or 'fp16'"),
    (["--skip-nonfinite", "-1"], "--skip-nonfinite must be >= 0"),
    (["--tp-size", "0"], "--tp-size must be an integer >= 1"),
    (["--fsdp-size", "-2"], "--fsdp-size must be an integer >= 1"),
    (["--set", "hidden_size=nan"], "hidden_size"),
    (["--set", "num_hidden_layers=-1"], "num_hidden_layers"),
    (["--output-dir", "run\u202e\u0000x"], "output_dir must be a non-empty string"),
]


@pytest.mark.parametrize("extra, words", TRAIN_CASES, ids=[" ".join(case[0])[:40] for case in TRAIN_CASES])
def test_train_refuses_before_touching_the_output_folder(corpus, tmp_path, capsys, monkeypatch, extra, words):
    monkeypatch.chdir(tmp_path)  # an empty --output-dir would have meant this folder
    before = set(os.listdir(tmp_path))
    output = ["--output-dir", str(tmp_path / "run")] if "--output-dir" not in extra else []
    code = run(["train", "--data", str(corpus), "--max-steps", "2", "--no-progress", "--no-tensorboard", *output,
                 *extra])
    assert code == 2
    assert words in one_line(capsys, "train")
    assert set(os.listdir(tmp_path)) == before  # no run folder, no run marker, no lock file


def test_data_given_as_an_empty_string_is_not_the_default_corpus(tmp_path, capsys):
    assert main(["train", "--data", "", "--output-dir", str(tmp_path / "run"), "--no-progress"]) == 2
    assert "data must be a path or a name" in one_line(capsys, "train")
    assert not (tmp_path / "run").exists()


def test_a_corrected_rerun_after_a_refused_seed_is_not_refused(corpus, tmp_path, capsys):
    """The refusal left nothing: the same folder takes the corrected command (checked up to the run marker: the
    settings check of a fresh run passes and the marker is written by it)."""
    from switchhead.training.run_config import TrainingConfig, build_model_config, check_settings

    assert main(["train", "--data", str(corpus), "--output-dir", str(tmp_path / "run"), "--seed", HUGE]) == 2
    one_line(capsys, "train")
    assert not (tmp_path / "run").exists()
    config = TrainingConfig.from_preset("tiny-switchhead", output_dir=str(tmp_path / "run"), seed=2**32 - 1)
    check_settings(config)
    build_model_config(config, None)


FINETUNE_CASES = [
    (["--learning-rate", "inf"], "--learning-rate must be a finite number > 0"),
    (["--learning-rate", "nan"], "--learning-rate must be a finite number > 0"),
    (["--learning-rate=-inf"], "--learning-rate must be a finite number > 0"),
    (["--learning-rate", "0"], "--learning-rate must be a finite number > 0"),
    (["--learning-rate", "-1"], "--learning-rate must be a finite number > 0"),
    (["--max-steps", "0"], "--max-steps must be an integer >= 1"),
    (["--max-steps", "-5"], "--max-steps must be an integer >= 1"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--block-size", "0"], "--block-size must be an integer >= 2"),
    (["--block-size", "1"], "--block-size must be an integer >= 2"),
    (["--block-size", "-7"], "--block-size must be an integer >= 2"),
    (["--rank", "0"], "--rank must be an integer >= 1"),
    (["--rank", "-8"], "--rank must be an integer >= 1"),
    (["--alpha", "nan"], "LoRA alpha must be a finite number > 0"),
    (["--alpha", "inf"], "LoRA alpha must be a finite number > 0"),
    (["--alpha", "0"], "LoRA alpha must be a finite number > 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be an integer >= 0"),
    (["--seed", "-1"], "--seed must be an integer >= 0"),
    (["--seed", HUGE], "--seed must be below 2**32"),
]


@pytest.mark.parametrize("extra, words", FINETUNE_CASES, ids=[" ".join(case[0]) for case in FINETUNE_CASES])
def test_finetune_refuses_before_loading_or_writing(corpus, tmp_path, capsys, extra, words):
    code = run(["finetune", str(tmp_path / "base"), "--data", str(corpus), "--output-dir", str(tmp_path / "out"),
                 *extra])
    assert code == 2
    assert words in one_line(capsys, "finetune")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--output-dir", "--data"])
def test_finetune_refuses_empty_paths(corpus, tmp_path, capsys, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    values = {"--output-dir": str(tmp_path / "out"), "--data": str(corpus), flag: ""}
    assert main(["finetune", str(tmp_path / "base"), *[item for pair in values.items() for item in pair]]) == 2
    assert "must be a non-empty path" in one_line(capsys, "finetune")
    assert os.listdir(tmp_path) == ["corpus.txt"]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from helpers.hub_folder import save_hub_folder

    folder = tmp_path_factory.mktemp("model")
    save_hub_folder(folder, "tiny-switchhead")
    return folder


@pytest.mark.parametrize("tasks", ["", ",,,", " , ", ","])
def test_eval_tasks_that_name_no_task_are_refused(model_folder, capsys, tasks):
    assert main(["eval", str(model_folder), "--tasks", tasks]) == 2
    assert "names no task" in one_line(capsys, "eval")


SERVE_CASES = [
    (["--log-level", "loud"], "argument --log-level: invalid choice"),
    (["--log-level", ""], "argument --log-level: invalid choice"),
    (["--cb-block-size", "1000000000"], "--cb-block-size must be <= 65536"),
    (["--cb-block-size", "0"], "--cb-block-size must be >= 1"),
    (["--cb-block-size", "1e9"], "invalid int value"),
    (["--cb-num-blocks", "-1"], "--cb-num-blocks must be >= 1"),
    (["--cb-max-batch-tokens", "0"], "--cb-max-batch-tokens must be >= 1"),
    (["--cb-max-memory-percent", "nan"], "--cb-max-memory-percent must be in (0, 1]"),
    (["--cb-max-memory-percent", "inf"], "--cb-max-memory-percent must be in (0, 1]"),
    (["--port", "0"], "--port must be in 1..65535"),
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--device", "tpu:7"], "is not a device of this machine"),
]


@pytest.mark.parametrize("extra, words", SERVE_CASES, ids=[" ".join(case[0]) for case in SERVE_CASES])
def test_serve_refuses_bad_options_in_one_line(model_folder, capsys, extra, words):
    assert run(["serve", str(model_folder), *extra]) == 2
    assert words in one_line(capsys, "serve")


def test_log_level_takes_any_case(model_folder, capsys):
    """The choices are case-blind (WARNING as warning): the next check (the port) is what refuses this one."""
    assert run(["serve", str(model_folder), "--log-level", "WARNING", "--port", "0"]) == 2
    assert "--port must be in 1..65535" in one_line(capsys, "serve")


@pytest.mark.integration
def test_finetune_that_diverges_exits_3_and_saves_no_adapter(model_folder, corpus, tmp_path, capsys):
    """--learning-rate 1e30 is finite and positive, so it runs: the LoRA weights become non-finite, and the divergence
    guard stops the run before anything is saved (it exited 0 with an adapter of NaN / inf weights)."""
    pytest.importorskip("peft")
    output = tmp_path / "adapter"
    code = run(["finetune", str(model_folder), "--data", str(corpus), "--output-dir", str(output), "--max-steps", "3",
                "--batch-size", "2", "--block-size", "16", "--learning-rate", "1e30", "--no-progress"])
    assert code == 3
    assert "fine-tuning diverged" in one_line(capsys, "finetune")
    assert not [path for path in output.rglob("*") if path.suffix in (".safetensors", ".bin", ".json")]


# ---------------------------------------------------------------------------------------------- JSON of user files
JSON_CASES = [
    ("[1, 2]", "must hold a JSON object, but holds a list"),
    ('"text"', "must hold a JSON object, but holds a string"),
    ("3.5", "must hold a JSON object, but holds a number"),
    ("null", "must hold a JSON object, but holds null"),
    ("true", "must hold a JSON object, but holds a boolean"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' * 150 + "1" + "}" * 150, "nested too deeply"),
    ("{", "is not valid JSON"),
    ("", "is not valid JSON"),
    ('{"a": 1' + "0" * 5000 + "}", "is not valid JSON"),
]


@pytest.mark.parametrize("text, words", JSON_CASES, ids=[case[1][:20] + str(i) for i, case in enumerate(JSON_CASES)])
def test_json_of_user_files_is_read_in_one_place(tmp_path, text, words):
    from switchhead.integrity.user_json import read_json_object

    path = tmp_path / "file.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="file.json") as refused:
        read_json_object(path)
    assert words in str(refused.value)


def test_json_that_is_not_utf8_is_named(tmp_path):
    from switchhead.integrity.user_json import read_json_object

    path = tmp_path / "file.json"
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        read_json_object(path)


@pytest.fixture
def folder_copy(model_folder, tmp_path):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(model_folder, copy)
    return copy


def _edit_config(folder: Path, **fields) -> None:
    import json

    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


FOLDER_CASES = [
    ("config.json", "[1, 2]", "config.json of", "must hold a JSON object, but holds a list"),
    ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json of", "but holds a list"),
    ("generation_config.json", '"greedy"', "generation_config.json of", "but holds a string"),
    ("special_tokens_map.json", "[]", "special_tokens_map.json of", "but holds a list"),
    ("config.json", "[" * 100_000 + "]" * 100_000, "config.json of", "nested too deeply"),
    ("tokenizer_config.json", "{" * 3, "tokenizer_config.json of", "is not valid JSON"),
    ("config.json", {"dtype": "float1"}, "dtype 'float1' is not a floating-point dtype", ""),
    ("config.json", {"torch_dtype": "int8"}, "torch_dtype 'int8' is not a floating-point dtype", ""),
    ("config.json", {"model_type": "llama"}, "model_type 'llama' is not a SwitchHead model", ""),
    ("config.json", {"model_type": "gpt2"}, "model_type 'gpt2' is not a SwitchHead model", ""),
]


@pytest.mark.parametrize("name, content, words, more", FOLDER_CASES,
                         ids=[f"{case[0]}-{str(case[1])[:16]}" for case in FOLDER_CASES])
def test_generate_refuses_a_folder_whose_json_would_raise_in_transformers(folder_copy, capsys, name, content, words,
                                                                          more):
    if isinstance(content, dict):
        _edit_config(folder_copy, **content)
    else:
        (folder_copy / name).write_text(content)
    assert run(["generate", str(folder_copy), "--prompt", "hello", "--max-new-tokens", "2"]) == 2
    line = one_line(capsys, "generate")
    assert words in line and more in line, line


def test_the_folder_json_check_passes_our_own_folders(model_folder):
    from switchhead.integrity.user_json import check_folder_json

    check_folder_json(model_folder)  # no error


def test_card_results_that_are_a_list_or_too_deep_are_one_line(model_folder, tmp_path, capsys):
    for text, words in (("[1, 2]", "but holds a list"), ("[" * 100_000 + "]" * 100_000, "nested too deeply")):
        results = tmp_path / "results.json"
        results.write_text(text)
        assert run(["card", str(model_folder), "--results", str(results), "--output", str(tmp_path / "card.md")]) == 2
        assert words in one_line(capsys, "card")
        assert not (tmp_path / "card.md").exists()


# ---------------------------------------------------------------------------------------------- argv and stdout
@pytest.mark.parametrize("argv", [["generate", "\udcff\udcfe", "--prompt", "hi"], ["tr\udcffain"],
                                  ["train", "--output-dir", "run\udce9"], ["eval", "m", "--tasks", "\udc80"]])
def test_arguments_that_are_not_utf8_are_one_line(capsys, argv):
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not valid UTF-8" in err, err
    assert err.startswith(f"switchhead {argv[0]}: error: " if argv[0].isascii() else "switchhead: error: "), err


@pytest.mark.integration
def test_a_full_stdout_is_one_line_exit_2(model_folder):
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "switchhead.cli", "flops", str(model_folder)], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("switchhead flops: error: ") and "No space left on device" in done.stderr


def test_an_unreachable_hub_dataset_logs_no_retries(monkeypatch, caplog):
    """Without a network the Hub client logged each of its five retries (two lines each) before the one error
    line; they are held back during the download."""
    import logging

    import datasets

    from switchhead.training.data import DataError, load_documents

    def unreachable(name, *args, **kwargs):
        for attempt in range(1, 6):
            logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry %d/5].", attempt)
            logging.getLogger("datasets.load").warning("could not reach the Hub")
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    before = logging.getLogger("huggingface_hub").level
    with caplog.at_level(logging.WARNING):
        with pytest.raises(DataError, match="neither a local path nor a loadable Hub dataset"):
            load_documents("someone/some-dataset")
    assert not [record for record in caplog.records if "Retry" in record.getMessage() or "reach" in
                record.getMessage()], caplog.records
    assert logging.getLogger("huggingface_hub").level == before  # only held back during the download


def test_transformers_loading_bars_are_off_for_commands(corpus, tmp_path, capsys):
    from transformers.utils import logging as transformers_logging

    run(["train", "--data", str(corpus), "--output-dir", "", "--no-progress"])
    capsys.readouterr()
    assert not transformers_logging.is_progress_bar_enabled()


GENERATE_CASES = [
    (["--temperature", "1e-300"], "--temperature must be 0 (greedy) or at least"),
    (["--temperature", "5e-324"], "--temperature must be 0 (greedy) or at least"),
    (["--temperature", "1e-5"], "--temperature must be 0 (greedy) or at least"),
    (["--temperature", "nan"], "--temperature must be >= 0"),
    (["--temperature", "inf"], "--temperature must be >= 0"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63)"),
    (["--seed", HUGE], "--seed must be an integer in [0, 2**63)"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--max-new-tokens", "-4"], "--max-new-tokens must be >= 1"),
    (["--prompt", ""], "--prompt is empty"),
]


@pytest.mark.parametrize("extra, words", GENERATE_CASES, ids=[" ".join(case[0]) for case in GENERATE_CASES])
def test_generate_refuses_bad_numbers_in_one_line(model_folder, capsys, extra, words):
    assert run(["generate", str(model_folder), *extra]) == 2
    assert words in one_line(capsys, "generate")
