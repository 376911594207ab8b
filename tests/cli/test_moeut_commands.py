"""The package's commands on a MoEUT preset (`tiny-moeut`: two shared blocks applied twice, peri-LayerNorm), in one
process on one small training run.

- `train` (Accelerate) saves each shared block once, and a run stopped at step 2 and resumed with `--resume`
  logs the losses of the run that went straight to step 4, and ends with the same weights.
- `generate` prints the greedy tokens of full forwards (no cache), so its cached decoding is exact.
- `eval --perplexity` on WikiText-2's test file gives the negative log-likelihood of one hand-computed forward.
- `finetune` puts one LoRA adapter on each shared block (used by each of its applications) and its merged model
  equals the adapted one.
- `publish` sends the folder (each block once) with a card that names MoEUT.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from switchhead import SwitchHeadForCausalLM
from switchhead.cli import main

pytestmark = pytest.mark.integration  # trains

RUN = ["--preset", "tiny-moeut", "--vocab-size", "512", "--block-size", "32", "--batch-size", "8", "--log-every", "1",
       "--eval-every", "2", "--eval-batches", "2", "--save-every", "2", "--no-progress", "--no-tensorboard"]


def _log(folder) -> list[dict]:
    with open(folder / "log.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _block_indices(weights: dict) -> set[int]:
    return {int(name.split(".")[2]) for name in weights if name.startswith("model.layers.")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(straight, resumed): tiny-moeut trained to step 4 at once, and to step 2 then resumed to step 4."""
    folder = tmp_path_factory.mktemp("moeut")
    text = folder / "text.txt"
    text.write_text("".join(f"Line {i} of a small corpus about lobsters and games.\n" for i in range(3000)))
    straight, resumed = folder / "straight", folder / "resumed"
    assert main(["train", *RUN, "--max-steps", "4", "--data", str(text), "--output-dir", str(straight)]) == 0
    assert main(["train", *RUN, "--max-steps", "2", "--data", str(text), "--output-dir", str(resumed)]) == 0
    assert main(["train", "--output-dir", str(resumed), "--resume", "--max-steps", "4", "--no-progress"]) == 0
    return straight, resumed


def test_train_saves_each_shared_block_once_and_resumes_exactly(runs):
    straight, resumed = runs
    columns = ("step", "loss", "grad_norm", "valid_loss")
    assert [row["step"] for row in _log(straight)] == ["1", "2", "3", "4"]
    assert [[row[c] for c in columns] for row in _log(resumed)] == [[row[c] for c in columns] for row in _log(straight)]
    weights, again = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert _block_indices(weights) == {0, 1}  # 4 applications of 2 blocks: 2 saved
    assert weights.keys() == again.keys() and all(torch.equal(weights[name], again[name]) for name in weights)


def test_generate_prints_the_greedy_tokens_of_full_forwards(runs, capsys):
    from transformers import AutoTokenizer

    straight, _ = runs
    model, tokenizer = SwitchHeadForCausalLM.from_pretrained(straight).eval(), AutoTokenizer.from_pretrained(straight)
    capsys.readouterr()
    assert main(["generate", str(straight), "--prompt", "Line 7 of a", "--max-new-tokens", "12"]) == 0
    tokens = tokenizer("Line 7 of a", return_tensors="pt").input_ids
    with torch.no_grad():
        for _ in range(12):  # no cache: each step reruns the whole sequence
            tokens = torch.cat((tokens, model(tokens, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)), 1)
    assert capsys.readouterr().out.rstrip("\n") == tokenizer.decode(tokens[0], skip_special_tokens=True)


def test_eval_perplexity_on_the_test_data_is_one_forwards_likelihood(runs, shared_data, tmp_path):
    from transformers import AutoTokenizer

    straight, _ = runs
    text = (shared_data / "wikitext-2" / "wiki.test.tokens").read_text(encoding="utf-8")[:110]
    (tmp_path / "test.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "ppl.json"
    assert main(["eval", str(straight), "--perplexity", str(tmp_path / "test.txt"), "--context", "128",
                 "--output", str(out)]) == 0
    model, tokenizer = SwitchHeadForCausalLM.from_pretrained(straight).eval(), AutoTokenizer.from_pretrained(straight)
    ids = torch.tensor([tokenizer(text).input_ids])
    assert ids.shape[1] <= 128  # one window holds the text
    with torch.no_grad():
        nll = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="sum").item()
    [result] = json.loads(out.read_text())["perplexity"]
    assert (result["data"], result["scored_tokens"]) == ("test.txt", ids.shape[1] - 1)
    assert result["nll"] == pytest.approx(nll, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nll / (ids.shape[1] - 1)), rel=1e-5)


def test_finetune_adapts_each_shared_block_once_and_merges_exactly(runs, shared_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from switchhead.training.finetune import load_lora

    straight, _ = runs
    out = tmp_path / "adapter"
    assert main(["finetune", str(straight), "--data", str(shared_data / "wikitext-2"), "--output-dir", str(out),
                 "--rank", "2", "--max-steps", "2", "--batch-size", "4", "--block-size", "32", "--merge",
                 "--no-progress"]) == 0
    adapter = load_file(out / "adapter_model.safetensors")
    assert _block_indices({name.replace("base_model.model.", ""): t for name, t in adapter.items()}) == {0, 1}
    vocab = json.loads((straight / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = load_lora(AutoModelForCausalLM.from_pretrained(straight), str(out)).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


def test_publish_sends_each_block_once_with_a_card_naming_moeut(runs, monkeypatch):
    import huggingface_hub

    straight, _ = runs
    sent = {}

    class Hub:  # records the one commit; uploads nothing
        def __init__(self, token=None):
            pass

        def create_repo(self, **kwargs):
            pass

        def create_commit(self, *, operations, **kwargs):
            for operation in operations:
                source = operation.path_or_fileobj
                sent[operation.path_in_repo] = source if isinstance(source, bytes) else source.read()

    monkeypatch.setattr(huggingface_hub, "HfApi", Hub)
    assert main(["publish", str(straight), "me/tiny-moeut"]) == 0
    assert sent["model.safetensors"] == (straight / "model.safetensors").read_bytes()
    card = sent["README.md"].decode()
    assert "tiny-moeut is a MoEUT language" in card and "https://arxiv.org/abs/2405.16039" in card
    assert "- moeut" in card and "| `layer_group_size` | 2 |" in card
