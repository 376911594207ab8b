"""One attention block, forward and backward: dense against SwitchHead per projection ("eager") and fused
("switchhead_fused"), interleaved, medians; on any device.

    python benchmarks/bench_attention_block.py                     # CUDA if present (bf16 autocast), else CPU (fp32)
    python benchmarks/bench_attention_block.py --cpu-smoke         # tiny shapes, one repetition (checks that it runs)

Each pair's configurations are the GPU matrices' (`roofline.rope_configs`: the 47M and 262M RoPE presets and their
dense baselines with RoPE), one layer. A step is the layer's `self_attn` (projections, RoPE, sdpa) forward and
backward on `batch x tokens` random hidden states; the models of a pair run in turn within every repetition. Each
row also carries the cost model's count for that block (`roofline.attention_ops`). JSON and Markdown go to
benchmarks/results/ named after the device.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from machine import describe, result_path, save_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MEMBERS = (("dense", None), ("switchhead/eager", "eager"), ("switchhead/fused", "switchhead_fused"))


def block(config, implementation, device):
    from switchhead import SwitchHeadForCausalLM

    config = type(config).from_dict(config.to_dict())
    config.num_hidden_layers, config.hidden_dropout = 1, 0.0
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).to(device).train()
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model.model.rotary_emb, model.model.layers[0].self_attn


def timed_steps(rotary, attention, batch, tokens, steps, device, autocast) -> float:
    """Median seconds of `steps` forward + backward passes of the block."""
    hidden = torch.randn(batch, tokens, attention.config.hidden_size, device=device, requires_grad=True)
    positions = torch.arange(tokens, device=device)[None].expand(batch, -1)
    embeddings = rotary(hidden, positions) if rotary is not None else None
    context = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with context:
            out, _ = attention(hidden, position_embeddings=embeddings, attention_mask=None)
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        hidden.grad = None
        attention.zero_grad(set_to_none=True)
    return statistics.median(times)


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    autocast = device.type == "cuda"
    pairs = {"tiny": None} if args.cpu_smoke else {p: None for p in args.pairs.split(",")}
    rows = []
    for pair in pairs:
        if pair == "tiny":
            from switchhead import SwitchHeadConfig

            moe = SwitchHeadConfig.from_preset("tiny-switchhead")
            dense = SwitchHeadConfig.from_preset("tiny-dense", position_encoding="rope", xl_memory_length=0)
        else:
            moe, dense = roofline.rope_configs(pair, args.tokens)
        blocks = {label: block(dense if implementation is None else moe, implementation, device)
                  for label, implementation in MEMBERS}
        for label in blocks:  # warm-up
            timed_steps(*blocks[label], args.batch, args.tokens, 1, device, autocast)
        seconds = {label: [] for label in blocks}
        for _ in range(args.reps):
            for label in blocks:
                seconds[label].append(timed_steps(*blocks[label], args.batch, args.tokens, args.steps, device,
                                                  autocast))
        dense_s = statistics.median(seconds["dense"])
        for label, implementation in MEMBERS:
            config = dense if implementation is None else moe
            counts = roofline.attention_ops(config, implementation, tokens=min(args.tokens, 256))
            step = statistics.median(seconds[label])
            rows.append(dict(pair=pair, label=label, seconds=step, ratio_to_dense=step / dense_s,
                             aten_ops=counts["forward"] + counts["backward"]))
            print(f"{pair} {label:17}: {step * 1e3:8.2f} ms, {step / dense_s:.3f} of dense")
    return dict(environment=describe(device), smoke=args.cpu_smoke, batch=args.batch, tokens=args.tokens,
                reps=args.reps, steps=args.steps, autocast_bf16=autocast, rows=rows)


def markdown(report: dict) -> str:
    env = report["environment"]
    precision = "bf16 autocast" if report["autocast_bf16"] else "fp32"
    lines = [f"# One attention block, forward + backward ({env['device']})", "",
             f"{precision}, batch {report['batch']} x {report['tokens']} tokens, medians of {report['reps']} "
             f"interleaved repetitions of {report['steps']} steps; torch {env['torch']}, transformers "
             f"{env['transformers']}. `python benchmarks/bench_attention_block.py` reproduces it.", "",
             "| pair | block | ms | / dense | aten ops (cost model) |", "|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['pair']} | {row['label']} | {row['seconds'] * 1e3:.2f} | {row['ratio_to_dense']:.3f} "
                     f"| {row['aten_ops']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny presets, one repetition")
    parser.add_argument("--pairs", default="47m-rope,262m-rope", help="comma separated, of " +
                        ", ".join(roofline.PAIR_PRESETS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (medians over them)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per model and repetition")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/"
                        "attention_block_<device>.json)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.batch, args.tokens, args.reps, args.steps = 2, 16, 1, 1
    report = run(args)
    path = result_path(args.out, RESULTS, "attention_block", report["environment"], args.cpu_smoke)
    save_results(path, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
