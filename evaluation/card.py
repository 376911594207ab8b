"""Model cards with evaluation results, and publishing to the Hub.

The card itself is rendered by `switchhead.model_card` (the template `model_card.md` ships in the model package,
which training imports too; the repository's top-level `model_card.md` is a symbolic link to that one file). This
module adds what only evaluation knows: the model-index metrics and the attention cost in the paper's accounting.

Evaluation results come from the JSON file `switchhead eval --output` writes:
`{"results": {task: {metric: value}}, "limit": ..., "protocol": ..., "perplexity": [...]}`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..model_card import TEMPLATE_PATH, render_card, run_training

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
def load_results(path: str | Path) -> dict:
    """Read and check a `switchhead eval --output` file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evaluation result file {path} does not exist")
    from switchhead.integrity.user_json import read_json_object

    data = read_json_object(path, f"evaluation result file {path}")
    check_results(data, str(path))
    return data


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_results(evaluation: dict, what: str = "the evaluation results") -> None:
    """ValueError (one line naming the entry) unless `evaluation` has the shape `switchhead eval --output` writes:
    a 'results' mapping of {task: {metric: number}}, an optional 'perplexity' list of runs with their numbers, an
    optional 'limit' (null or a number). Every number must be finite: a NaN or infinite score (a diverged model, a
    damaged file) is never written into a card as a result. Any other JSON file (a credentials file, a config) is
    refused, so it is never uploaded as evaluation results."""
    def refuse(problem: str):
        raise ValueError(f"{what} is not a `switchhead eval --output` file: {problem}")

    results = evaluation.get("results")
    if not isinstance(results, dict):
        refuse("it has no 'results' mapping" if results is None else
               f"'results' is {type(results).__name__}, not a mapping of task to metrics")
    for task, metrics in results.items():
        if not isinstance(metrics, dict):
            refuse(f"results[{task!r}] is {type(metrics).__name__}, not a mapping of metric to number")
        for metric, value in metrics.items():
            if not _number(value):
                refuse(f"results[{task!r}][{metric!r}] is {type(value).__name__}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"{what}: results[{task!r}][{metric!r}] is {value}; a NaN or infinite score is not "
                                 "a result (re-run the evaluation, or remove the entry)")
    limit = evaluation.get("limit")
    if limit is not None and (not _number(limit) or not math.isfinite(limit) or limit <= 0):
        refuse(f"'limit' is {limit!r}, not null or a positive number")
    protocol = evaluation.get("protocol")
    if protocol is not None and not isinstance(protocol, str):
        refuse(f"'protocol' is {type(protocol).__name__}, not a string")
    runs = evaluation.get("perplexity", [])
    if not isinstance(runs, list):
        refuse(f"'perplexity' is {type(runs).__name__}, not a list of runs")
    for number, run in enumerate(runs):
        if not isinstance(run, dict):
            refuse(f"perplexity[{number}] is {type(run).__name__}, not an object")
        for key in ("data", "protocol"):
            if not isinstance(run.get(key), str):
                refuse(f"perplexity[{number}][{key!r}] is {type(run.get(key)).__name__}, not a string")
        for key in ("perplexity", "bits_per_byte", "context"):
            value = run.get(key)
            if not _number(value):
                refuse(f"perplexity[{number}][{key!r}] is {type(value).__name__}, not a number")
            if not math.isfinite(value):
                raise ValueError(f"{what}: perplexity[{number}][{key!r}] is {value}; a NaN or infinite score is "
                                 "not a result (re-run the evaluation, or remove the entry)")


def eval_results(evaluation: dict, model_name: str):
    """model-index entries (`huggingface_hub.EvalResult`) for every known metric in an evaluation file."""
    from huggingface_hub import EvalResult

    if evaluation:  # {}: no evaluation given
        check_results(evaluation)
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


