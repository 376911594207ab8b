"""TRL as a real client: `SFTTrainer` (full fine-tuning and LoRA through `peft_config`) and `DPOTrainer` run a few steps
on tiny RoPE, XL and SwitchAll models saved as folders, as a TRL user would give them. The data are BLiMP minimal
pairs (`determiner_noun_agreement_1`: "Raymond is selling this sketch." / "... this sketches."): SFT on the good
sentences, DPO with the shared prefix as the prompt, the good continuation chosen and the bad one rejected.
Each run's loss is finite and falls.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("trl", reason="the test extra pins trl")
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402
from switchhead.training.finetune import lora_targets, register_switchhead_modules  # noqa: E402

PRESETS = ["tiny-switchhead", "tiny-switchhead-xl", "tiny-switchall"]  # RoPE, XL, SwitchAll
PARADIGM = "determiner_noun_agreement_1"


@pytest.fixture
def pairs(shared_data) -> list[dict]:
    lines = (shared_data / "blimp" / f"{PARADIGM}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:400]]


def _tokenizer(pairs: list[dict]) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.WordLevel(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    texts = [pair[key] for pair in pairs for key in ("sentence_good", "sentence_bad")]
    backend.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def _folder(tmp_path, preset: str, tokenizer) -> str:
    """A saved model folder with its tokenizer: what a TRL user passes."""
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset(preset, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                          eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    folder = str(tmp_path / preset)
    SwitchHeadForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _common(tmp_path, steps: int, learning_rate: float) -> dict:
    return dict(output_dir=str(tmp_path / "run"), max_steps=steps, per_device_train_batch_size=8,
                learning_rate=learning_rate, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, lr_scheduler_type="constant")


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _assert_falls(losses: list[float], window: int = 3) -> None:
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    assert last < first, losses


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("preset", PRESETS)
def test_sft_trainer_loss_falls(preset, lora, pairs, tmp_path):
    tokenizer = _tokenizer(pairs)
    folder = _folder(tmp_path, preset, tokenizer)
    dataset = Dataset.from_dict({"text": [pair["sentence_good"] for pair in pairs]})
    model = SwitchHeadForCausalLM.from_pretrained(folder)
    # with the attention wrapper registered: PEFT 0.22 cannot adapt q_proj / k_proj inside SwitchHead attention
    # whose experts it has wrapped without it (tests/training/test_peft.py)
    config = LoraConfig(r=8, lora_alpha=16, **lora_targets(model))
    peft_config = register_switchhead_modules(config) if lora else None
    args = SFTConfig(**_common(tmp_path, steps=16, learning_rate=1e-2 if lora else 3e-3), max_length=32)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    if lora:  # TRL wrapped the model with PEFT: only the LoRA factors train, every expert tensor among them
        assert all(("lora_" in name) == parameter.requires_grad for name, parameter in trainer.model.named_parameters())
        wrapped = {m.parameter_name for m in trainer.model.modules() if hasattr(m, "parameter_name")}
        assert wrapped == set(lora_targets(model)["target_parameters"])
    trainer.train()
    _assert_falls(_losses(trainer))


def _preference_data(pairs: list[dict]) -> Dataset:
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for pair in pairs:
        prefix = pair["one_prefix_prefix"]
        good, bad = pair["sentence_good"], pair["sentence_bad"]
        if good.startswith(prefix) and bad.startswith(prefix):
            rows["prompt"].append(prefix)
            rows["chosen"].append(good[len(prefix):])
            rows["rejected"].append(bad[len(prefix):])
    return Dataset.from_dict(rows)


@pytest.mark.parametrize("preset", PRESETS)
def test_dpo_trainer_loss_falls(preset, pairs, tmp_path):
    tokenizer = _tokenizer(pairs)
    folder = _folder(tmp_path, preset, tokenizer)
    dataset = _preference_data(pairs[:32])  # four passes over the same pairs: the margin the steps learn shows
    assert len(dataset) == 32
    args = DPOConfig(**_common(tmp_path, steps=16, learning_rate=3e-3), max_length=32, beta=0.1)
    trainer = DPOTrainer(model=folder, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    losses = _losses(trainer)
    assert abs(losses[0] - math.log(2)) < 0.05  # policy = reference at the start: -log sigmoid(0)
    _assert_falls(losses)
