"""The model card (README.md with Hub metadata) of a finished `switchhead train` or `switchhead finetune` folder,
and the context its saved tokenizer carries.

Like Trainer's `create_model_card`, the card states what was trained and how: the architecture (rendered by
`switchhead.model_card`, the template `switchhead card` uses too), the training settings, the validation losses of
the run's log and the library versions. `switchhead card` / `publish` render a card with evaluation results on top.

A card is ours to replace while it keeps `CARD_MARKER` (its last line): a README.md the user wrote, or edited and
took the line out of, is left as it is.
"""

from __future__ import annotations

import csv
import json
import math
import os
from typing import Any

from ..model_card import render_card

CARD_NAME = "README.md"
CARD_MARKER = ("<!-- written by switchhead when the run finished, and rewritten when it finishes again; delete this "
               "line to keep your edits -->")
# TrainingConfig fields shown as the card's training hyperparameters, in this order
TRAINING_FIELDS = ("preset", "max_steps", "batch_size", "gradient_accumulation_steps", "block_size", "learning_rate",
                   "min_learning_rate", "warmup_steps", "weight_decay", "adam_betas", "grad_clip", "mixed_precision",
                   "seed", "vocab_size", "tokenizer")


def with_context(tokenizer, model_config):
    """`tokenizer` with `model_max_length` at most the model's context (`max_position_embeddings`), in place of the
    1e30 placeholder a tokenizer gets when nobody sets it: pipelines and `truncation=True` then cut inputs to what
    the model reads. A smaller limit the tokenizer already has stays."""
    context = int(model_config.max_position_embeddings)
    current = getattr(tokenizer, "model_max_length", None)
    tokenizer.model_max_length = context if not isinstance(current, int) or current > context else current
    return tokenizer


def framework_versions() -> list[tuple[str, str]]:
    """(library, version) of what trained the model, as Trainer's cards list them."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name, distribution in (("switchhead", "switchhead"), ("Transformers", "transformers"),
                               ("PyTorch", "torch"), ("Accelerate", "accelerate"), ("PEFT", "peft")):
        try:
            found.append((name, version(distribution)))
        except PackageNotFoundError:
            continue
    return found


def _data_name(data: str | None) -> str:
    if data is None or data == "python-stdlib":
        return ("the Python standard library's reference documentation and module sources (the embedded default "
                "corpus of `switchhead train`)")
    return f"`{os.path.basename(os.path.normpath(data))}`" if os.path.exists(data) else f"`{data}` (Hub dataset)"


def _validation_rows(log_path: str) -> list[tuple[Any, ...]]:
    """(step, training loss, validation loss, validation perplexity) of every evaluated step of log.csv."""
    if not os.path.isfile(log_path) or os.path.islink(log_path):
        return []
    with open(log_path, newline="", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("valid_loss")]
    return [(int(row["step"]), f"{float(row['loss']):.4f}", f"{float(row['valid_loss']):.4f}",
             f"{float(row['valid_perplexity']):.2f}") for row in rows]


def train_card(output_dir: str, model_config, settings: dict[str, Any]) -> str:
    """The card text of a `switchhead train` folder: `settings` is its TrainingConfig as a dict (training_config.json),
    the results come from its log.csv."""
    results = _validation_rows(os.path.join(output_dir, "log.csv"))
    steps = results[-1][0] if results else settings.get("max_steps")
    note = (f"Pretrained from random initialisation with `switchhead train` (preset `{settings.get('preset')}`) for "
            f"{steps} steps of {settings.get('batch_size')} sequences of {settings.get('block_size')} tokens: AdamW, "
            "linear warmup then cosine decay of the learning rate.")
    name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    card = render_card(
        model_config, model_name=name, repo_id=name,
        training_data=f"Trained on {_data_name(settings.get('data'))}.",
        training=dict(note=note, rows=[(field, settings[field] if settings[field] is not None or field != "tokenizer"
                                        else "a BPE trained on the training split") for field in TRAINING_FIELDS
                                       if field in settings],
                      results=results, versions=framework_versions()))
    return f"{card}\n\n{CARD_MARKER}\n"


def finetune_card(model_config, *, name: str, base_model: str, settings: dict[str, Any], losses: list[float],
                  valid_before: float, valid_after: float, adapter: bool) -> str:
    """The card text of a `switchhead finetune` output: the LoRA adapter (`adapter`, loaded with PEFT on top of
    `base_model`, a folder or a Hub id) or the merged model. Only a Hub id goes into the metadata's base_model."""
    base_name = os.path.basename(os.path.normpath(base_model)) if os.path.exists(base_model) else base_model
    steps = settings.get("max_steps")
    note = (f"LoRA fine-tune of `{base_name}` with `switchhead finetune` (Transformers' `Trainer`, PEFT) for {steps} "
            f"steps; validation loss {valid_before:.4f} before, {valid_after:.4f} after"
            + (". This folder holds the adapter only: load it on top of the base model." if adapter
               else ". This folder holds the model with the adapter merged into its weights."))
    results = [(0, "-", f"{valid_before:.4f}", f"{math.exp(min(valid_before, 700)):.2f}"),
               (steps, f"{losses[-1]:.4f}" if losses else "-", f"{valid_after:.4f}",
                f"{math.exp(min(valid_after, 700)):.2f}")]
    card = render_card(
        model_config, model_name=name, repo_id=name, adapter=adapter, base_name=base_name,
        base_model=None if os.path.exists(base_model) else base_model,
        training_data=f"Fine-tuned on {_data_name(settings.get('data'))}.",
        training=dict(note=note, rows=[(key, value) for key, value in settings.items() if key != "data"],
                      results=results, versions=framework_versions()))
    return f"{card}\n\n{CARD_MARKER}\n"


def write_card(folder: str, text: str, replace: bool = False) -> str | None:
    """Write `text` as `folder`/README.md, atomically, unless a README.md there is not ours (no `CARD_MARKER`:
    the user's own, kept; `replace`: a file this command has just written, such as PEFT's placeholder card, is
    replaced all the same). Returns the path written, or None when the user's card was kept."""
    from ..integrity import atomic_file

    path = os.path.join(folder, CARD_NAME)
    if os.path.lexists(path):
        if os.path.islink(path) or not os.path.isfile(path):
            return None  # a link or a device is never written through
        with open(path, encoding="utf-8", errors="replace") as handle:
            if CARD_MARKER not in handle.read() and not replace:
                return None
    with atomic_file(path) as temporary:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
    return path


def write_train_card(output_dir: str, model_config, settings: dict[str, Any] | None = None) -> str | None:
    """The finished run's card, from its settings (default: its training_config.json, the settings it started
    with) and log.csv (see `train_card`, `write_card`)."""
    marker = os.path.join(output_dir, "training_config.json")
    if settings is None and os.path.isfile(marker) and not os.path.islink(marker):
        with open(marker, encoding="utf-8") as handle:
            settings = json.load(handle)
    return write_card(output_dir, train_card(output_dir, model_config, settings or {}))


__all__ = ["CARD_MARKER", "finetune_card", "framework_versions", "train_card", "with_context", "write_card",
           "write_train_card"]
