"""Zero-shot evaluation: lm-eval on our local-file task folder, and the authors' scoring protocol.

`run_lm_eval` wraps `lm_eval.simple_evaluate` with a TaskManager on `TASKS_DIR`; it gives the same numbers as
`lm-eval run --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path TASKS_DIR ...` (which runs
the folder's copy of our model code; in this process `import switchhead` registers the model type, so no code from
the folder runs unless the caller passes `trust_remote_code=True`).

`run_paper_protocol` scores with the authors' protocol (docs/evaluation.md, "The authors' protocol") where it
differs from lm-eval's:

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

import contextlib
import functools
import logging
import math
import os
import subprocess
from dataclasses import dataclass

import torch

from . import TASKS_DIR
from .tasks import utils as task_data



@dataclass(frozen=True)
class TaskAlias:
    """A short name of `switchhead eval --tasks`: our lm-eval task(s), the lm-eval built-in it mirrors, the data."""

    tasks: tuple[str, ...]
    lm_eval: str  # the built-in task whose definition ours repeats (tests/evaluation/test_lm_eval_parity.py)
    data: str  # what is read, relative to the data folder
    deviation: str  # how our numbers differ from the built-in's, "" if they do not


TASK_CATALOGUE = {
    "lambada": TaskAlias(("switchhead_lambada",), "lambada_openai", "lambada/lambada_test.jsonl (OpenAI, 5,153)", ""),
    "blimp": TaskAlias(("switchhead_blimp",), "blimp (67 blimp_* paradigms)", "blimp/<paradigm>.jsonl (67 x 1,000)",
                       ""),
    "wikitext": TaskAlias(("switchhead_wikitext2",), "wikitext (WikiText-2 test)",
                          "wikitext-2/wiki.test.tokens (word-level, wikitext-2-v1)",
                          "lm-eval reads the raw files (wikitext-2-raw-v1); ours the word-level ones, whose rare "
                          "words are <unk>: same 62 articles, different text, perplexities not comparable"),
    "wikitext2": TaskAlias(("switchhead_wikitext2",), "wikitext (WikiText-2 test)",
                           "wikitext-2/wiki.test.tokens (word-level, wikitext-2-v1)", "same as wikitext"),
    "wikitext103": TaskAlias(("switchhead_wikitext103",), "none: wikitext's definition on WikiText-103",
                             "wikitext-103/wiki.test.tokens (word-level, wikitext-103-v1)",
                             "no lm-eval built-in; the same 62 test articles with WikiText-103's vocabulary"),
    "cbt": TaskAlias(("switchhead_cbt",), "none (lm-eval has no CBT task)", "cbt/cbtest_{CN,NE}_test_2500ex.txt "
                     "(not shipped: --cbt-dir)", "no lm-eval built-in to compare with"),
    "cbt_cn": TaskAlias(("switchhead_cbt_cn",), "none (lm-eval has no CBT task)",
                        "cbt/cbtest_CN_test_2500ex.txt (not shipped: --cbt-dir)",
                        "no lm-eval built-in to compare with"),
    "cbt_ne": TaskAlias(("switchhead_cbt_ne",), "none (lm-eval has no CBT task)",
                        "cbt/cbtest_NE_test_2500ex.txt (not shipped: --cbt-dir)",
                        "no lm-eval built-in to compare with"),
}
# short names accepted by `switchhead eval --tasks`
TASK_ALIASES = {name: list(alias.tasks) for name, alias in TASK_CATALOGUE.items()}
DEFAULT_TASKS = ("lambada", "blimp", "wikitext")


def describe_tasks() -> str:
    """The `switchhead eval --tasks list` table: each short name, our task, the lm-eval built-in, the data read."""
    header = ("name", "our lm-eval task", "mirrors lm-eval built-in", "data read (under the data folder)")
    rows = [header] + [(name, ",".join(alias.tasks), alias.lm_eval, alias.data) for name, alias in
                       TASK_CATALOGUE.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    notes = [f"{name}: {alias.deviation}" for name, alias in TASK_CATALOGUE.items()
             if alias.deviation and not alias.deviation.startswith("same as")]
    return "\n".join(lines + ["", "Differences from the lm-eval built-ins:"] + [f"  {note}" for note in notes]
                     + [f"Default: {','.join(DEFAULT_TASKS)}. Also accepted: any switchhead_* task name, e.g. "
                        "switchhead_blimp_causative."])


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
            raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_ALIASES)} or a switchhead_* task "
                             "(`switchhead eval --tasks list` describes them)")
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
                dtype: str | None = None, progress: bool = True, trust_remote_code: bool = False) -> dict:
    """`lm_eval.simple_evaluate` on a saved model folder with our task folder; returns lm-eval's result dict.

    The numbers are those of `lm-eval run --model hf --model_args pretrained=MODEL,trust_remote_code=True ...`
    (the same HFLM, built from the same arguments, given as keywords so that no folder name is parsed). What differs
    is the output: one progress line or bar per request type for the whole run (`progress=False`: none) instead of
    lm-eval's bar per task and per batch of rolling windows, and without its per-task "Custom kwargs" warning that
    our local-file tasks trigger.
    `trust_remote_code` is the caller's decision (`switchhead.integrity.check_remote_code`): our own folders need
    none, since `import switchhead` registers the model type.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    if trust_remote_code is not True and trust_remote_code is not False:
        raise TypeError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
    manager = TaskManager(include_path=str(TASKS_DIR), metadata=metadata or {})
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {', '.join(unknown)} in {TASKS_DIR}")
    # the folder goes in as one keyword argument, never inside lm-eval's comma-joined argument string: a folder
    # named 'm,pretrained=other' or 'm,peft=adapter' would make lm-eval parse its name into other arguments and
    # score a model nobody checked. backend: our checked folders are causal LMs (also keeps HFLM from warning that
    # the model type is in neither of Transformers' registries)
    options = {"dtype": dtype} if dtype else {}
    lm = _one_bar_hflm_class()(pretrained=os.fspath(model), backend="causal", trust_remote_code=trust_remote_code,
                               batch_size=batch_size, device=device, **options)
    lm.show_progress = progress
    with _quiet_lm_eval():
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                                       log_samples=log_samples)


