"""Evaluation: lm-eval task folder (CLI and Python), scorers against hand-computed log-probs, perplexity
protocols, analysis plots, model card and publishing (with a fake Hub client)."""

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main
from switchhead.evaluation import TASKS_DIR
from switchhead.evaluation.tasks import utils as task_data
from switchhead.evaluation.zero_shot import (ContinuationScorer, paper_blimp, paper_cbt, paper_lambada, run_lm_eval,
                                             summarize)

LIMIT = 3
PARADIGMS = ["causative", "passive_1"]
LM_EVAL_TASKS = ["switchhead_lambada"] + [f"switchhead_blimp_{p}" for p in PARADIGMS] + ["switchhead_wikitext2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, shared_data):
    """A tiny SwitchHead model with a 512-token byte-level BPE trained on 100 KB of WikiText-2, saved with auto_map."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = (shared_data / "wikitext-2" / "wiki.train.tokens").read_text(encoding="utf-8")[:100_000]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset("tiny-switchhead", vocab_size=len(tokenizer),
                                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    path = tmp_path_factory.mktemp("tiny_model")
    SwitchHeadForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def python_run(model_dir, shared_data):
    return run_lm_eval(str(model_dir), LM_EVAL_TASKS, limit=LIMIT, batch_size=1, metadata={"data_dir": str(shared_data)},
                       log_samples=True)


def hand_logprob(model, tokenizer, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    """Sum of log p(continuation token | everything before it), and whether each one is the argmax.

    Like lm-eval, only the last max_position_embeddings (128) tokens before each prediction are fed.
    """
    window = (context_ids + continuation_ids)[-(model.config.max_position_embeddings + 1):]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([window[:-1]])).logits[0].float(), -1)
    total, greedy = 0.0, True
    first = len(window) - len(continuation_ids)
    for offset, token in enumerate(continuation_ids):
        row = log_probs[first + offset - 1]
        total += float(row[token])
        greedy &= int(row.argmax()) == token
    return total, greedy


# ---------------------------------------------------------------------------------------------------- lm-eval
@pytest.mark.integration
def test_lm_eval_cli_runs_offline_and_python_entry_point_gives_the_same_numbers(model_dir, shared_data, python_run,
                                                                                tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", SWITCHHEAD_DATA_DIR=str(shared_data))
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
               f"pretrained={model_dir},trust_remote_code=True", "--include_path", str(TASKS_DIR),
               "--tasks", ",".join(LM_EVAL_TASKS), "--limit", str(LIMIT), "--output_path", str(tmp_path / "out.json")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    [result_file] = list(tmp_path.glob("out*.json"))
    cli = summarize(json.loads(result_file.read_text()))
    python = summarize(python_run)
    assert set(cli) == set(LM_EVAL_TASKS) == set(python)
    for task in LM_EVAL_TASKS:
        assert cli[task].keys() == python[task].keys()
        for metric, value in cli[task].items():
            assert value == pytest.approx(python[task][metric], rel=1e-6), (task, metric)
    assert {"word_perplexity", "byte_perplexity", "bits_per_byte"} <= set(python["switchhead_wikitext2"])
    assert {"acc", "perplexity"} <= set(python["switchhead_lambada"])


def test_lambada_scores_equal_hand_computed_token_logprobs(python_run, loaded, shared_data):
    model, tokenizer = loaded
    samples = python_run["samples"]["switchhead_lambada"]
    assert len(samples) == LIMIT
    rows = task_data.lambada_rows({"data_dir": str(shared_data)})[:LIMIT]
    hand = []
    for sample, row in zip(samples, rows):
        context, word = row["text"].rsplit(" ", 1)
        whole = tokenizer(context + " " + word).input_ids
        n_context = len(tokenizer(context).input_ids)
        logprob, greedy = hand_logprob(model, tokenizer, whole[:n_context], whole[n_context:])
        lm_eval_logprob, lm_eval_greedy = sample["filtered_resps"][0]
        assert float(lm_eval_logprob) == pytest.approx(logprob, abs=1e-3)
        assert (lm_eval_greedy in (True, "True")) == greedy
        hand.append((logprob, greedy))
    metrics = summarize(python_run)["switchhead_lambada"]
    assert metrics["perplexity"] == pytest.approx(math.exp(-sum(l for l, _ in hand) / len(hand)), rel=1e-4)
    assert metrics["acc"] == sum(g for _, g in hand) / len(hand)
    paper = paper_lambada(ContinuationScorer(model, tokenizer, batch_size=2), rows)
    assert paper["acc"] == metrics["acc"] and paper["perplexity"] == pytest.approx(metrics["perplexity"], rel=1e-4)


def test_blimp_scores_equal_hand_computed_sentence_logprobs(python_run, loaded, shared_data):
    model, tokenizer = loaded
    eos = tokenizer.eos_token_id
    for paradigm in PARADIGMS:
        samples = python_run["samples"][f"switchhead_blimp_{paradigm}"]
        rows = task_data.blimp_rows(paradigm, {"data_dir": str(shared_data)})[:LIMIT]
        lm_eval_wins, paper_wins = [], []
        for sample, row in zip(samples, rows):
            # lm-eval: " " + sentence after the EOS token; the authors: the sentence as is
            good, bad = (hand_logprob(model, tokenizer, [eos], tokenizer(" " + row[k]).input_ids)[0]
                         for k in ("sentence_good", "sentence_bad"))
            assert [float(r[0]) for r in sample["filtered_resps"]] == pytest.approx([good, bad], abs=1e-3)
            lm_eval_wins.append(good > bad)
            good, bad = (hand_logprob(model, tokenizer, [eos], tokenizer(row[k]).input_ids)[0]
                         for k in ("sentence_good", "sentence_bad"))
            paper_wins.append(good > bad)
        assert summarize(python_run)[f"switchhead_blimp_{paradigm}"]["acc"] == sum(lm_eval_wins) / LIMIT
        assert paper_blimp(ContinuationScorer(model, tokenizer), rows)["acc"] == sum(paper_wins) / LIMIT


def test_wikitext_articles_and_every_blimp_paradigm_have_tasks(shared_data):
    pages = task_data.wikitext_documents("wikitext-2", "test", {"data_dir": str(shared_data)})
    # 62 articles, as in lm-eval's wikitext-2 test split; each starts with its title line (no leading " \n")
    assert len(pages) == 62 and all(p["page"].startswith(" = ") and p["page"][3] != "=" for p in pages)
    paradigms = task_data.blimp_paradigms({"data_dir": str(shared_data)})
    assert len(paradigms) == 67
    group = yaml.safe_load((TASKS_DIR / "switchhead_blimp.yaml").read_text())
    assert group["task"] == [f"switchhead_blimp_{p}" for p in paradigms]
    assert group["aggregate_metric_list"][0]["weight_by_size"] is False  # mean over paradigms, as the paper
    for paradigm in paradigms:
        assert (TASKS_DIR / f"switchhead_blimp_{paradigm}.yaml").is_file()


def test_missing_data_gives_an_error_naming_the_setting(tmp_path):
    with pytest.raises(FileNotFoundError, match="SWITCHHEAD_LAMBADA_PATH"):
        task_data.lambada_rows({"data_dir": str(tmp_path)})
    (tmp_path / "blimp").mkdir()
    relative = task_data.data_path("blimp_dir", {"data_dir": os.path.relpath(tmp_path, TASKS_DIR)})
    assert relative == (tmp_path / "blimp").resolve()  # relative paths resolve against the task folder


CBT_TEXT = """1 Once upon a time there was a little dog .
2 The dog liked to run in the park .
3 One day the dog met a cat .
21 The dog chased the XXXXX .\tcat\t\tcat|park|time|dog|day|upon|once|little|run|liked

1 Mary had a red ball .
2 She threw the ball to Tom .
21 Tom caught the XXXXX .\tball\t\tball|Mary|Tom|red|She|threw|had|caught|to|the
"""


def test_cbt_reader_and_paper_protocol_pick_the_best_mean_token_logprob(tmp_path, loaded):
    model, tokenizer = loaded
    (tmp_path / "cbtest_CN_test_2500ex.txt").write_text(CBT_TEXT)
    rows = task_data.cbt_rows("CN", {"cbt_dir": str(tmp_path)})
    assert len(rows) == 2 and rows[0]["choices"][0] == "The dog chased the cat ." and rows[1]["label"] == 0
    assert rows[0]["context"].startswith("Once upon a time") and len(rows[0]["options"]) == 10
    expected = []
    for row in rows:
        means = []
        for choice in row["choices"]:
            whole = tokenizer(row["context"] + " " + choice).input_ids
            n_context = len(tokenizer(row["context"]).input_ids)
            logprob, _ = hand_logprob(model, tokenizer, whole[:n_context], whole[n_context:])
            means.append(logprob / (len(whole) - n_context))
        expected.append(max(range(10), key=means.__getitem__) == row["label"])
    assert paper_cbt(ContinuationScorer(model, tokenizer, batch_size=4), rows)["acc"] == sum(expected) / 2
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(TASKS_DIR), metadata={"cbt_dir": str(tmp_path)}).load(
        ["switchhead_cbt_cn"])["tasks"]["switchhead_cbt_cn"]
    doc = task.eval_docs[0]
    assert task.doc_to_choice(doc) == rows[0]["choices"] and task.doc_to_target(doc) == 0


# ---------------------------------------------------------------------------------------------------- perplexity
def test_perplexity_windows_score_every_token_once():
    from switchhead.evaluation.perplexity import windows

    sliding = windows(100, context=16, stride=5, protocol="sliding")
    scored = [t for start, end, first in sliding for t in range(first, end)]
    assert scored == list(range(1, 100))
    assert all(end - start <= 16 and first - start >= 16 - 5 for start, end, first in sliding[1:])
    chunked = windows(100, context=16, stride=16, protocol="chunked")
    assert [t for _, end, first in chunked for t in range(first, end)] == [t for t in range(1, 100) if t % 16]
    with pytest.raises(ValueError, match="stride"):
        windows(100, context=16, stride=16, protocol="sliding")


def test_perplexity_equals_a_single_forward_when_the_text_fits(loaded, shared_data):
    from switchhead.evaluation.perplexity import evaluate_perplexity

    model, tokenizer = loaded
    text = (shared_data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")[:200]
    ids = tokenizer(text).input_ids
    assert len(ids) < 128
    nll = -hand_logprob(model, tokenizer, ids[:1], ids[1:])[0]
    for protocol in ("sliding", "chunked"):
        result = evaluate_perplexity(model, tokenizer, text, context=128, protocol=protocol, progress=False)
        assert result.scored_tokens == len(ids) - 1
        assert result.nll == pytest.approx(nll, rel=1e-5)
        assert result.perplexity == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-5)
        assert result.bits_per_byte == pytest.approx(nll / math.log(2) / len(text.encode()), rel=1e-5)
    long_text = (shared_data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")[:3000]
    sliding = evaluate_perplexity(model, tokenizer, long_text, context=32, stride=8, progress=False)
    chunked = evaluate_perplexity(model, tokenizer, long_text, context=32, protocol="chunked", progress=False)
    assert sliding.scored_tokens == sliding.tokens - 1 > chunked.scored_tokens


# ---------------------------------------------------------------------------------------------------- plots
def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


@pytest.mark.parametrize("preset", ["tiny-switchall"])
def test_attention_and_expert_plots_are_nonempty_pngs_of_the_requested_size(preset, loaded, tmp_path):
    from matplotlib.image import imread

    from switchhead.evaluation.analysis import analyse

    _, tokenizer = loaded
    config = SwitchHeadConfig.from_preset(preset, vocab_size=len(tokenizer))
    written = analyse(SwitchHeadForCausalLM(config), tokenizer, "The cat sat on the mat.", tmp_path, size=(640, 480))
    names = sorted(p.name for p in written)
    assert names == sorted([f"attention_layer{i}_{kind}.png" for i in range(2) for kind in ("max", "heads")]
                           + [f"experts_layer{i}.png" for i in range(2)])
    for path in written:
        assert png_size(path) == (640, 480)
        pixels = imread(path)
        assert pixels.std() > 0.05  # something was drawn


def test_expert_selection_gates_keep_top_k_per_head():
    from switchhead.evaluation.analysis import selected_gates

    logits = torch.tensor([[3.0, -1.0, 2.0, 0.0, -2.0, 1.0, 4.0, -3.0]])  # 2 heads x 4 experts
    gates = selected_gates(logits, groups=2, top_k=2)
    assert (gates > 0).tolist() == [[True, False, True, False, False, True, True, False]]
    assert gates[0, 0] == pytest.approx(torch.sigmoid(torch.tensor(3.0)).item())


# ---------------------------------------------------------------------------------------------------- CLI, card, publish
def test_eval_cli_paper_protocol_perplexity_plots_then_card_with_model_index(model_dir, shared_data, tmp_path):
    results = tmp_path / "results.json"
    text_file = tmp_path / "text.txt"
    text_file.write_text((shared_data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")[:2000])
    assert main(["eval", str(model_dir), "--tasks", "lambada,blimp", "--blimp-paradigms", ",".join(PARADIGMS),
                 "--protocol", "paper", "--limit", "4", "--data-dir", str(shared_data), "--perplexity", str(text_file),
                 "--context", "64", "--plots", str(tmp_path / "plots"), "--output", str(results)]) == 0
    report = json.loads(results.read_text())
    assert set(report["results"]) == {"switchhead_lambada", "switchhead_blimp"} | {
        f"switchhead_blimp_{p}" for p in PARADIGMS}
    blimp = report["results"]["switchhead_blimp"]["acc"]
    assert blimp == pytest.approx(sum(report["results"][f"switchhead_blimp_{p}"]["acc"] for p in PARADIGMS) / 2)
    assert report["perplexity"][0]["protocol"] == "sliding" and report["perplexity"][0]["context"] == 64
    assert len(list((tmp_path / "plots").glob("*.png"))) == 6

    card_path = tmp_path / "README.md"
    assert main(["card", str(model_dir), "--results", str(results), "--repo-id", "me/tiny-switchhead",
                 "--training-data", "Randomly initialised (test).", "--dataset", "wikitext",
                 "--output", str(card_path)]) == 0
    text = card_path.read_text()
    assert text.startswith("---\n")
    metadata = yaml.safe_load(text.split("---\n")[1])
    assert metadata["library_name"] == "transformers" and metadata["datasets"] == ["wikitext"]
    [index] = metadata["model-index"]
    assert index["name"] == "tiny-switchhead"
    metrics = {(r["dataset"]["type"], m["type"]): m["value"] for r in index["results"] for m in r["metrics"]}
    lambada = report["results"]["switchhead_lambada"]
    assert metrics[("lambada", "accuracy")] == pytest.approx(lambada["acc"], abs=1e-4)
    assert metrics[("lambada", "perplexity")] == pytest.approx(lambada["perplexity"], rel=1e-4)
    assert metrics[("blimp", "accuracy")] == pytest.approx(blimp, abs=1e-4)
    assert metrics[("text", "perplexity")] == pytest.approx(report["perplexity"][0]["perplexity"], rel=1e-4)
    assert "first 4 examples" in text and "Randomly initialised (test)." in text
    # the task table: the lm-eval built-in each task repeats, the data version read, the paper protocol apart
    assert "`lambada_openai`" in text and "`wikitext-2-raw-v1`" in text and "The authors' protocol" in text
    assert "PAPER.md" not in text and metadata["license"] == "apache-2.0"  # the package's licence, by default
    assert "Attention cost per layer" in text
    from huggingface_hub import ModelCard

    parsed = ModelCard(text).data.eval_results
    assert {(r.dataset_type, r.metric_type) for r in parsed} == set(metrics)


def test_root_model_card_is_the_packaged_template():
    root = Path(__file__).resolve().parents[2] / "model_card.md"
    from switchhead.model_card import TEMPLATE_PATH

    assert root.resolve() == TEMPLATE_PATH.resolve()
    assert "{{ card_data }}" in root.read_text()


class FakeHub:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda **kwargs: self.calls.append((name, kwargs))


def test_publish_creates_repo_uploads_folder_then_card_without_network(model_dir, tmp_path, capsys):
    from argparse import Namespace

    from switchhead.cli.evaluate import run_publish

    hub = FakeHub()
    args = Namespace(model=str(model_dir), repo="me/tiny-switchhead", private=True, token=None, results=None,
                     training_data=None, dataset=[], license=None)
    assert run_publish(args, api=hub) == 0
    assert [name for name, _ in hub.calls] == ["create_repo", "create_commit"]
    assert hub.calls[0][1]["repo_id"] == "me/tiny-switchhead" and hub.calls[0][1]["private"] is True
    [card] = [op for op in hub.calls[1][1]["operations"] if op.path_in_repo == "README.md"]
    assert card.path_or_fileobj.startswith(b"---\n")  # the allow-list itself: tests/evaluation/test_publish.py
    assert "huggingface.co/me/tiny-switchhead" in capsys.readouterr().out
    from switchhead.evaluation.card import publish

    with pytest.raises(ValueError, match="owner/name"):
        publish(model_dir, "no-owner", "card", api=hub)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        publish(tmp_path, "me/x", "card", api=hub)


def test_eval_and_card_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert main(["card", str(tmp_path)]) == 2
    assert main(["eval", str(tmp_path), "--tasks", "nope"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("switchhead ") for line in errors)


# ---------------------------------------------------------------------------------------------------- task names, CLI
def test_task_names_follow_lm_eval_and_the_list_names_each_counterpart(capsys):
    from switchhead.evaluation.zero_shot import TASK_CATALOGUE, expand_tasks

    assert expand_tasks(["wikitext"]) == ["switchhead_wikitext2"]  # lm-eval's `wikitext` is WikiText-2
    assert expand_tasks(["wikitext103"]) == ["switchhead_wikitext103"]
    assert expand_tasks(["lambada", "blimp"]) == ["switchhead_lambada", "switchhead_blimp"]
    assert main(["eval", "--tasks"]) == 0 and main(["eval", "--tasks", "list"]) == 0
    printed = capsys.readouterr().out
    listing = printed.split("\n\n")[0]
    assert "wikitext: lm-eval reads the raw files (wikitext-2-raw-v1)" in printed  # the deviation is stated
    for name, alias in TASK_CATALOGUE.items():
        [row] = [line for line in listing.splitlines() if line.split()[0] == name]
        assert alias.lm_eval in row and ",".join(alias.tasks) in row and alias.data in row
    from lm_eval.tasks import TaskManager

    import lm_eval.tasks
    builtin = TaskManager(include_defaults=False, include_path=[Path(lm_eval.tasks.__file__).parent / d
                                                                for d in ("lambada", "blimp", "wikitext")]).all_tasks
    named = {alias.lm_eval.split()[0] for alias in TASK_CATALOGUE.values() if not alias.lm_eval.startswith("none")}
    assert named == {"lambada_openai", "blimp", "wikitext"} and named <= set(builtin)


def test_plots_or_perplexity_alone_run_no_zero_shot_tasks(model_dir, shared_data, tmp_path, monkeypatch):
    from switchhead.evaluation import zero_shot

    def refuse(*args, **kwargs):
        raise AssertionError("a zero-shot task ran although --tasks named none")

    monkeypatch.setattr(zero_shot, "run_lm_eval", refuse)
    monkeypatch.setattr(zero_shot, "run_paper_protocol", refuse)
    text_file = tmp_path / "text.txt"
    text_file.write_text((shared_data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")[:1000])
    out = tmp_path / "ppl.json"
    assert main(["eval", str(model_dir), "--perplexity", str(text_file), "--context", "64", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["results"] == {} and len(report["perplexity"]) == 1
    out = tmp_path / "plots.json"
    assert main(["eval", str(model_dir), "--plots", str(tmp_path / "plots"), "--output", str(out)]) == 0
    assert json.loads(out.read_text())["results"] == {} and len(list((tmp_path / "plots").glob("*.png"))) == 6
    # without --perplexity / --plots the default task set runs (here: the refusing stand-in is called)
    with pytest.raises(AssertionError, match="zero-shot task ran"):
        main(["eval", str(model_dir), "--limit", "1"])


def test_progress_writes_few_plain_lines_to_a_log():
    import io

    from switchhead.evaluation.progress import Progress

    log = io.StringIO()
    with Progress(139_153, "zero-shot log-likelihood", stream=log, interval=3600) as bar:
        for _ in range(1000):
            bar.update(139)
        bar.update(153)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2  # the first update and the end, nothing in between
    assert lines[-1].startswith("zero-shot log-likelihood: 139,153/139,153 requests (100%)")


def test_one_bar_lm_gives_lm_eval_numbers_without_its_bars(model_dir, shared_data, capfd):
    """Our HFLM subclass (one progress report per request type) against lm-eval's own HFLM, same requests."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from switchhead.evaluation.zero_shot import _one_bar_hflm_class

    rows = task_data.lambada_rows({"data_dir": str(shared_data)})[:30]
    pairs = [(row["text"].rsplit(" ", 1)[0][-100:], " " + row["text"].rsplit(" ", 1)[1]) for row in rows]
    requests = [Instance("loglikelihood", {}, pair, 0) for pair in pairs]
    pages = [(row["text"][:300],) for row in rows[:3]]
    rolling = [Instance("loglikelihood_rolling", {}, page, 0) for page in pages]
    arguments = f"pretrained={model_dir},trust_remote_code=True"
    ours = _one_bar_hflm_class().create_from_arg_string(arguments, {"batch_size": 4, "device": "cpu"})
    ours.progress_interval = 3600
    capfd.readouterr()
    got, got_rolling = ours.loglikelihood(requests), ours.loglikelihood_rolling(rolling)
    err = capfd.readouterr().err
    # plain lines, not lm-eval's bars: the first slice and the end (30 requests in slices of 4), then the 3
    # documents in one slice
    assert "\r" not in err and err.splitlines() == [line for line in err.splitlines() if "zero-shot" in line]
    assert [line.split(" (")[0] for line in err.splitlines()] == [
        "zero-shot log-likelihood: 4/30 requests", "zero-shot log-likelihood: 30/30 requests",
        "zero-shot rolling log-likelihood: 3/3 documents"], err
    reference = HFLM.create_from_arg_string(arguments, {"batch_size": 4, "device": "cpu"})
    expected, expected_rolling = reference.loglikelihood(requests), reference.loglikelihood_rolling(rolling)
    assert [g for _, g in got] == [g for _, g in expected]
    assert [l for l, _ in got] == pytest.approx([l for l, _ in expected], abs=1e-4)
    assert got_rolling == pytest.approx(expected_rolling, abs=1e-4)


def test_lm_eval_per_request_warnings_become_one_summary_line(caplog):
    import logging

    from switchhead.evaluation.zero_shot import _quiet_lm_eval

    hf_logger, task_logger = logging.getLogger("lm_eval.models.huggingface"), logging.getLogger("lm_eval.api.task")
    with caplog.at_level(logging.WARNING):
        with _quiet_lm_eval():
            for _ in range(500):
                hf_logger.warning("Combined length of context (136) and continuation (3) exceeds model's maximum "
                                  "length (128). Truncating 12 tokens from the left.")
            task_logger.warning("switchhead_lambada: Custom kwargs can be passed to `--metadata` in console")
            task_logger.warning("something else")
        hf_logger.warning("Combined length of context (1) after the run")  # filters removed again
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["something else",
                        "500 lm-eval requests were longer than the model's context; lm-eval kept their last tokens",
                        "Combined length of context (1) after the run"]


@pytest.mark.integration
def test_lm_eval_records_the_commit_without_git_writing_to_the_terminal(tmp_path, monkeypatch, capfd):
    """lm-eval runs `git describe` with the caller's stderr; outside a checkout that printed "fatal: not a git
    repository" into every `switchhead eval`. While our evaluation runs, its probe is a quiet one."""
    import lm_eval.evaluator

    from switchhead.evaluation import zero_shot

    monkeypatch.chdir(tmp_path)  # not a checkout
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    with zero_shot._quiet_lm_eval():
        assert lm_eval.evaluator.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""
    assert lm_eval.evaluator.get_git_commit_hash is not zero_shot._quiet_git_commit  # restored afterwards
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    with zero_shot._quiet_lm_eval():
        assert len(lm_eval.evaluator.get_git_commit_hash() or "") >= 7  # a checkout: its commit, as before


def test_perplexity_tokenizes_the_whole_text_without_transformers_length_warning(loaded, shared_data):
    """The text is scored in windows of the context, so the tokenizer's 'Token indices sequence length is longer
    than the specified maximum sequence length' warning (printed by `switchhead eval --perplexity`) is wrong there."""
    import logging

    from switchhead.evaluation.perplexity import evaluate_perplexity

    model, tokenizer = loaded
    text = (shared_data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")[:3000]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    # a command run earlier in this process (switchhead.cli.quiet_library_noise) filters the warning at its logger
    # for good: take those filters off, so that only evaluate_perplexity's own silencing is tested
    source_logger = logging.getLogger("transformers.tokenization_utils_base")
    source_filters = list(source_logger.filters)
    saved = tokenizer.model_max_length, dict(tokenizer.deprecation_warnings)
    tokenizer.model_max_length = 64
    tokenizer.deprecation_warnings.clear()
    transformers_logger.addHandler(handler)
    for source_filter in source_filters:
        source_logger.removeFilter(source_filter)
    try:
        evaluate_perplexity(model, tokenizer, text, context=64, progress=False)
        during_evaluation = [r.getMessage() for r in records]
        tokenizer(text)  # a plain call of the same tokenizer warns: the handler does see the warning
    finally:
        transformers_logger.removeHandler(handler)
        for source_filter in source_filters:
            source_logger.addFilter(source_filter)
        tokenizer.model_max_length, tokenizer.deprecation_warnings = saved[0], saved[1]
    assert not any("Token indices sequence length" in m for m in during_evaluation), during_evaluation
    assert any("Token indices sequence length" in r.getMessage() for r in records)


def test_eval_output_names_the_model_as_given(model_dir, shared_data, tmp_path, monkeypatch):
    """`eval --output` records the model as the user named it, not the absolute folder of the machine that ran it."""
    text_file = tmp_path / "text.txt"
    text_file.write_text((shared_data / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")[:500])
    monkeypatch.chdir(model_dir.parent)
    out = tmp_path / "ppl.json"
    assert main(["eval", model_dir.name, "--perplexity", str(text_file), "--context", "64", "--output",
                 str(out)]) == 0
    assert json.loads(out.read_text())["model"] == model_dir.name