def build_card(model_dir: str | Path, evaluation: dict | None = None, *, repo_id: str | None = None,
               model_name: str | None = None, training_data: str | None = None, datasets: list[str] | None = None,
               license: str | None = None, template_path: str | Path = TEMPLATE_PATH):
    """Render the model card of a saved model folder, with model-index metrics from `evaluation`. `license`: a Hub
    licence id; default this package's licence (`switchhead.model_card.PACKAGE_LICENSE`). A `switchhead train`
    folder's card also shows its training settings and validation losses, and names its data unless
    `training_data` is given."""
    from transformers import AutoConfig

    from .accounting import attention_macs, attention_memory, format_count, kv_cache_bytes_per_token

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; give a save_pretrained folder")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)  # our type is registered: no folder code
    if getattr(config, "model_type", None) != "switchhead":
        raise ValueError(f"{model_dir} holds a {config.model_type!r} model, not a switchhead one")
    model_name = model_name or (repo_id.split("/")[-1] if repo_id else model_dir.resolve().name)
    evaluation = evaluation or {}
    entries = eval_results(evaluation, model_name)
    limit = evaluation.get("limit")
    eval_note = (f"Scored with the {evaluation.get('protocol', 'lm-eval')} protocol"
                 + (f" on the first {limit} examples of each task (--limit), so these are not full-test-set numbers."
                    if limit else " on the full test sets.")) if entries else ""
    cost = dict(context=config.max_position_embeddings, attention_macs=format_count(attention_macs(config)),
                attention_memory=format_count(attention_memory(config)),
                kv_cache_bytes=f"{kv_cache_bytes_per_token(config):,}")
    training = run_training(model_dir)  # None unless the folder is a training run
    if training is not None:
        training_data = training_data or training["data"]
    return render_card(config, model_name=model_name, repo_id=repo_id or str(model_dir), license=license,
                       training_data=training_data, datasets=datasets, eval_results=entries, training=training,
                       eval_rows=[(e.dataset_name, e.metric_name, e.metric_value) for e in entries],
                       eval_note=eval_note, cost=cost, template_path=template_path)


REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# What a Hub model repository receives: the model, its generation settings and tokenizer, the code that
# `trust_remote_code` imports, and the card (plus, when asked, the evaluation results). A training run's folder also
# holds checkpoints with optimizer pickles, RNG and XL-memory states, logs and TensorBoard events: none of it is
# sent, and no pickle (.bin, .pt, .pth, .pkl) ever is, as loading one runs code.
MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
RESULTS_NAME = "eval_results.json"


