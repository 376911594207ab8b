"""Zero-shot evaluation: lm-eval on our local-file task folder, and the authors' scoring protocol.

`run_lm_eval` wraps `lm_eval.simple_evaluate` with a TaskManager on `TASKS_DIR`; it gives the same numbers as
`lm-eval run --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path TASKS_DIR ...`.

`run_paper_protocol` scores with the authors' protocol (PAPER.md section 7) where it differs from lm-eval's:

* CBT: each candidate substituted into the question; the choice with the highest *mean log-probability per
  token* of the continuation wins (lm-eval's acc sums log-probabilities, acc_norm divides by bytes).
* BLiMP: summed log-probability of each sentence as is, after the BOS/EOS token (lm-eval scores the sentence
  with its target delimiter, a space, in front); no length normalisation; mean over paradigms (as lm-eval's
  group).
* LAMBADA (teacher-forced greedy prediction of every token of the last word, and its perplexity) is the same
  computation as lm-eval's; it is scored here too so that one run gives all three numbers of the paper's
  zero-shot table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import TASKS_DIR
from .tasks import utils as task_data

# short names accepted by `switchhead eval --tasks`
TASK_ALIASES = {
    "lambada": ["switchhead_lambada"],
    "blimp": ["switchhead_blimp"],
    "cbt": ["switchhead_cbt"],
    "cbt_cn": ["switchhead_cbt_cn"],
    "cbt_ne": ["switchhead_cbt_ne"],
    "wikitext": ["switchhead_wikitext103"],
    "wikitext103": ["switchhead_wikitext103"],
    "wikitext2": ["switchhead_wikitext2"],
}


def expand_tasks(names: list[str], blimp_paradigms: list[str] | None = None) -> list[str]:
    """Short names (`lambada`, `blimp`, ...) to our task names; `blimp` becomes the chosen paradigms if given."""
    tasks: list[str] = []
    for name in names:
        if name == "blimp" and blimp_paradigms:
            tasks += [f"switchhead_blimp_{paradigm}" for paradigm in blimp_paradigms]
        elif name in TASK_ALIASES:
            tasks += TASK_ALIASES[name]
        elif name.startswith("switchhead_"):
            tasks.append(name)
        else:
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_ALIASES)} or a switchhead_* task")
    return list(dict.fromkeys(tasks))


def summarize(results: dict) -> dict[str, dict[str, float]]:
    """lm-eval's `results["results"]` as {task: {metric: value}} without filters and standard errors."""
    summary: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        for key, value in metrics.items():
            metric, _, _ = key.partition(",")
            if metric.endswith("_stderr") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            summary.setdefault(task, {})[metric] = float(value)
    return summary


def blimp_mean(summary: dict[str, dict[str, float]]) -> float | None:
    """Mean accuracy over the BLiMP paradigms present (the paper's BLiMP number)."""
    scores = [m["acc"] for task, m in summary.items() if task.startswith("switchhead_blimp_") and "acc" in m]
    return sum(scores) / len(scores) if scores else None


def run_lm_eval(model: str, tasks: list[str], *, limit: int | float | None = None, batch_size: int = 1,
                device: str = "cpu", metadata: dict | None = None, log_samples: bool = False,
                dtype: str | None = None) -> dict:
    """`lm_eval.simple_evaluate` on a saved model folder with our task folder; returns lm-eval's result dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = f"pretrained={model},trust_remote_code=True" + (f",dtype={dtype}" if dtype else "")
    manager = TaskManager(include_path=str(TASKS_DIR), metadata=metadata or {})
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {', '.join(unknown)} in {TASKS_DIR}")
    return lm_eval.simple_evaluate(model="hf", model_args=model_args, tasks=tasks, limit=limit,
                                   batch_size=batch_size, device=device, task_manager=manager,
                                   log_samples=log_samples)


# ==================================================================================================== scoring
@dataclass
class ContinuationScore:
    logprob: float  # summed log-probability of the continuation tokens
    num_tokens: int
    greedy: bool  # every continuation token is the argmax prediction (teacher forced)


class ContinuationScorer:
    """log p(continuation | context) for a causal LM, batched.

    Tokenization follows lm-eval's convention so that the two agree: the pair is encoded jointly and the
    continuation is what follows the context's tokens; trailing spaces of the context move to the continuation;
    an empty context is replaced by the BOS (else EOS) token. Long inputs keep their last `max_length` tokens.
    """

    def __init__(self, model, tokenizer, batch_size: int = 8, max_length: int | None = None):
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", 2048)
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if prefix is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token to condition empty contexts on")
        self.prefix_token_id = prefix

    def encode(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            return [self.prefix_token_id], self.tokenizer(continuation, add_special_tokens=False).input_ids
        stripped = context.rstrip()
        continuation = context[len(stripped):] + continuation
        whole = self.tokenizer(stripped + continuation, add_special_tokens=False).input_ids
        context_ids = self.tokenizer(stripped, add_special_tokens=False).input_ids
        return whole[: len(context_ids)], whole[len(context_ids):]

    @torch.no_grad()
    def score(self, pairs: list[tuple[str, str]], progress: str | None = None) -> list[ContinuationScore]:
        from tqdm.auto import tqdm

        device = next(self.model.parameters()).device
        encoded = [self.encode(context, continuation) for context, continuation in pairs]
        scores: list[ContinuationScore] = []
        starts = range(0, len(encoded), self.batch_size)
        for start in tqdm(starts, desc=progress, disable=progress is None):
            batch = encoded[start:start + self.batch_size]
            # inputs predict tokens 1..n of (context + continuation); keep the last max_length inputs
            rows = [(context + continuation)[-(self.max_length + 1):] for context, continuation in batch]
            width = max(len(row) - 1 for row in rows)
            input_ids = torch.zeros(len(rows), width, dtype=torch.long)
            attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
            for i, row in enumerate(rows):
                input_ids[i, : len(row) - 1] = torch.tensor(row[:-1])
                attention_mask[i, : len(row) - 1] = 1
            logits = self.model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
            for i, (row, (_, continuation)) in enumerate(zip(rows, batch)):
                n = len(continuation)
                positions = torch.arange(len(row) - 1 - n, len(row) - 1)
                targets = torch.tensor(row[-n:])
                token_log_probs = log_probs[i, positions, targets]
                greedy = bool((log_probs[i, positions].argmax(-1) == targets).all())
                scores.append(ContinuationScore(float(token_log_probs.sum()), n, greedy))
        return scores


# ==================================================================================================== paper protocol
def _limited(rows: list, limit: int | float | None) -> list:
    if limit is None:
        return rows
    count = int(math.ceil(limit * len(rows))) if isinstance(limit, float) and limit < 1 else int(limit)
    return rows[:count]


def paper_lambada(scorer: ContinuationScorer, rows: list[dict]) -> dict[str, float]:
    """Last-word accuracy with teacher-forced greedy prediction, and the last word's perplexity."""
    pairs = [(" ".join(row["text"].split(" ")[:-1]), " " + row["text"].split(" ")[-1]) for row in rows]
    scores = scorer.score(pairs, progress="lambada")
    return {"acc": sum(s.greedy for s in scores) / len(scores),
            "perplexity": math.exp(-sum(s.logprob for s in scores) / len(scores))}


