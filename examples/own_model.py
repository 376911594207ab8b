"""SwitchHead in your own model: a small GPT written with torch.nn and `switchhead.SwitchHeadRope`, trained on
WikiText-2 on the CPU beside the same model with dense attention, then converted to a Transformers folder and run
with `generate`, and converted back.

    SWITCHHEAD_DATA_DIR=path/to/data python examples/own_model.py [--steps 200] [--out results.json]

The data folder holds `wikitext-2/wiki.{train,valid}.tokens` and `tokenizers/gpt2/{vocab.json,merges.txt}`
(`scripts/fetch_test_data.py` gets them; default: `../shared/data` beside the checkout). To keep the output layer
small on a CPU, the GPT-2 tokens are renumbered by frequency and the rarest fall into one "<unk>" id.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import switchhead
from switchhead.conversion import config_fields_from_layers, state_dict_from_module, state_dict_to_module


# ------------------------------------------------------------------------------------------------------ the model
class Block(nn.Module):
    """A pre-LayerNorm block around any attention with the authors' forward `(q, k, v, mask, kv_cache)`."""

    def __init__(self, d_model: int, attention: nn.Module, d_ff: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = attention
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Linear(d_ff, d_model))

    def forward(self, x, kv_cache=None):
        h = self.ln1(x)
        attended, kv_cache = self.attn(h, h, h, None, kv_cache)
        x = x + attended
        return x + self.mlp(self.ln2(x)), kv_cache


class GPT(nn.Module):
    """Token embedding, blocks, final LayerNorm, output layer; positions come from the attention's RoPE."""

    def __init__(self, vocab: int, d_model: int, layers: int, make_attention, d_ff: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, make_attention(), d_ff) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x, _ = block(x)
        return self.head(self.ln_f(x))


D_MODEL, LAYERS, D_FF, HEAD = 128, 4, 512, 32
SWITCHHEAD = {"n_heads": 2, "n_experts": 4, "moe_k": 2}  # 2 attention matrices per layer
DENSE = {"n_heads": 4, "n_experts": 1}  # 4 attention matrices: dense v/o (the authors' one-expert form)


def build(kind: str, vocab: int) -> GPT:
    arguments = SWITCHHEAD if kind == "switchhead" else DENSE
    init_scale = math.sqrt(2 / LAYERS)
    return GPT(vocab, D_MODEL, LAYERS, lambda: switchhead.SwitchHeadRope(
        D_MODEL, d_head=HEAD, init_scale=init_scale, **arguments), D_FF)


# -------------------------------------------------------------------------------------------------------- data
def data_dir() -> Path:
    given = os.environ.get("SWITCHHEAD_DATA_DIR")
    return Path(given) if given else Path(__file__).resolve().parents[2] / "shared" / "data"


