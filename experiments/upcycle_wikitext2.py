"""Upcycling a dense model into SwitchHead vs training SwitchHead from scratch, on WikiText-2 (tiny models, CPU).

    OMP_WAIT_POLICY=PASSIVE python experiments/upcycle_wikitext2.py                   # the README numbers
    python experiments/upcycle_wikitext2.py --dense-steps 40 --steps 20 --quick        # a smoke run

1. A dense baseline (`tiny-dense`: d=64, 2 layers, 4 heads of 64 dims... see the table) is trained for
   `--dense-steps` steps.
2. It is upcycled (`switchhead.conversion.upcycle`) into SwitchHead models: H=2 heads x E=4 experts, k=2 (the
   `tiny-switchhead` shape) with both expert initialisations, and H=4 x E=4, k=2 (every head kept: exact start).
   Validation perplexity is measured right after upcycling.
3. Each upcycled model trains `--steps` more steps; SwitchHead from scratch trains the same `--steps` (same
   budget as the continued training) and also `--dense-steps + --steps` (same total budget as dense + upcycled);
   the dense model also continues for `--steps` (its own total).

All runs share one loop: AdamW, linear warmup then cosine decay, gradient clipping, the same batches in the same
order. Results (JSON + Markdown) go to benchmarks/results/, naming the machine, threads and torch version.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DATA = os.path.join(REPO, "..", "shared", "data", "wikitext-2")


def load_data(vocab_size: int, train_chars: int | None):
    from switchhead.training.data import load_documents, tokenize_documents, train_tokenizer

    train_docs, valid_docs = load_documents(DATA)
    if train_chars:
        kept, count = [], 0
        for doc in train_docs:
            if count >= train_chars:
                break
            kept.append(doc[: train_chars - count])
            count += len(kept[-1])
        train_docs = kept
    tokenizer = train_tokenizer(train_docs, vocab_size)
    return tokenizer, tokenize_documents(tokenizer, train_docs), tokenize_documents(tokenizer, valid_docs)


def batches(train_ids: torch.Tensor, block: int, batch: int, steps: int, seed: int):
    """The same `steps` batches for every run: random block starts from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, train_ids.numel() - block - 1, (steps, batch), generator=generator)
    for row in starts:
        yield torch.stack([train_ids[s: s + block] for s in row.tolist()])


