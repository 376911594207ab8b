"""Task heads: sequence classification, token classification and question answering on the SwitchHead stack.

They are Transformers' generic heads (as for Llama and Mixtral), registered with the Auto classes and listed in the
`auto_map` of every saved folder, so that a causal LM's folder loads as a classifier with a new head (with or
without this package), and a fine-tuned classifier trains with `Trainer` on a real task.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    DataCollatorWithPadding,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    pipeline,
)

from switchhead import (
    SwitchHeadConfig,
    SwitchHeadForCausalLM,
    SwitchHeadForQuestionAnswering,
    SwitchHeadForSequenceClassification,
    SwitchHeadForTokenClassification,
)
from helpers.clean_venv import clean_venv, run_checked

HEADS = {  # Auto class -> (our class, the head's parameter names, output fields and their shapes for [B, T] inputs)
    AutoModelForSequenceClassification: (SwitchHeadForSequenceClassification, {"score.weight"},
                                         {"logits": lambda b, t: (b, 3)}),
    AutoModelForTokenClassification: (SwitchHeadForTokenClassification, {"score.weight", "score.bias"},
                                      {"logits": lambda b, t: (b, t, 3)}),
    AutoModelForQuestionAnswering: (SwitchHeadForQuestionAnswering, {"qa_outputs.weight", "qa_outputs.bias"},
                                    {"start_logits": lambda b, t: (b, t), "end_logits": lambda b, t: (b, t)}),
}
PRESETS = ["tiny-switchhead", "tiny-switchall", "tiny-dense", "tiny-switchhead-xl"]


def _causal_lm_folder(path, preset: str) -> SwitchHeadForCausalLM:
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset(preset, vocab_size=64, pad_token_id=0)
    model = SwitchHeadForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _labels(auto_class, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    if auto_class is AutoModelForSequenceClassification:
        return {"labels": torch.tensor([0, 2])}
    if auto_class is AutoModelForTokenClassification:
        return {"labels": ids % 3}
    return {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("auto_class", list(HEADS), ids=lambda auto: auto.__name__)
def test_causal_lm_folder_loads_as_task_model_with_a_new_head(auto_class, preset, tmp_path):
    causal = _causal_lm_folder(tmp_path / "lm", preset)
    head_class, head_names, outputs = HEADS[auto_class]
    assert json.loads((tmp_path / "lm" / "config.json").read_text())["auto_map"][auto_class.__name__] == \
        f"modeling_switchhead.{head_class.__name__}"

    model, info = auto_class.from_pretrained(tmp_path / "lm", num_labels=3, output_loading_info=True)
    assert type(model) is head_class
    assert set(info["missing_keys"]) == head_names  # only the new head is initialised
    assert set(info["unexpected_keys"]) == {"lm_head.weight", "lm_head.bias"}  # the LM's head is left behind
    body = causal.model.state_dict()
    for name, tensor in model.model.state_dict().items():
        assert torch.equal(tensor, body[name]), name  # the decoder stack is the causal LM's, unchanged

    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = 0  # the first row is left-padded
    mask = (ids != 0).long()
    out = model(input_ids=ids, attention_mask=mask, **_labels(auto_class, ids))
    for field, shape in outputs.items():
        assert out[field].shape == shape(*ids.shape), field
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(model.get_parameter(name).grad is not None for name in head_names)


@pytest.mark.parametrize("auto_class", list(HEADS), ids=lambda auto: auto.__name__)
def test_task_model_saves_and_reloads_with_identical_outputs(auto_class, tmp_path):
    _causal_lm_folder(tmp_path / "lm", "tiny-switchall")
    model = auto_class.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    model.save_pretrained(tmp_path / "task")
    saved = json.loads((tmp_path / "task" / "config.json").read_text())
    assert {"AutoModelForCausalLM", *(auto.__name__ for auto in HEADS)} <= set(saved["auto_map"])
    assert (tmp_path / "task" / "modeling_switchhead.py").is_file()  # Hub-ready: the code travels with it
    reloaded, info = auto_class.from_pretrained(tmp_path / "task", output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = model(input_ids=ids, use_cache=False), reloaded.eval()(input_ids=ids, use_cache=False)
    assert expected.keys() == got.keys()
    for field, value in expected.items():
        assert torch.equal(got[field], value), field


# Runs in an environment with only torch, transformers and safetensors: the folders' own copy of our code.
CLEAN_SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys
    import torch
    import transformers
    assert importlib.util.find_spec("switchhead") is None, "switchhead must not be importable here"
    lm_folder, task_folder, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
    result = {}
    for name in ("AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                 "AutoModelForQuestionAnswering"):
        model = getattr(transformers, name).from_pretrained(lm_folder, num_labels=3, trust_remote_code=True)
        result[name] = [type(model).__module__, type(model).__name__]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(task_folder, trust_remote_code=True)
    with torch.no_grad():
        result["logits"] = model.eval()(input_ids=ids).logits.tolist()
    print(json.dumps(result))
""")