def load_tokens(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """WikiText-2 train and validation as ids below `vocab` (GPT-2 tokens by frequency; id vocab - 1: the rest)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = data_dir()
    gpt2 = folder / "tokenizers" / "gpt2"
    tokenizer = Tokenizer(models.BPE.from_file(str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt")))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = {split: (folder / "wikitext-2" / f"wiki.{split}.tokens").read_text(encoding="utf-8")
            for split in ("train", "valid")}
    ids = {split: tokenizer.encode(body).ids for split, body in text.items()}
    common = [token for token, _ in collections.Counter(ids["train"]).most_common(vocab - 1)]
    renumber = {token: index for index, token in enumerate(common)}
    words = [tokenizer.decode([token]) for token in common] + ["<unk>"]
    as_tensor = {split: torch.tensor([renumber.get(t, vocab - 1) for t in body]) for split, body in ids.items()}
    return as_tensor["train"], as_tensor["valid"], words


def batches(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator):
    while True:
        starts = torch.randint(0, tokens.numel() - length - 1, (batch,), generator=generator)
        window = torch.stack([tokens[s:s + length + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def train(model: GPT, train_ids: torch.Tensor, valid_ids: torch.Tensor, steps: int, batch: int, length: int,
          seed: int) -> dict:
    """AdamW with a cosine schedule; the training loss every 25 steps and the validation loss at the end."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps)))
    data = batches(train_ids, batch, length, torch.Generator().manual_seed(seed))
    curve, started = [], time.perf_counter()
    model.train()
    for step in range(steps):
        inputs, targets = next(data)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == steps - 1:
            curve.append([step, round(loss.item(), 4)])
    model.eval()
    with torch.no_grad():
        windows = valid_ids[: valid_ids.numel() // (length + 1) * (length + 1)].view(-1, length + 1)[:64]
        valid = F.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten()).item()
    return {"train_loss": curve, "valid_loss": round(valid, 4), "seconds": round(time.perf_counter() - started, 1),
            "parameters": sum(p.numel() for p in model.parameters())}


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -------------------------------------------------------------------------------------------------- conversion
# our model's names for everything around the attention layers (their prefix -> ours; {i}: the layer index)
RENAMES = {"embed.": "model.embed_tokens.", "blocks.{i}.ln1.": "model.layers.{i}.input_layernorm.",
           "blocks.{i}.ln2.": "model.layers.{i}.post_attention_layernorm.",
           "blocks.{i}.mlp.0.": "model.layers.{i}.mlp.up_proj.", "blocks.{i}.mlp.2.": "model.layers.{i}.mlp.down_proj.",
           "ln_f.": "model.norm.", "head.": "lm_head."}


def to_transformers(model: GPT) -> switchhead.SwitchHeadForCausalLM:
    config = switchhead.SwitchHeadConfig(
        vocab_size=model.embed.num_embeddings, num_hidden_layers=len(model.blocks), intermediate_size=D_FF,
        hidden_dropout=0.0, **config_fields_from_layers(model.blocks[0].attn))
    converted = state_dict_from_module(model.state_dict(), config, "blocks.{i}.attn.", RENAMES)
    hf_model = switchhead.SwitchHeadForCausalLM(config)
    hf_model.load_state_dict(converted, strict=True)
    return hf_model.eval()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = parser.parse_args(argv)
    train_ids, valid_ids, words = load_tokens(args.vocab)
    results = {"steps": args.steps, "batch": args.batch, "length": args.length, "vocab": args.vocab,
               "machine": f"{cpu_name()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}"}
    models = {}
    for kind in ("switchhead", "dense"):
        torch.manual_seed(0)
        models[kind] = build(kind, args.vocab)
        results[kind] = train(models[kind], train_ids, valid_ids, args.steps, args.batch, args.length, seed=1)
        print(f"{kind}: valid loss {results[kind]['valid_loss']}, {results[kind]['parameters']} parameters, "
              f"{results[kind]['seconds']} s")

    # our model -> a Transformers folder -> generate; and back, tensor for tensor
    model = models["switchhead"].eval()
    with tempfile.TemporaryDirectory() as folder:
        to_transformers(model).save_pretrained(folder)
        hf_model = switchhead.SwitchHeadForCausalLM.from_pretrained(folder).eval()
    prompt = valid_ids[:16][None]
    with torch.no_grad():
        ours, theirs = model(prompt), hf_model(prompt).logits
    results["logits_max_difference"] = (ours - theirs).abs().max().item()
    # greedy, with the catch-all "<unk>" id (frequent in this renumbering) left out
    generated = hf_model.generate(prompt, max_new_tokens=20, do_sample=False, suppress_tokens=[args.vocab - 1])
    results["prompt"] = "".join(words[t] for t in prompt[0].tolist())
    results["generated"] = "".join(words[t] for t in generated[0, 16:].tolist())
    back = build("switchhead", args.vocab)
    back.load_state_dict(state_dict_to_module(hf_model.state_dict(), hf_model.config, "blocks.{i}.attn.", RENAMES),
                         strict=True)
    results["round_trip_bit_exact"] = all(torch.equal(a, b) for a, b in
                                          zip(model.state_dict().values(), back.state_dict().values()))
    print(f"logits, ours vs the Transformers model: max difference {results['logits_max_difference']:.2e}; "
          f"round trip bit-exact: {results['round_trip_bit_exact']}")
    print(f"generate: {results['generated']!r}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