_REQUEST_KINDS = {"loglikelihood": ("zero-shot log-likelihood", "requests"),
                  "loglikelihood_rolling": ("zero-shot rolling log-likelihood", "documents")}


def _one_bar_hflm_class():
    """lm-eval's HFLM reporting to one `Progress` per request type instead of drawing its own bars."""
    from lm_eval.models.huggingface import HFLM

    from .progress import Progress

    class OneBarHFLM(HFLM):
        show_progress = True
        progress_interval = 30.0  # seconds between two progress lines in a log

        def _in_slices(self, method, requests, kind: str):
            # slices of about 1% of the requests (at least a batch): HFLM still sorts and batches within a slice
            desc, unit = _REQUEST_KINDS[kind]
            step = max(int(self.batch_size) if str(self.batch_size).isdigit() else 1, -(-len(requests) // 100))
            results = []
            with Progress(len(requests), desc, unit=unit, enabled=self.show_progress,
                          interval=self.progress_interval) as bar:
                for start in range(0, len(requests), step):
                    chunk = requests[start:start + step]
                    results += method(chunk, disable_tqdm=True)
                    bar.update(len(chunk))
            return results

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self._in_slices(super().loglikelihood, requests, "loglikelihood")

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self._in_slices(super().loglikelihood_rolling, requests, "loglikelihood_rolling")

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            # HFLM's rolling log-likelihood asks for a bar per batch of windows; the run's bar stands for them
            return super()._loglikelihood_tokens(requests, disable_tqdm=True, override_bs=override_bs)

    return OneBarHFLM


class _PerRequestWarnings(logging.Filter):
    """Drops lm-eval's per-task "Custom kwargs" warning (our local-file tasks trigger it by design) and counts its
    per-request truncation warning instead of letting thousands of them through."""

    def __init__(self):
        super().__init__()
        self.truncated = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Combined length of context"):
            self.truncated += 1
            return False
        return "Custom kwargs can be passed" not in message


def _quiet_git_commit() -> str | None:
    """The working directory's commit as lm-eval records it (`git describe --always`), or None outside a checkout,
    without git writing to the terminal."""
    try:
        described = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if described.returncode != 0:
        return None
    return described.stdout.strip() or None


@contextlib.contextmanager
def _quiet_lm_eval():
    """While lm-eval runs: no progress bar per task, no per-task or per-request warnings (one summary line for the
    requests truncated to the model's length). Everything is restored afterwards."""
    import lm_eval.api.task as task_module
    import lm_eval.evaluator as evaluator_module
    import lm_eval.models.huggingface as hf_module
    from tqdm import tqdm

    loggers = [logging.getLogger(task_module.__name__), logging.getLogger(hf_module.__name__)]
    quiet = _PerRequestWarnings()
    original = task_module.tqdm
    task_module.tqdm = functools.partial(tqdm, disable=True)
    # lm-eval records the commit of the working directory by running git with our stderr: outside a checkout
    # that prints "fatal: not a git repository" into a normal run
    original_git_hash = evaluator_module.get_git_commit_hash
    evaluator_module.get_git_commit_hash = _quiet_git_commit
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        task_module.tqdm = original
        evaluator_module.get_git_commit_hash = original_git_hash
        for logger in loggers:
            logger.removeFilter(quiet)
        if quiet.truncated:
            logging.getLogger(__name__).warning(
                "%d lm-eval requests were longer than the model's context; lm-eval kept their last tokens",
                quiet.truncated)


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
        self.progress = None  # a `Progress` of the whole run; when None, `score(progress=desc)` draws its own bar

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
        run_bar = self.progress
        for start in starts if run_bar is not None else tqdm(starts, desc=progress, disable=progress is None):
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
            if run_bar is not None:
                run_bar.update(len(batch))
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
                       metadata: dict | None = None, batch_size: int = 8,
                       progress: bool = True) -> dict[str, dict[str, float]]:
    """Score LAMBADA, BLiMP paradigms and CBT with the authors' protocol; returns {task: {metric: value}}.

    `tasks` are our lm-eval task names (see `expand_tasks`); WikiText is not scored here (use lm-eval or
    `switchhead.evaluation.perplexity`). One progress bar (or log line) covers every scored continuation.
    """
    from .progress import Progress

    jobs = []  # (result name, scoring function, rows, continuations scored)
    for task in tasks:
        if task == "switchhead_lambada":
            rows = _limited(task_data.lambada_rows(metadata), limit)
            jobs.append((task, paper_lambada, rows, len(rows)))
        elif task == "switchhead_blimp" or task.startswith("switchhead_blimp_"):
            paradigms = task_data.blimp_paradigms(metadata) if task == "switchhead_blimp" else [
                task[len("switchhead_blimp_"):]]
            for paradigm in paradigms:
                rows = _limited(task_data.blimp_rows(paradigm, metadata), limit)
                jobs.append((f"switchhead_blimp_{paradigm}", paper_blimp, rows, 2 * len(rows)))
        elif task in ("switchhead_cbt", "switchhead_cbt_cn", "switchhead_cbt_ne"):
            for kind in ["CN", "NE"] if task == "switchhead_cbt" else [task[-2:].upper()]:
                rows = _limited(task_data.cbt_rows(kind, metadata), limit)
                jobs.append((f"switchhead_cbt_{kind.lower()}", paper_cbt, rows, sum(len(r["choices"]) for r in rows)))
        else:
            raise ValueError(f"the paper protocol covers LAMBADA, BLiMP and CBT, not {task!r}")
    scorer = ContinuationScorer(model, tokenizer, batch_size=batch_size)
    results: dict[str, dict[str, float]] = {}
    with Progress(sum(job[3] for job in jobs), "paper protocol", unit="continuations", enabled=progress) as bar:
        scorer.progress = bar
        for name, score, rows, _ in jobs:
            results[name] = score(scorer, rows)
    mean = blimp_mean(results)
    if mean is not None and sum(t.startswith("switchhead_blimp_") for t in results) > 1:
        results["switchhead_blimp"] = {"acc": mean}
    return results
