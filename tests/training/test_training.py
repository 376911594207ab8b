"""switchhead.training: tokenizer, data order, learning-rate schedule, a real WikiText-2 run, the result folder and
bad input. The resume and multi-process proofs are in test_training_resume.py / test_training_distributed.py."""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from switchhead import SwitchHeadConfig
from switchhead.cli import main
from switchhead.training import (TokenBatches, TrainingConfig, checkpoint_dirs, learning_rate_at, load_tokenizer,
                                 train, train_tokenizer)
from switchhead.training.data import load_documents
from switchhead.cli.demo import parameter_matched_dense

pytestmark = pytest.mark.integration  # trains

SMALL_RUN = ["--vocab-size", "512", "--block-size", "32", "--batch-size", "8", "--max-steps", "4", "--log-every", "1",
             "--eval-every", "2", "--eval-batches", "2", "--save-every", "2", "--no-progress", "--no-tensorboard"]


def tree_digest(folder: Path) -> dict:
    """sha256 of every file under `folder` (to prove nothing was touched)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ================================================================================================ tokenizer
def test_trained_bpe_splits_digits_and_reloads_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    documents = ["The year 1984 had 365 days and 12 months.\n" * 20, "def add(a, b):\n    return a + b\n" * 20]
    tokenizer = train_tokenizer(documents, vocab_size=300)
    assert len(tokenizer) <= 300
    pieces = tokenizer.tokenize("in 1984")
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["1", "9", "8", "4"]  # one token per digit
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "def add(a, b):\n    return 1984"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text
    assert reloaded.eos_token == "<|endoftext|>" and reloaded.pad_token_id == reloaded.eos_token_id


def test_gpt2_tokenizer_folder_loads_with_its_end_of_text_token(shared_data):
    tokenizer = load_tokenizer(str(shared_data / "tokenizers" / "gpt2"))
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256
    assert tokenizer.decode(tokenizer(" Hello world")["input_ids"]) == " Hello world"
    assert tokenizer(" Hello")["input_ids"] == [18435]  # GPT-2's id of "ĠHello"


def test_wikitext_folder_gives_train_and_validation_splits_by_file_name(shared_data):
    train_docs, valid_docs = load_documents(str(shared_data / "wikitext-2"))
    assert len(train_docs) == 1 and len(valid_docs) == 1  # wiki.test.tokens is left out
    assert train_docs[0].startswith(" \n = Valkyria Chronicles III = ")
    assert valid_docs[0].startswith(" \n = Homarus gammarus = ")


# ================================================================================================ batches
def test_ordered_batches_continue_every_row_from_one_step_to_the_next():
    tokens = torch.arange(1000)
    batches = TokenBatches(tokens, block_size=10, rows=4, ordered=True)
    assert len(batches) == 1000 // 4 // 10
    for step in range(len(batches) - 1):
        now, after = batches.global_batch(step), batches.global_batch(step + 1)
        assert torch.equal(after[:, 0], now[:, -1] + 1)  # row r of step s+1 follows row r of step s
    assert batches.segment_index(len(batches)) == 0  # a new pass (XL memory reset) after the last segment


def test_shuffled_batches_visit_every_block_once_per_epoch_and_repeat_for_the_same_seed():
    tokens = torch.arange(640)
    batches = TokenBatches(tokens, block_size=8, rows=4, seed=3)
    epoch = torch.cat([batches.global_batch(s) for s in range(len(batches))])
    assert sorted(epoch[:, 0].tolist()) == list(range(0, 640, 8))
    again = TokenBatches(tokens, block_size=8, rows=4, seed=3)
    assert torch.equal(again.global_batch(5), batches.global_batch(5))
    assert not torch.equal(batches.global_batch(0), batches.global_batch(len(batches)))  # epochs reshuffle


@pytest.mark.parametrize("processes,accumulation", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_micro_batches_of_all_processes_make_up_the_global_batch(processes, accumulation):
    batches = TokenBatches(torch.arange(4096), block_size=16, rows=8, seed=1)
    parts = [batches.micro_batch(7, m, p, processes, accumulation) for m in range(accumulation)
             for p in range(processes)]
    assert all(part.shape == (8 // (processes * accumulation), 16) for part in parts)
    assert torch.equal(torch.cat(parts), batches.global_batch(7))


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_minimum():
    config = TrainingConfig(learning_rate=1.0, min_learning_rate=0.1, warmup_steps=10, max_steps=110)
    assert learning_rate_at(0, config) == pytest.approx(0.1)
    assert learning_rate_at(9, config) == pytest.approx(1.0)
    assert learning_rate_at(60, config) == pytest.approx(0.55)  # half way through the cosine
    assert learning_rate_at(110, config) == pytest.approx(0.1)


def test_presets_carry_the_paper_training_settings():
    config = TrainingConfig.from_preset("wt103-47m-switchhead-xl")
    assert (config.block_size, config.batch_size, config.learning_rate, config.max_steps, config.grad_clip) == \
        (256, 64, 2.5e-4, 100_000, 0.1)
    tiny = TrainingConfig.from_preset("tiny-dense", max_steps=7)
    assert tiny.max_steps == 7 and tiny.block_size <= SwitchHeadConfig.from_preset("tiny-dense").max_position_embeddings


# ================================================================================================ demo pieces
def test_dense_baseline_is_parameter_matched_by_widening_its_mlp():
    from switchhead import SwitchHeadForCausalLM

    config = SwitchHeadConfig.from_preset("tiny-switchhead")
    dense = SwitchHeadConfig.from_preset("tiny-switchhead", **parameter_matched_dense(config, 4))
    with torch.device("meta"):
        switchhead_params = SwitchHeadForCausalLM(config).num_parameters()
        dense_params = SwitchHeadForCausalLM(dense).num_parameters()
    assert dense.attention_type == "dense" and dense.num_attention_heads == 4
    # one unit of MLP width adds a row, a column and a bias in every layer
    per_width = config.num_hidden_layers * (2 * config.hidden_size + 1)
    assert abs(dense_params - switchhead_params) <= per_width // 2 + 1


# ================================================================================================ a real run
@pytest.fixture(scope="module")
def wikitext_run(tmp_path_factory):
    """A tiny SwitchHead model trained on WikiText-2 (tokenizer trained on its training split)."""
    from helpers.data import require

    data = require("wikitext-2") / "wikitext-2"
    output = tmp_path_factory.mktemp("wikitext-run")
    config = TrainingConfig.from_preset("tiny-switchhead", data=str(data), output_dir=str(output), vocab_size=2048,
                                        block_size=64, batch_size=16, max_steps=150, warmup_steps=15,
                                        eval_every=150, eval_batches=20, log_every=25, save_every=75,
                                        progress=False, report_to="tensorboard")
    return output, train(config)


def test_tiny_wikitext2_run_gets_well_below_unigram_perplexity(wikitext_run):
    output, result = wikitext_run
    assert result.step == 150
    assert result.valid_perplexity < 0.6 * result.unigram_perplexity, (result.valid_perplexity,
                                                                       result.unigram_perplexity)
    rows = (output / "log.csv").read_text().splitlines()
    header = rows[0].split(",")
    first, last = dict(zip(header, rows[1].split(","))), dict(zip(header, rows[-1].split(",")))
    assert float(last["loss"]) < float(first["loss"]) - 0.5
    assert float(last["tokens_per_second"]) > 0 and float(last["peak_memory_mb"]) > 0
    assert list((output / "tensorboard" / "switchhead").glob("events.out.tfevents.*"))
    assert [Path(p).name for p in checkpoint_dirs(str(output))] == ["step-0000075", "step-0000150"]


def test_result_folder_loads_with_automodel_and_generates(wikitext_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output, result = wikitext_run
    model = AutoModelForCausalLM.from_pretrained(output).eval()
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert model.config.vocab_size == len(tokenizer) == 2048
    ids = tokenizer(" The game was released in", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == ids["input_ids"].shape[1] + 8


@pytest.mark.integration
def test_result_folder_loads_with_trust_remote_code_without_the_package(wikitext_run, tmp_path):
    output, _ = wikitext_run
    script = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'switchhead' or name.startswith('switchhead.'):\n"
        "            raise ImportError('switchhead is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(output)!r}, trust_remote_code=True).eval()\n"
        f"tok = AutoTokenizer.from_pretrained({str(output)!r}, trust_remote_code=True)\n"
        "assert 'switchhead' not in sys.modules\n"
        "ids = tok(' The game was released in Japan', return_tensors='pt')['input_ids']\n"
        "print(float(model(input_ids=ids, labels=ids).loss))\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 0 < float(done.stdout.strip().splitlines()[-1]) < 20  # a finite next-token loss


# ================================================================================================ bad input
def _one_line_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("switchhead train: error:")]
    assert len(err) == 1
    return err[0]


@pytest.mark.parametrize("case", ["missing data", "empty file", "block size", "unknown preset"])
def test_bad_input_exits_2_with_a_one_line_reason_and_writes_nothing(case, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("A short line of text for the tokenizer.\n" * 400)
    (tmp_path / "empty.txt").write_text("")
    args = {"missing data": ["--data", str(tmp_path / "nowhere.txt")],
            "empty file": ["--data", str(tmp_path / "empty.txt")],
            "block size": ["--data", str(text), "--block-size", "4096"],
            "unknown preset": ["--data", str(text), "--preset", "gpt-7"]}[case]
    out = tmp_path / "run"
    assert main(["train", *SMALL_RUN, *args, "--output-dir", str(out)]) == 2
    line = _one_line_error(capsys)
    assert {"missing data": "does not exist", "empty file": "is empty", "block size": "max_position_embeddings (128)",
            "unknown preset": "unknown preset 'gpt-7'"}[case] in line
    assert not out.exists()


def test_corrupt_checkpoint_on_resume_exits_2_and_damages_nothing(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"Line {i} of a small corpus about lobsters and games.\n" for i in range(3000)))
    run = tmp_path / "run"
    assert main(["train", *SMALL_RUN, "--data", str(text), "--output-dir", str(run)]) == 0
    capsys.readouterr()
    newest = Path(checkpoint_dirs(str(run))[-1])
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a truncated file
    before = tree_digest(run)
    # resuming from that checkpoint by name is refused (`--resume` alone falls back to the newest intact one:
    # test_reliability.py)
    assert main(["train", "--output-dir", str(run), "--resume", str(newest), "--max-steps", "6", "--no-progress"]) == 2
    assert "is damaged or incomplete (changed model.safetensors)" in _one_line_error(capsys)
    assert tree_digest(run) == before

    # a fresh run into a folder that holds a run is refused too (it would overwrite the checkpoints)
    assert main(["train", *SMALL_RUN, "--data", str(text), "--output-dir", str(run)]) == 2
    assert "pass --resume" in _one_line_error(capsys)
    assert tree_digest(run) == before

    # resuming with a different learning rate would not continue the same run
    shutil.rmtree(newest)
    assert main(["train", "--output-dir", str(run), "--resume", "--learning-rate", "0.5", "--no-progress"]) == 2
    assert "learning_rate" in _one_line_error(capsys)
