"""Model cards (README.md with Hub metadata) from `model_card.md`, a Jinja template for `huggingface_hub.ModelCard`.

The renderer lives beside the model because every part that saves a model writes a card: `switchhead train` and
`switchhead finetune` (training), `switchhead card` and `switchhead publish` (evaluation, which adds the evaluation
results and the attention cost). The template ships in this package (package data), so cards render after a
non-editable install too.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card.md"

# The licence of this package (setup.py's `license_expression`, the LICENSE file; tests/evaluation/test_publish.py
# holds the three equal). A card takes it unless the user names another.
PACKAGE_LICENSE = "Apache-2.0"

CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "attention_type", "num_attention_experts", "num_attention_experts_per_tok", "position_encoding",
                 "mlp_type", "intermediate_size", "num_mlp_experts", "mlp_expert_size", "num_mlp_experts_per_tok",
                 "max_position_embeddings")
SHARED_LAYER_FIELDS = ("layer_group_size", "layernorm_placement", "entropy_reg_scope", "attention_entropy_reg_coef")


# what `switchhead train` leaves in its folder: its settings (a TrainingConfig as JSON) and its log
RUN_SETTINGS, RUN_LOG = "training_config.json", "log.csv"
# settings shown as a card's training hyperparameters, in this order
TRAINING_FIELDS = ("preset", "max_steps", "batch_size", "gradient_accumulation_steps", "block_size", "learning_rate",
                   "min_learning_rate", "warmup_steps", "weight_decay", "adam_betas", "grad_clip", "mixed_precision",
                   "seed", "vocab_size", "tokenizer")


def data_description(data: str | None) -> str:
    """A training run's `data` setting as a card names it: a file or folder by its name (no local path), a Hub
    dataset by its id."""
    if data is None or data == "python-stdlib":
        return ("the Python standard library's reference documentation and module sources (the embedded default "
                "corpus of `switchhead train`)")
    return f"`{os.path.basename(os.path.normpath(data))}`" if os.path.exists(data) else f"`{data}` (Hub dataset)"


def _plain_file(path: str) -> bool:
    return os.path.isfile(path) and not os.path.islink(path)


def run_training(folder: str | Path, settings: dict[str, Any] | None = None,
                 versions: list[tuple[str, str]] | None = None) -> dict[str, Any] | None:
    """The `training` section of a card for a `switchhead train` folder: the settings (`settings`, default its
    training_config.json), the validation rows of its log.csv and `versions`. None for a folder that is no run.

    training_config.json holds the settings the run started with; a resume may have changed `max_steps`, so with
    the file the steps are the last step of the log (a run always validates at its last step)."""
    from_file = settings is None
    if from_file:
        path = os.path.join(folder, RUN_SETTINGS)
        if not _plain_file(path):
            return None
        with open(path, encoding="utf-8") as handle:
            settings = json.load(handle)
    results = []
    log = os.path.join(folder, RUN_LOG)
    if _plain_file(log):
        with open(log, newline="", encoding="utf-8") as handle:
            results = [(int(row["step"]), f"{float(row['loss']):.4f}", f"{float(row['valid_loss']):.4f}",
                        f"{float(row['valid_perplexity']):.2f}") for row in csv.DictReader(handle)
                       if row.get("valid_loss")]
    if from_file and results:
        settings = {**settings, "max_steps": results[-1][0]}
    steps = results[-1][0] if results else settings.get("max_steps")
    note = (f"Pretrained from random initialisation with `switchhead train` (preset `{settings.get('preset')}`) for "
            f"{steps} steps of {settings.get('batch_size')} sequences of {settings.get('block_size')} tokens: AdamW, "
            "linear warmup then cosine decay of the learning rate.")
    rows = [(name, settings[name] if settings[name] is not None or name != "tokenizer"
             else "a BPE trained on the training split") for name in TRAINING_FIELDS if name in settings]
    return dict(note=note, rows=rows, results=results, versions=versions or [],
                data=f"Trained on {data_description(settings.get('data'))}.")


def card_license(license: str | None = None) -> str:
    """The Hub licence id of a card: the one given, else this package's (Hub ids are lower-case SPDX ids)."""
    chosen = (license or PACKAGE_LICENSE).strip()
    if not chosen:
        raise ValueError("the licence must not be empty; give a Hub licence id such as apache-2.0")
    return chosen.lower()