def _weight_files(model_dir: Path) -> list[str]:
    """The safetensors weights: one file, or the shards an index names (every one must be there)."""
    if (model_dir / WEIGHTS_INDEX).is_file():
        from switchhead.integrity.user_json import read_json_object

        weight_map = read_json_object(model_dir / WEIGHTS_INDEX, str(model_dir / WEIGHTS_INDEX)).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise ValueError(f"{model_dir / WEIGHTS_INDEX}: weight_map is {type(weight_map).__name__}, not an object "
                             "of tensor name to shard")
        shards = sorted({str(name) for name in weight_map.values()})
        bad = [name for name in shards if Path(name).name != name or not name.endswith(".safetensors")]
        if not shards or bad:
            raise ValueError(f"{model_dir / WEIGHTS_INDEX} does not name safetensors shards of this folder"
                             + (f" ({', '.join(bad)})" if bad else ""))
        missing = [name for name in shards if not (model_dir / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir} lacks the weight shards {', '.join(missing)} its index names")
        return [WEIGHTS_INDEX, *shards]
    if (model_dir / WEIGHTS).is_file():
        return [WEIGHTS]
    raise FileNotFoundError(f"{model_dir} is not a complete save_pretrained folder: missing {WEIGHTS} (or "
                            f"{WEIGHTS_INDEX} and its shards)")


def _code_files(model_dir: Path) -> list[str]:
    """The Python files `trust_remote_code` loads: the modules the `auto_map` of config.json and
    tokenizer_config.json name, and every file they import relatively (what Transformers copies, and fetches)."""
    import ast

    from switchhead.integrity.user_json import read_json_object

    modules: list[str] = []
    for name in ("config.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            auto_map = read_json_object(model_dir / name, f"{name} of {model_dir}").get("auto_map") or {}
            if not isinstance(auto_map, dict):
                raise ValueError(f"{model_dir / name}: auto_map is {type(auto_map).__name__}, not an object of "
                                 "class name to module reference")
            for reference in auto_map.values():
                for entry in reference if isinstance(reference, (list, tuple)) else [reference]:
                    if isinstance(entry, str) and "--" not in entry:  # "owner/repo--module.Class": code of another repo
                        modules.append(entry.rsplit(".", 1)[0])
    found: list[str] = []
    while modules:
        module = modules.pop()
        filename = module.replace(".", "/") + ".py"
        if filename in found:
            continue
        if "/" in filename or not (model_dir / filename).is_file():
            raise FileNotFoundError(f"{model_dir} lacks {filename}, which its auto_map loads (directly or through "
                                    "a relative import)")
        found.append(filename)
        try:
            tree = ast.parse((model_dir / filename).read_text(encoding="utf-8"), filename)
        except (SyntaxError, ValueError) as error:  # ValueError: a NUL byte, text that is not UTF-8
            raise ValueError(f"{model_dir / filename}, which its auto_map loads, is not valid Python "
                             f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); fix "
                             "or remove it") from None
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                modules += [node.module] if node.module else [alias.name for alias in node.names]
    return sorted(found)


def publish_files(model_dir: str | Path) -> list[str]:
    """The files of `model_dir` that `publish` uploads, by name (all at the top level of the folder): config,
    generation config, safetensors weights (and index), tokenizer files and the model code. Everything else stays
    local. A chosen file that is a symbolic link is refused rather than followed."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a complete save_pretrained folder: missing config.json"
                                + ("" if any(model_dir.glob("*.safetensors")) else " and safetensors weights"))
    names = [name for name in (*MODEL_FILES, *TOKENIZER_FILES) if (model_dir / name).is_file()]
    names += _weight_files(model_dir) + _code_files(model_dir)
    linked = [name for name in names if (model_dir / name).is_symlink()]
    if linked:
        raise ValueError(f"{model_dir}: {', '.join(linked)} is a symbolic link; publish a folder of plain files")
    return names


def publish(model_dir: str | Path, repo_id: str, card, *, api=None, private: bool = False, token: str | None = None,
            results: str | Path | None = None, commit_message: str = "Upload SwitchHead model") -> str:
    """Create (or reuse) the Hub repository and upload, in one commit, the files `publish_files` chooses, the card
    as README.md and, when `results` (a `switchhead eval --output` file) is given, that file as eval_results.json.
    Returns the URL.

    `api` is an `huggingface_hub.HfApi` (made from `token` when None); tests pass a recording fake.
    """
    from huggingface_hub import CommitOperationAdd

    model_dir = Path(model_dir)
    if not REPO_ID.match(repo_id):
        raise ValueError(f"repository id must look like 'owner/name', got {repo_id!r}")
    names = publish_files(model_dir)
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(model_dir / name)) for name in names]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode("utf-8")))
    if results is not None:
        load_results(results)  # a results file only, checked before anything is sent
        operations.append(CommitOperationAdd(path_in_repo=RESULTS_NAME, path_or_fileobj=Path(results).read_bytes()))
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    api.create_commit(repo_id=repo_id, repo_type="model", operations=operations, commit_message=commit_message)
    return repo_url(repo_id)


def repo_url(repo_id: str) -> str:
    """The web address of a model repository on the Hub that `HfApi` talks to: HF_ENDPOINT (e.g. a private Hub
    mirror) when set, not always huggingface.co."""
    from huggingface_hub import constants

    return f"{constants.ENDPOINT.rstrip('/')}/{repo_id}"