def paper_blimp(scorer: ContinuationScorer, rows: list[dict], paradigm: str = "blimp") -> dict[str, float]:
    """Fraction of pairs where the good sentence has the higher summed log-probability (no normalisation)."""
    pairs = [("", row[key]) for row in rows for key in ("sentence_good", "sentence_bad")]
    scores = scorer.score(pairs, progress=paradigm)
    wins = [good.logprob > bad.logprob for good, bad in zip(scores[0::2], scores[1::2])]
    return {"acc": sum(wins) / len(wins)}


def paper_cbt(scorer: ContinuationScorer, rows: list[dict], kind: str = "cbt") -> dict[str, float]:
    """Accuracy of choosing the candidate with the highest mean log-probability per continuation token."""
    pairs = [(row["context"], " " + choice) for row in rows for choice in row["choices"]]
    scores = scorer.score(pairs, progress=kind)
    correct, offset = 0, 0
    for row in rows:
        options = scores[offset: offset + len(row["choices"])]
        offset += len(row["choices"])
        means = [s.logprob / max(s.num_tokens, 1) for s in options]
        correct += int(max(range(len(means)), key=means.__getitem__) == row["label"])
    return {"acc": correct / len(rows)}


def run_paper_protocol(model, tokenizer, tasks: list[str], *, limit: int | float | None = None,
                       metadata: dict | None = None, batch_size: int = 8) -> dict[str, dict[str, float]]:
    """Score LAMBADA, BLiMP paradigms and CBT with the authors' protocol; returns {task: {metric: value}}.

    `tasks` are our lm-eval task names (see `expand_tasks`); WikiText is not scored here (use lm-eval or
    `switchhead.evaluation.perplexity`).
    """
    scorer = ContinuationScorer(model, tokenizer, batch_size=batch_size)
    results: dict[str, dict[str, float]] = {}
    for task in tasks:
        if task == "switchhead_lambada":
            results[task] = paper_lambada(scorer, _limited(task_data.lambada_rows(metadata), limit))
        elif task == "switchhead_blimp":
            for paradigm in task_data.blimp_paradigms(metadata):
                rows = _limited(task_data.blimp_rows(paradigm, metadata), limit)
                results[f"switchhead_blimp_{paradigm}"] = paper_blimp(scorer, rows, paradigm)
        elif task.startswith("switchhead_blimp_"):
            paradigm = task[len("switchhead_blimp_"):]
            results[task] = paper_blimp(scorer, _limited(task_data.blimp_rows(paradigm, metadata), limit), paradigm)
        elif task in ("switchhead_cbt", "switchhead_cbt_cn", "switchhead_cbt_ne"):
            kinds = ["CN", "NE"] if task == "switchhead_cbt" else [task[-2:].upper()]
            for kind in kinds:
                rows = _limited(task_data.cbt_rows(kind, metadata), limit)
                results[f"switchhead_cbt_{kind.lower()}"] = paper_cbt(scorer, rows, f"cbt {kind}")
        else:
            raise ValueError(f"the paper protocol covers LAMBADA, BLiMP and CBT, not {task!r}")
    mean = blimp_mean(results)
    if mean is not None and sum(t.startswith("switchhead_blimp_") for t in results) > 1:
        results["switchhead_blimp"] = {"acc": mean}
    return results