def describe(config) -> tuple[str, str]:
    """(the kind of model, one sentence on its experts) for the card's first paragraph."""
    if config.attention_type == "switchhead":
        kind = "SwitchAll" if config.mlp_type == "sigma_moe" else "SwitchHead"
        note = (f"Each of its {config.num_attention_heads} attention heads has {config.num_attention_experts} value "
                f"and output experts, {config.num_attention_experts_per_tok} of them active per token "
                "(sigmoid gates, top-k per head).")
    else:
        kind, note = "dense-attention Transformer", "It is the dense multi-head attention baseline of the paper."
    if config.mlp_type == "sigma_moe":
        note += (f" Its feed-forward blocks are sigma-MoE layers with {config.num_mlp_experts} experts of size "
                 f"{config.mlp_expert_size}, {config.num_mlp_experts_per_tok} active per token.")
    group = getattr(config, "layer_group_size", None)
    if group is not None:  # shared layers: MoEUT (with its peri-LayerNorm), or the sharing alone
        peri = getattr(config, "layernorm_placement", "pre") == "peri"
        kind = "MoEUT" if peri else kind
        note += (f" Its {config.num_hidden_layers} layers apply a group of {group} distinct blocks "
                 f"{config.num_layer_groups} times with shared weights, as in MoEUT ([Csordás, Irie, Schmidhuber, "
                 "Potts, Manning, NeurIPS 2024](https://arxiv.org/abs/2405.16039))"
                 + ("; the attention's values and the experts read the un-normalised stream (peri-LayerNorm)."
                    if peri else "."))
    return kind, note


def render_card(config, *, model_name: str, repo_id: str, license: str | None = None,
                training_data: str | None = None, datasets: list[str] | None = None, eval_results=None,
                eval_rows=(), eval_note: str = "", cost: dict[str, Any] | None = None,
                training: dict[str, Any] | None = None, base_model: str | None = None, adapter: bool = False,
                base_name: str | None = None, template_path: str | Path = TEMPLATE_PATH):
    """The `huggingface_hub.ModelCard` of a switchhead model with configuration `config`.

    Args:
        model_name, repo_id: the card's title and the id its usage snippet loads.
        license: a Hub licence id; default this package's (`PACKAGE_LICENSE`).
        eval_results, eval_rows, eval_note: model-index entries (`huggingface_hub.EvalResult`), the table rows
            (task, metric, value) and a sentence on how they were measured.
        cost: `attention_macs`, `attention_memory`, `kv_cache_bytes` (formatted) and `context`, or None to leave the
            attention cost out.
        training: `note` (one paragraph), `rows` ((setting, value) pairs), `results` ((step, training loss,
            validation loss, validation perplexity) rows) and `versions` ((library, version) pairs), or None
            (`run_training` reads it from a `switchhead train` folder).
        base_model: the Hub id this model was fine-tuned from, for the metadata.
        adapter, base_name: the folder holds a PEFT adapter (of a model of configuration `config`), not a whole
            model; `base_name` is what its usage snippet loads the base model from (default `base_model`).
    """
    import torch
    from huggingface_hub import ModelCard, ModelCardData
    from transformers import AutoModelForCausalLM

    if getattr(config, "model_type", None) != "switchhead":
        raise ValueError(f"a {getattr(config, 'model_type', None)!r} configuration is not a switchhead one")
    with torch.device("meta"):  # count parameters without allocating them
        num_parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    tags = ["switchhead", "mixture-of-experts", "moe-attention"] + (["switchall"] if config.mlp_type == "sigma_moe"
                                                                     else [])
    if getattr(config, "layer_group_size", None) is not None:
        tags.append("moeut" if getattr(config, "layernorm_placement", "pre") == "peri" else "shared-layers")
    card_data = ModelCardData(
        language="en", license=card_license(license), library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=tags, datasets=datasets or None, model_name=model_name, eval_results=eval_results or None,
        base_model=base_model,
    )
    kind, note = describe(config)
    return ModelCard.from_template(
        card_data, template_path=str(template_path),
        model_name=model_name, repo_id=repo_id, architecture=kind, architecture_note=note,
        num_parameters=f"{num_parameters / 1e6:.2f}M",
        config_rows=[(name, getattr(config, name)) for name in CONFIG_FIELDS
                     if config.attention_type == "switchhead" or "attention_experts" not in name
                     if config.mlp_type == "sigma_moe" or "mlp_expert" not in name]
        + [(name, getattr(config, name)) for name in SHARED_LAYER_FIELDS
           if getattr(config, "layer_group_size", None) is not None],
        cost=cost, training=training, adapter=adapter, base_name=base_name or base_model or "BASE_MODEL",
        training_data=training_data or "Not stated.", eval_rows=list(eval_rows), eval_note=eval_note,
    )


__all__ = ["CONFIG_FIELDS", "PACKAGE_LICENSE", "TEMPLATE_PATH", "TRAINING_FIELDS", "card_license", "data_description",
           "describe", "render_card", "run_training"]
