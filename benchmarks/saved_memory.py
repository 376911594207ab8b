"""What a training step keeps for its backward, part by part: SwitchHead against its dense baseline.

    python benchmarks/saved_memory.py [--context 512] [--batch 2]

For the 47M pairs of bench_model.py (RoPE and XL, fp32, sdpa, training mode, dropout off), one forward of the LM
loss under `torch.autograd.graph.saved_tensors_hooks` records every tensor autograd keeps for the backward. Each
storage is counted once (views share it), parameters are left out (they are there anyway), and the bytes are given
to the outermost part of the model that was running when they were saved: the attention layers, the MLPs, the
LayerNorms, or the rest (embedding, LM head, loss, residual additions). This is deterministic, unlike the resident
set that bench_model.py's peak memory follows, and it says which part a memory ratio can move: SwitchHead changes
only the attention, and the MLP, LayerNorms and logits are the same in both models of a pair. JSON + Markdown go to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402
from machine import describe  # noqa: E402

from switchhead.modeling_switchhead import SigmaMoeMLP, SwitchHeadAttentionBase, SwitchHeadMLP  # noqa: E402

PARTS = ("attention", "mlp", "layernorm", "rest")
RESULTS = Path(__file__).resolve().parent / "results"


def part_of(module: nn.Module) -> str | None:
    if isinstance(module, SwitchHeadAttentionBase):
        return "attention"
    if isinstance(module, (SwitchHeadMLP, SigmaMoeMLP)):
        return "mlp"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    return None


def saved_bytes(model: nn.Module, batch: int, context: int) -> dict[str, int]:
    """Bytes autograd saves in one training forward of `model`, by part (see the module docstring)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    by_part = dict.fromkeys(PARTS, 0)
    running: list[str] = []  # parts entered and not yet left, outermost first
    hooks = []

    def enter(module, args):
        running.append(part_of(module))

    def leave(module, args, output):
        running.pop()  # returns None: the output stays as it is

    for module in model.modules():
        if part_of(module) is not None:
            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameters and pointer not in seen:
            seen.add(pointer)
            by_part[running[0] if running else "rest"] += storage.nbytes()
        return tensor

    ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    finally:
        for hook in hooks:
            hook.remove()
    loss.backward()  # the recorded graph is complete: it runs
    return by_part


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2-layer models (smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "saved_memory_cpu.json")
    args = parser.parse_args(argv)
    if args.context < 1 or args.batch < 1:
        parser.error("--context and --batch must be at least 1")
    torch.set_num_threads(1)
    saved = {}
    for moe, dense in bench_model.PAIRS.values():
        for name in (moe, dense):
            saved[name] = saved_bytes(bench_model.build(name, args.quick, "sdpa"), args.batch, args.context)
    ratios = {}
    for family, (moe, dense) in bench_model.PAIRS.items():
        ratios[family] = {part: saved[moe][part] / saved[dense][part] if saved[dense][part] else None for part in PARTS}
        ratios[family]["total"] = sum(saved[moe].values()) / sum(saved[dense].values())
    report = dict(machine=describe(torch.device("cpu")), batch=args.batch, context=args.context, quick=args.quick,
                  saved_bytes=saved, ratios=ratios)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    mib = 2 ** 20
    lines = ["# Saved for the backward, by part of the model", "",
             f"One training forward, batch {args.batch} x {args.context}, fp32, sdpa, dropout off"
             f"{', 2-layer models' if args.quick else ''}; torch {report['machine']['torch']}. MiB autograd keeps "
             "(each storage once, parameters left out), by the outermost part running when it was saved.", "",
             "| model | " + " | ".join(PARTS) + " | total |", "|---|" + "---|" * (len(PARTS) + 1)]
    for name, parts in saved.items():
        lines.append(f"| {name} | " + " | ".join(f"{parts[p] / mib:.0f}" for p in PARTS)
                     + f" | {sum(parts.values()) / mib:.0f} |")
    lines += ["", "| SwitchHead / dense | " + " | ".join(PARTS) + " | total |", "|---|" + "---|" * (len(PARTS) + 1)]
    for family, row in ratios.items():
        lines.append(f"| {family} | " + " | ".join("n/a" if row[p] is None else f"{row[p]:.2f}"
                                                   for p in PARTS + ("total",)) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
