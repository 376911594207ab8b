"""`switchhead train --demo`: the paper's comparison in miniature, on any machine, in minutes.

Trains a tiny SwitchHead model and a dense multi-head baseline with the same number of parameters on the
embedded Python standard library corpus (its reference documentation and sources: no download, no data on
disk), prints validation perplexity, attention MACs and attention memory side by side, saves both models,
reloads one with `AutoModelForCausalLM` and generates a sample.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from .. import SwitchHeadConfig, SwitchHeadForCausalLM
from ..evaluation.accounting import attention_macs, attention_memory
from ..training.data import load_documents, train_tokenizer
from ..training.trainer import TrainingConfig, TrainingError, train

DEMO_PRESET = "tiny-switchhead"
DEMO_DENSE_PRESET = "tiny-dense"  # the same shape with dense attention; its MLP is widened to match parameters
DEMO_DENSE_HEADS = 4  # the baseline has as many heads as SwitchHead has (heads x active experts)
DEMO_TRAINING = dict(max_steps=1500, eval_every=500, save_every=500, log_every=50, eval_batches=20)
DEMO_PROMPT = "def read_file(path):\n"


def parameter_matched_dense(config: SwitchHeadConfig, num_heads: int) -> dict:
    """Model overrides that turn `config` into a dense baseline with `num_heads` heads and (as nearly as an integer
    feed-forward width allows) the same parameter count: the paper's matching, done by widening the MLP."""

    def count(**overrides) -> int:
        fields = {**config.to_diff_dict(), "attention_type": "dense", "num_attention_heads": num_heads, **overrides}
        fields.pop("model_type", None)
        fields.pop("transformers_version", None)
        with torch.device("meta"):
            return SwitchHeadForCausalLM(SwitchHeadConfig(**fields)).num_parameters()

    with torch.device("meta"):
        target = SwitchHeadForCausalLM(config).num_parameters()
    base, slope = count(intermediate_size=1), count(intermediate_size=2) - count(intermediate_size=1)
    width = max(1, round((target - base) / slope) + 1)
    return dict(attention_type="dense", num_attention_heads=num_heads, intermediate_size=width)


def _format(number: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.2f}{unit}"
    return f"{number:.0f}"


def results_table(rows) -> list[str]:
    """The demo's table: one (label, parameters, validation perplexity, attention MACs, attention memory, wall
    seconds, CPU seconds) row per model, then what the two times are (neither is a speed comparison)."""
    lines = [f"{'model':28s} {'params':>8s} {'valid ppl':>10s} {'attn MACs':>10s} {'attn memory':>12s} "
             f"{'wall min':>8s} {'CPU min':>8s}"]
    for label, parameters, perplexity, macs, memory, wall, cpu in rows:
        lines.append(f"{label:28s} {_format(parameters):>8s} {perplexity:10.2f} {_format(macs):>10s} "
                     f"{_format(memory):>12s} {wall / 60:8.1f} {cpu / 60:8.1f}")
    lines.append("(wall min: elapsed time, which other work on the machine stretches; CPU min: the processor time "
                 "the training took. Neither compares speed: benchmarks/ times the models interleaved.)")
    return lines


def run_demo(output_dir: str = "runs/demo", **training_overrides) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.exists(output_dir) and os.listdir(output_dir):
        raise TrainingError(f"demo output folder {output_dir!r} is not empty: remove it or pass --output-dir")
    settings = {**DEMO_TRAINING, **training_overrides}
    base = TrainingConfig.from_preset(DEMO_PRESET, **settings)

    # one tokenizer for both models, so that their perplexities compare
    print(f"demo: training a {base.vocab_size}-token BPE tokenizer on the Python standard library corpus")
    train_documents, _ = load_documents(base.data, base.text_field, base.valid_data, base.valid_fraction)
    tokenizer_dir = os.path.join(output_dir, "tokenizer")
    train_tokenizer(train_documents, base.vocab_size).save_pretrained(tokenizer_dir)

    switchhead_config = SwitchHeadConfig.from_preset(DEMO_PRESET)
    dense = parameter_matched_dense(switchhead_config, DEMO_DENSE_HEADS)
    # each model trains as its own preset, so the trainer's summary line and progress bar name it for what it is
    runs = {
        f"SwitchHead (H={switchhead_config.num_attention_heads}, E={switchhead_config.num_attention_experts}, "
        f"k={switchhead_config.num_attention_experts_per_tok})": (DEMO_PRESET, {}),
        f"Dense (H={DEMO_DENSE_HEADS})": (DEMO_DENSE_PRESET, dense),
    }
    rows = []
    for (label, (preset, model_overrides)), folder in zip(runs.items(), ("switchhead", "dense")):
        what = ("the SwitchHead model" if preset == DEMO_PRESET else
                f"the dense-attention baseline, its MLP widened to {dense['intermediate_size']} to match parameters")
        print(f"demo: training {label}: {what} (preset {preset})")
        config = dataclasses.replace(base, preset=preset, output_dir=os.path.join(output_dir, folder),
                                     tokenizer=tokenizer_dir, model={**base.model, **model_overrides})
        cpu_started = time.process_time()
        result = train(config)
        cpu_seconds = time.process_time() - cpu_started  # CPU time: a busy machine does not stretch it
        model_config = SwitchHeadConfig.from_pretrained(result.output_dir)
        macs = attention_macs(model_config, config.block_size)
        memory = attention_memory(model_config, config.block_size)
        rows.append((label, result, macs, memory, result.output_dir, cpu_seconds))

    print(f"\nvalidation on held-out standard library text, context {base.block_size}, {base.max_steps} steps "
          f"(unigram perplexity {rows[0][1].unigram_perplexity:.1f}); attention cost per layer and sequence "
          "(the paper's table formulas, as `switchhead flops` computes them):")
    print("\n".join(results_table([(label, result.num_parameters, result.valid_perplexity, macs, memory,
                                     result.seconds, cpu) for label, result, macs, memory, _, cpu in rows])))
    dense_macs, dense_memory = rows[1][2], rows[1][3]
    print(f"SwitchHead uses {rows[0][2] / dense_macs:.0%} of the dense attention MACs and "
          f"{rows[0][3] / dense_memory:.0%} of its attention memory.")

    folder = rows[0][4]
    print(f"\ndemo: reloading {folder} with AutoModelForCausalLM and sampling from the prompt {DEMO_PROMPT!r}:")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(0)
    inputs = tokenizer(DEMO_PROMPT, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=60, do_sample=True, temperature=0.8, top_k=40,
                            pad_token_id=tokenizer.pad_token_id)
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0
