"""The model card (README.md with Hub metadata) of a finished `switchhead train` or `switchhead finetune` folder,
and the context its saved tokenizer carries.

Like Trainer's `create_model_card`, the card states what was trained and how: the architecture (rendered by
`switchhead.model_card`, the template `switchhead card` uses too), the training settings, the validation losses of
the run's log and the library versions. `switchhead card` / `publish` render a card with evaluation results on top.

A card is ours to replace while it keeps `CARD_MARKER` (its last line): a README.md the user wrote, or edited and
took the line out of, is left as it is.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ..model_card import data_description, render_card, run_training

CARD_NAME = "README.md"
CARD_MARKER = ("<!-- written by switchhead when the run finished, and rewritten when it finishes again; delete this "
               "line to keep your edits -->")


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


def train_card(output_dir: str, model_config, settings: dict[str, Any] | None = None) -> str:
    """The card text of a `switchhead train` folder: `settings` is its TrainingConfig as a dict (default: its
    training_config.json), the results come from its log.csv (`switchhead.model_card.run_training`)."""
    training = run_training(output_dir, settings, framework_versions())
    name = os.path.basename(os.path.normpath(os.path.abspath(output_dir)))
    card = render_card(model_config, model_name=name, repo_id=name,
                       training_data=training.pop("data") if training else None, training=training)
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
        training_data=f"Fine-tuned on {data_description(settings.get('data'))}.",
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
    """The finished run's card, from its settings (the TrainingConfig it ran with, as a dict: a resume may have
    changed max_steps) and log.csv (see `train_card`, `write_card`)."""
    return write_card(output_dir, train_card(output_dir, model_config, settings))


__all__ = ["CARD_MARKER", "finetune_card", "framework_versions", "train_card", "with_context", "write_card",
           "write_train_card"]