@pytest.mark.integration
def test_task_heads_load_with_trust_remote_code_without_the_package(tmp_path):
    _causal_lm_folder(tmp_path / "lm", "tiny-switchall")
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    classifier.save_pretrained(tmp_path / "task")
    ids = [[5, 9, 14, 3], [7, 8, 4, 11]]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "VIRTUAL_ENV"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    result = run_checked([str(clean_venv()), "-c", CLEAN_SCRIPT, str(tmp_path / "lm"), str(tmp_path / "task"),
                          json.dumps(ids)], env=env, cwd=tmp_path)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for auto_class, (head_class, _, _) in HEADS.items():
        module, name = out[auto_class.__name__]
        assert module.startswith("transformers_modules.") and name == head_class.__name__
    with torch.no_grad():
        expected = classifier(input_ids=torch.tensor(ids)).logits
    torch.testing.assert_close(torch.tensor(out["logits"]), expected, rtol=1e-5, atol=1e-5)


# ============================================================================================ a real task
BLIMP_PARADIGM = "wh_vs_that_no_gap"  # "Mark figured out that ..." (good) vs "... who ..." (bad); 1,000 pairs


def _blimp(shared_data, first: int, last: int) -> tuple[list[str], list[int]]:
    """Sentences of BLiMP pairs [first, last) of the paradigm: the good ones (label 1), then the bad ones (0)."""
    lines = (shared_data / "blimp" / f"{BLIMP_PARADIGM}.jsonl").read_text(encoding="utf-8").splitlines()[first:last]
    pairs = [json.loads(line) for line in lines]
    return [p["sentence_good"] for p in pairs] + [p["sentence_bad"] for p in pairs], [1] * len(pairs) + [0] * len(pairs)


def _word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-switchhead-xl"])
def test_sequence_classifier_from_a_causal_lm_folder_learns_blimp_with_trainer(shared_data, preset, tmp_path):
    from datasets import Dataset

    train_texts, train_labels = _blimp(shared_data, 0, 800)
    test_texts, test_labels = _blimp(shared_data, 800, 1000)  # held-out pairs
    tokenizer = _word_tokenizer(train_texts)
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset(preset, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    SwitchHeadForCausalLM(config).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=2,
                                                               id2label={0: "bad", 1: "good"})
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=32, max_steps=40,
                             learning_rate=3e-3, logging_steps=10, save_strategy="no", report_to=[], seed=0,
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    train = Dataset.from_dict({**tokenizer(train_texts), "labels": train_labels})
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=DataCollatorWithPadding(tokenizer))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0]

    predicted = trainer.predict(Dataset.from_dict({**tokenizer(test_texts), "labels": test_labels}))
    accuracy = (predicted.predictions.argmax(-1) == predicted.label_ids).mean()
    assert accuracy >= 0.75, accuracy  # chance is 0.5 (balanced); 400 held-out sentences

    classify = pipeline("text-classification", model=trainer.model.eval(), tokenizer=tokenizer)
    labels = [result["label"] for result in classify(test_texts[:3] + test_texts[-3:])]
    assert labels == [model.config.id2label[int(i)] for i in predicted.predictions.argmax(-1)[[0, 1, 2, -3, -2, -1]]]
