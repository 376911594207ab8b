"""Perplexity and bits per byte of any causal LM on a text file or dataset, with a stated protocol.

Protocols (every token is scored at most once; the first token of the text has no context and is never scored):

* ``chunked``: the token stream is cut into non-overlapping windows of `context` tokens; each window is scored on
  its own, so the first token of every window is not scored and later tokens see only their own window.
* ``sliding``: windows of `context` tokens move by `stride` tokens; each window scores only the tokens not scored
  before, so every token after the first window sees at least `context - stride` tokens of context. Every token
  except the first is scored.

Perplexity is exp(total NLL / scored tokens); bits per byte is total NLL / ln 2 / UTF-8 bytes of the text (the
whole text, as is usual; with `chunked` a few tokens are unscored, so it slightly favours that protocol).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PROTOCOLS = ("chunked", "sliding")


@dataclass
class PerplexityResult:
    protocol: str
    context: int
    stride: int
    tokens: int  # tokens of the text
    scored_tokens: int
    bytes: int
    nll: float  # summed negative log-likelihood in nats
    perplexity: float
    bits_per_byte: float

    def as_dict(self) -> dict:
        return asdict(self)


def read_text(path: str | Path, field: str = "text") -> str:
    """A `.txt` / WikiText `.tokens` file as is, or the `field` of every line of a `.jsonl` file joined by newlines."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        if rows and field not in rows[0]:
            raise ValueError(f"{path} has no field {field!r}; its fields are {', '.join(rows[0])}")
        return "\n".join(row[field] for row in rows)
    return path.read_text(encoding="utf-8")


def load_dataset_text(name: str, config: str | None = None, split: str = "test", field: str = "text") -> str:
    """The `field` of every row of a `datasets` dataset (Hub name or local builder), joined by newlines."""
    import datasets

    data = datasets.load_dataset(name, config, split=split)
    if field not in data.column_names:
        raise ValueError(f"dataset {name} has no column {field!r}; its columns are {', '.join(data.column_names)}")
    return "\n".join(data[field])


def windows(num_tokens: int, context: int, stride: int, protocol: str) -> list[tuple[int, int, int]]:
    """(start, end, first_scored) per window: inputs are tokens[start:end], scored targets [first_scored, end)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    if context < 2:
        raise ValueError(f"context ({context}) must be >= 2")
    if protocol == "chunked":
        return [(start, min(start + context, num_tokens), start + 1)
                for start in range(0, num_tokens, context) if min(start + context, num_tokens) - start > 1]
    if not 1 <= stride < context:
        raise ValueError(f"stride ({stride}) must be in [1, context) for the sliding protocol (context={context})")
    spans, scored_until = [], 1
    end = min(context, num_tokens)
    while scored_until < num_tokens:
        spans.append((max(0, end - context), end, scored_until))
        scored_until, end = end, min(end + stride, num_tokens)
    return spans


@torch.no_grad()
def evaluate_perplexity(model, tokenizer, text: str, context: int | None = None, stride: int | None = None,
                        protocol: str = "sliding", batch_size: int = 4, progress: bool = True) -> PerplexityResult:
    """Score `text` with a causal LM (any AutoModelForCausalLM) under the chosen protocol.

    Args:
        context: window length in tokens; defaults to the model's `max_position_embeddings`.
        stride: sliding-window step; defaults to half the context. Ignored by `chunked`.
    """
    from .progress import Progress

    context = context or getattr(model.config, "max_position_embeddings", 1024)
    stride = (stride or max(1, context // 2)) if protocol == "sliding" else context
    # the whole text at once, longer than the model's context by design (it is scored in windows below):
    # verbose=False keeps Transformers from warning that the ids would overflow the model
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False).input_ids, dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError("the text has fewer than 2 tokens; nothing to score")
    spans = windows(ids.numel(), context, stride, protocol)
    device = next(model.parameters()).device
    model.eval()
    nll, scored = 0.0, 0
    bar = Progress(len(spans), f"perplexity ({protocol})", unit="windows", enabled=progress)
    for first in range(0, len(spans), batch_size):
        batch = spans[first:first + batch_size]
        width = max(end - start for start, end, _ in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (start, end, _) in enumerate(batch):
            input_ids[row, : end - start], mask[row, : end - start] = ids[start:end], 1
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        log_probs = torch.log_softmax(logits, dim=-1)
        for row, (start, end, first_scored) in enumerate(batch):
            positions = torch.arange(first_scored - start - 1, end - start - 1)  # position p predicts token p+1
            targets = ids[first_scored:end]
            nll -= float(log_probs[row, positions, targets].sum())
            scored += targets.numel()
        bar.update(len(batch))
    bar.close()
    num_bytes = len(text.encode("utf-8"))
    return PerplexityResult(protocol=protocol, context=context, stride=stride, tokens=int(ids.numel()),
                            scored_tokens=scored, bytes=num_bytes, nll=nll, perplexity=math.exp(nll / scored),
                            bits_per_byte=nll / math.log(2) / num_bytes)