def train(model, train_ids, steps: int, args, seed: int) -> list[float]:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = max(1, min(args.warmup, steps // 10))

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    losses = []
    for ids in batches(train_ids, args.block, args.batch, steps, seed):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses


@torch.no_grad()
def perplexity(model, valid_ids: torch.Tensor, block: int, max_blocks: int) -> float:
    model.eval()
    count = min(valid_ids.numel() // block, max_blocks)
    blocks = valid_ids[: count * block].view(count, block)
    total, tokens = 0.0, 0
    for start in range(0, count, 32):
        ids = blocks[start: start + 32]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        total += loss.item() * ids[:, 1:].numel()
        tokens += ids[:, 1:].numel()
    return math.exp(total / tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dense-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=200, help="continued-training / from-scratch budget")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--train-chars", type=int, default=3_000_000, help="leading characters of the train split")
    parser.add_argument("--valid-blocks", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: results are not written")
    parser.add_argument("--output", default=os.path.join(REPO, "benchmarks", "results", "upcycle_wikitext2"))
    args = parser.parse_args()

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
    from switchhead.conversion.upcycle import upcycle_state_dict

    started = time.time()
    tokenizer, train_ids, valid_ids = load_data(args.vocab_size, args.train_chars)
    vocab = len(tokenizer)
    print(f"tokens: train {train_ids.numel():,}, valid {valid_ids.numel():,}; vocab {vocab}", flush=True)

    def fresh(preset: str, seed: int):
        torch.manual_seed(seed)
        return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(preset, vocab_size=vocab,
                                                                  max_position_embeddings=args.block))

    def count(model):
        return sum(p.numel() for p in model.parameters())

    rows = []

    def record(name, model, steps_total, note, losses=None):
        ppl = perplexity(model, valid_ids, args.block, args.valid_blocks)
        rows.append({"run": name, "parameters": count(model), "training_steps": steps_total,
                     "valid_perplexity": ppl, "final_train_loss": losses[-1] if losses else None, "note": note})
        print(f"{name:44s} steps {steps_total:5d}  valid ppl {ppl:9.2f}  ({time.time() - started:.0f}s)", flush=True)

    dense = fresh("tiny-dense", args.seed)
    dense_losses = train(dense, train_ids, args.dense_steps, args, seed=args.seed + 1)
    record("dense (tiny-dense, 4 heads)", dense, args.dense_steps, "the upcycling source", dense_losses)
    dense_state = {k: v.clone() for k, v in dense.state_dict().items()}

    variants = [("upcycled H=2 E=4 k=2, svd", 2, "svd"), ("upcycled H=2 E=4 k=2, heads", 2, "heads"),
                ("upcycled H=4 E=4 k=2, svd (all heads kept)", 4, "svd")]
    continued_seed = args.seed + 2  # the batches after the dense run: the same for every continued run
    for name, heads, init in variants:
        result = upcycle_state_dict(dense.config, dense_state, heads=heads, experts=4, k=2, expert_init=init,
                                    router_noise=0.01, seed=args.seed)
        model = SwitchHeadForCausalLM(result.config)
        model.load_state_dict(result.state_dict)
        record(name + ": right after upcycling", model, args.dense_steps, "no training after upcycling")
        losses = train(model, train_ids, args.steps, args, seed=continued_seed)
        record(name + f": +{args.steps} steps", model, args.dense_steps + args.steps, "continued training", losses)

    scratch = fresh("tiny-switchhead", args.seed)
    losses = train(scratch, train_ids, args.steps, args, seed=continued_seed)
    record("SwitchHead from scratch (H=2 E=4 k=2)", scratch, args.steps, "same budget as the continued training",
           losses)
    scratch = fresh("tiny-switchhead", args.seed)
    losses = train(scratch, train_ids, args.dense_steps + args.steps, args, seed=args.seed + 1)
    record("SwitchHead from scratch (H=2 E=4 k=2)", scratch, args.dense_steps + args.steps,
           "same total budget as dense + continued", losses)
    dense.load_state_dict(dense_state)
    losses = train(dense, train_ids, args.steps, args, seed=continued_seed)
    record(f"dense, +{args.steps} steps", dense, args.dense_steps + args.steps, "the dense model trained on", losses)

    info = {
        "machine": platform.node(), "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": sys.version.split()[0],
        "load_note": "measured on a shared 2-core machine under load from other processes (speed is not reported)",
        "settings": {k: v for k, v in vars(args).items() if k != "output"},
        "data": "WikiText-2 (train: leading characters as set; valid: the first valid_blocks blocks)",
        "seconds": round(time.time() - started, 1), "rows": rows,
    }
    if args.quick:
        print(json.dumps(rows, indent=1))
        return 0
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output + ".json", "w", encoding="utf-8") as handle:
        json.dump(info, handle, indent=2)
    with open(args.output + ".md", "w", encoding="utf-8") as handle:
        handle.write(f"# Upcycling vs from scratch, WikiText-2, tiny models\n\n"
                     f"Machine {info['machine']} ({info['cpu']}), {info['threads']} threads, torch {info['torch']}; "
                     f"{info['load_note']}. One seed. Command: `OMP_WAIT_POLICY=PASSIVE python "
                     f"experiments/upcycle_wikitext2.py` ({info['seconds']} s).\n\n"
                     f"Settings: {json.dumps(info['settings'])}\n\n"
                     "| run | parameters | training steps | valid perplexity | note |\n|---|---|---|---|---|\n")
        for row in rows:
            handle.write(f"| {row['run']} | {row['parameters']:,} | {row['training_steps']} | "
                         f"{row['valid_perplexity']:.2f} | {row['note']} |\n")
    print(f"wrote {args.output}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
