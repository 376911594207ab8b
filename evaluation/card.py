"""Model cards from `model_card.md` (a Jinja template for `huggingface_hub.ModelCard`) and publishing to the Hub.

The template ships in this package (`switchhead/evaluation/model_card.md`, package data), so cards render after
a non-editable install too; the repository's top-level `model_card.md` is a symbolic link to that one file.

Evaluation results come from the JSON file `switchhead eval --output` writes:
`{"results": {task: {metric: value}}, "limit": ..., "protocol": ..., "perplexity": [...]}`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card.md"

# our task -> (dataset type, dataset name, [(result metric, model-index metric type, display name)])
TASK_METRICS = {
    "switchhead_lambada": ("lambada", "LAMBADA (OpenAI)", [("acc", "accuracy", "Accuracy (last word)"),
                                                          ("perplexity", "perplexity", "Perplexity (last word)")]),
    "switchhead_blimp": ("blimp", "BLiMP", [("acc", "accuracy", "Accuracy (mean over paradigms)")]),
    "switchhead_cbt_cn": ("cbt", "CBT (CN)", [("acc", "accuracy", "Accuracy")]),
    "switchhead_cbt_ne": ("cbt", "CBT (NE)", [("acc", "accuracy", "Accuracy")]),
    "switchhead_wikitext103": ("wikitext", "WikiText-103 (test, word-level)",
                               [("word_perplexity", "perplexity", "Word perplexity"),
                                ("bits_per_byte", "bits_per_byte", "Bits per byte")]),
    "switchhead_wikitext2": ("wikitext", "WikiText-2 (test, word-level)",
                             [("word_perplexity", "perplexity", "Word perplexity"),
                              ("bits_per_byte", "bits_per_byte", "Bits per byte")]),
}
CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "attention_type", "num_attention_experts", "num_attention_experts_per_tok", "position_encoding",
                 "mlp_type", "intermediate_size", "num_mlp_experts", "mlp_expert_size", "num_mlp_experts_per_tok",
                 "max_position_embeddings")


def load_results(path: str | Path) -> dict:
    """Read and check a `switchhead eval --output` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evaluation result file {path} does not exist")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("results", {}), dict):
        raise ValueError(f"{path} is not a `switchhead eval --output` file (expected a 'results' mapping)")
    return data


def eval_results(evaluation: dict, model_name: str):
    """model-index entries (`huggingface_hub.EvalResult`) for every known metric in an evaluation file."""
    from huggingface_hub import EvalResult

    results = dict(evaluation.get("results", {}))
    paradigms = [m["acc"] for t, m in results.items() if t.startswith("switchhead_blimp_") and "acc" in m]
    if "switchhead_blimp" not in results and paradigms:
        results["switchhead_blimp"] = {"acc": sum(paradigms) / len(paradigms)}
    entries = []
    for task, (dataset_type, dataset_name, metrics) in TASK_METRICS.items():
        for key, metric_type, metric_name in metrics:
            value = results.get(task, {}).get(key)
            if value is not None:
                entries.append(EvalResult(task_type="text-generation", task_name="Text Generation",
                                          dataset_type=dataset_type, dataset_name=dataset_name, dataset_split="test",
                                          metric_type=metric_type, metric_name=metric_name,
                                          metric_value=round(float(value), 4)))
    for run in evaluation.get("perplexity", []):
        for key, metric_type in (("perplexity", "perplexity"), ("bits_per_byte", "bits_per_byte")):
            entries.append(EvalResult(task_type="text-generation", task_name="Text Generation", dataset_type="text",
                                      dataset_name=run["data"], metric_type=metric_type,
                                      metric_name=f"{metric_type} ({run['protocol']}, context {run['context']})",
                                      metric_value=round(float(run[key]), 4)))
    return entries


def _describe(config) -> tuple[str, str]:
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
    return kind, note


def build_card(model_dir: str | Path, evaluation: dict | None = None, *, repo_id: str | None = None,
               model_name: str | None = None, training_data: str | None = None, datasets: list[str] | None = None,
               license: str = "apache-2.0", template_path: str | Path = TEMPLATE_PATH):
    """Render the model card of a saved model folder, with model-index metrics from `evaluation`."""
    import torch
    from huggingface_hub import ModelCard, ModelCardData
    from transformers import AutoConfig, AutoModelForCausalLM

    from .accounting import attention_macs, attention_memory, format_count, kv_cache_bytes_per_token

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; give a save_pretrained folder")
    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "model_type", None) != "switchhead":
        raise ValueError(f"{model_dir} holds a {config.model_type!r} model, not a switchhead one")
    with torch.device("meta"):  # count parameters without allocating them
        num_parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    model_name = model_name or (repo_id.split("/")[-1] if repo_id else model_dir.resolve().name)
    evaluation = evaluation or {}
    entries = eval_results(evaluation, model_name)
    card_data = ModelCardData(
        language="en", license=license, library_name="transformers", pipeline_tag="text-generation",
        tags=["switchhead", "mixture-of-experts", "moe-attention"] + (["switchall"] if config.mlp_type == "sigma_moe" else []),
        datasets=datasets or None, model_name=model_name, eval_results=entries or None,
    )
    kind, note = _describe(config)
    limit = evaluation.get("limit")
    eval_note = (f"Scored with the {evaluation.get('protocol', 'lm-eval')} protocol"
                 + (f" on the first {limit} examples of each task (--limit), so these are not full-test-set numbers."
                    if limit else " on the full test sets.")) if entries else ""
    return ModelCard.from_template(
        card_data, template_path=str(template_path),
        model_name=model_name, repo_id=repo_id or str(model_dir), architecture=kind, architecture_note=note,
        num_parameters=f"{num_parameters / 1e6:.2f}M",
        config_rows=[(name, getattr(config, name)) for name in CONFIG_FIELDS
                     if config.attention_type == "switchhead" or "attention_experts" not in name
                     if config.mlp_type == "sigma_moe" or "mlp_expert" not in name],
        context=config.max_position_embeddings, attention_macs=format_count(attention_macs(config)),
        attention_memory=format_count(attention_memory(config)), kv_cache_bytes=f"{kv_cache_bytes_per_token(config):,}",
        training_data=training_data or "Not stated.",
        eval_rows=[(e.dataset_name, e.metric_name, e.metric_value) for e in entries], eval_note=eval_note,
    )


REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def publish(model_dir: str | Path, repo_id: str, card, *, api=None, private: bool = False, token: str | None = None,
            commit_message: str = "Upload SwitchHead model") -> str:
    """Create (or reuse) the Hub repository, upload the model folder, then the card as README.md. Returns the URL.

    `api` is an `huggingface_hub.HfApi` (made from `token` when None); tests pass a recording fake.
    """
    model_dir = Path(model_dir)
    if not REPO_ID.match(repo_id):
        raise ValueError(f"repository id must look like 'owner/name', got {repo_id!r}")
    missing = [name for name in ("config.json",) if not (model_dir / name).is_file()]
    if not any(model_dir.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise FileNotFoundError(f"{model_dir} is not a complete save_pretrained folder: missing {', '.join(missing)}")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(model_dir), repo_id=repo_id, repo_type="model", commit_message=commit_message,
                      ignore_patterns=["README.md"])
    api.upload_file(path_or_fileobj=str(card).encode("utf-8"), path_in_repo="README.md", repo_id=repo_id,
                    repo_type="model", commit_message=f"{commit_message}: model card")
    return f"https://huggingface.co/{repo_id}"
