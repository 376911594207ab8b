"""Fine-tuning with the Transformers Trainer: gradient accumulation lowers the loss on real text; the result reloads."""

import math

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

BLOCK = 64


def wikitext_blocks(shared_data, split: str, characters: int, tokenizer: PreTrainedTokenizerFast) -> Dataset:
    text = (shared_data / "wikitext-2" / f"wiki.{split}.tokens").read_text(encoding="utf-8")[:characters]
    ids = tokenizer(text)["input_ids"]
    blocks = [ids[i: i + BLOCK] for i in range(0, len(ids) - BLOCK + 1, BLOCK)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def small_bpe(shared_data) -> PreTrainedTokenizerFast:
    text = (shared_data / "wikitext-2" / "wiki.train.tokens").read_text(encoding="utf-8")[:200_000]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(text.splitlines(), trainers.BpeTrainer(vocab_size=512,
                                                                         special_tokens=["<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<eos>")


def mean_loss(model, dataset: Dataset) -> float:
    model.eval()
    with torch.no_grad():
        ids = torch.tensor(dataset["input_ids"])
        return model(ids, labels=ids).loss.item()


def test_trainer_with_gradient_accumulation_lowers_loss_and_reloads(shared_data, tmp_path):
    tokenizer = small_bpe(shared_data)
    train = wikitext_blocks(shared_data, "train", 120_000, tokenizer)
    valid = wikitext_blocks(shared_data, "valid", 20_000, tokenizer)
    config = SwitchHeadConfig.from_preset("tiny-switchall", vocab_size=len(tokenizer),
                                          pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config)
    before = mean_loss(model, valid)
    assert before > math.log(len(tokenizer)) - 1.0  # an untrained model is near uniform

    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_steps=40, learning_rate=3e-3, warmup_steps=4, lr_scheduler_type="cosine", logging_steps=5,
        save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train)
    result = trainer.train()
    assert result.global_step == 40
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged[-1] < logged[0]

    after = mean_loss(model, valid)
    assert after < before - 1.0, (before, after)

    trainer.save_model(str(tmp_path / "final"))
    tokenizer.save_pretrained(str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    ids = torch.tensor(valid["input_ids"][:2])
    model.eval()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    assert abs(mean_loss(reloaded, valid) - after) < 1e-6
