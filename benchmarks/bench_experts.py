"""Benchmark of Transformers' experts implementations on Mixtral-shaped experts: our "cvmm" against the others.

A stock `MixtralExperts` module (fused gate/up `[E, 2I, d]`, down `[E, d, I]`, SiLU gate, 8 experts, top-2 with
softmax-renormalised weights; width scaled down 8x from Mixtral's d=4096, I=14336 by default, and 8 / 64 tokens,
so that a CPU run takes a few minutes and "batched_mm", which gathers a copy of every slot's expert matrices, fits
in memory) runs its forward, and forward+backward, with each of `experts_implementation` "cvmm" (importing switchhead
registers it), "grouped_mm", "batched_mm" and "eager" (Transformers' per-expert loop). Every implementation is first
checked against eager (exit status 1 on a mismatch). Timings are wall-clock medians of interleaved repetitions
(each repetition runs every implementation once, in a rotating order); the table gives each one's time and its
time divided by cvmm's (> 1: cvmm is faster). Writes JSON and Markdown to benchmarks/results/ with the machine,
CPU, thread count, torch/transformers versions and the load average before and after.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_experts.py                   # CPU: d=512, I=1792
    python benchmarks/bench_experts.py --hidden 4096 --intermediate 14336        # Mixtral's own width (GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

import switchhead  # noqa: F401 - registers the "cvmm" experts implementation
from switchhead import kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
IMPLEMENTATIONS = ("cvmm", "grouped_mm", "batched_mm", "eager")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def make_experts(hidden: int, intermediate: int, experts: int, top_k: int, device, dtype) -> MixtralExperts:
    config = MixtralConfig(hidden_size=hidden, intermediate_size=intermediate, num_local_experts=experts,
                           num_experts_per_tok=top_k)
    module = MixtralExperts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(std=hidden ** -0.5)
        module.down_proj.normal_(std=intermediate ** -0.5)
    return module.to(device=device, dtype=dtype)


def make_routing(tokens: int, experts: int, top_k: int, hidden: int, device, dtype, generator):
    """Hidden states `[N, d]` and Mixtral's routing: softmax over random router logits, top-k, renormalised."""
    states = torch.randn(tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    probs = torch.randn(tokens, experts, generator=generator).softmax(-1)
    weights, index = probs.topk(top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(device=device, dtype=dtype)
    return states, index.to(device), weights


def run(module: MixtralExperts, implementation: str, states, index, weights, backward: bool):
    module.config._experts_implementation = implementation
    if not backward:
        with torch.no_grad():
            return module(states, index, weights)
    module.zero_grad(set_to_none=True)
    states = states.detach().requires_grad_(True)
    out = module(states, index, weights)
    out.float().square().mean().backward()
    return out.detach(), states.grad, module.gate_up_proj.grad, module.down_proj.grad


def check(module, states, index, weights, dtype) -> dict[str, float]:
    """Largest relative difference to eager of the output and the three gradients, per implementation."""
    reference = run(module, "eager", states, index, weights, backward=True)
    errors = {}
    for implementation in IMPLEMENTATIONS[:-1]:
        got = run(module, implementation, states, index, weights, backward=True)
        errors[implementation] = max(((g.float() - r.float()).abs().max() / r.float().abs().max().clamp(min=1e-12))
                                     .item() for g, r in zip(got, reference))
    return errors


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_all(module, states, index, weights, device, reps: int, backward: bool) -> dict[str, float]:
    """Median milliseconds per implementation over `reps` interleaved repetitions (one warm-up round first)."""
    samples = {name: [] for name in IMPLEMENTATIONS}
    for rep in range(reps + 1):
        order = IMPLEMENTATIONS[rep % len(IMPLEMENTATIONS):] + IMPLEMENTATIONS[:rep % len(IMPLEMENTATIONS)]
        for name in order:
            synchronize(device)
            start = time.perf_counter()
            run(module, name, states, index, weights, backward)
            synchronize(device)
            if rep > 0:  # the first round warms up (allocations, lazy imports)
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in samples.items()}


def markdown(report: dict) -> str:
    lines = [
        "# Experts implementations on Mixtral-shaped experts (`benchmarks/bench_experts.py`)",
        "",
        f"Machine `{report['machine']}`, {report['device']} ({report['device_type']}), {report['threads']} threads, "
        f"OMP_WAIT_POLICY={report['omp_wait_policy']}, torch {report['torch']}, transformers {report['transformers']}, "
        f"{report['dtype']}, cvmm backend: {report['cvmm_backend']}. Load average before / after: "
        f"{report['load_before']} / {report['load_after']}"
        + (" (measured under load: other processes shared the CPU)." if report["under_load"] else "."),
        "",
        f"Experts: {report['experts']} x (d={report['hidden']}, I={report['intermediate']}), top-{report['top_k']}, "
        f"SiLU-gated (Mixtral's layout). {report['timing']}; 'x cvmm' = time / cvmm's time (> 1: cvmm is faster).",
        "",
        "| tokens | mode | " + " | ".join(f"{name} ms" for name in IMPLEMENTATIONS) + " | "
        + " | ".join(f"{name} x cvmm" for name in IMPLEMENTATIONS[1:]) + " |",
        "|---:|---|" + "---:|" * (2 * len(IMPLEMENTATIONS) - 1),
    ]
    for row in report["results"]:
        ms = row["ms"]
        lines.append(f"| {row['tokens']} | {row['mode']} | " + " | ".join(f"{ms[n]:.2f}" for n in IMPLEMENTATIONS)
                     + " | " + " | ".join(f"{ms[n] / ms['cvmm']:.2f}" for n in IMPLEMENTATIONS[1:]) + " |")
    lines += ["", "Largest relative error against eager (output and gradients): "
              + ", ".join(f"{tokens} tokens: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
                          for tokens, errors in report["check"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="d (Mixtral: 4096)")
    parser.add_argument("--intermediate", type=int, default=1792, help="I per expert (Mixtral: 14336)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", default="8,64", help="comma-separated token counts (decoding, a batch)")
    parser.add_argument("--reps", type=int, default=5, help="timed interleaved repetitions")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--no-backward", action="store_true", help="time the forward only")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (Markdown beside it); default results/")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    token_counts = [int(t) for t in args.tokens.split(",") if t.strip()]
    load_before = [round(x, 2) for x in os.getloadavg()]
    backend = "triton" if kernels.triton_runs(device, dtype) else "torch"
    print(f"device: {device_name(device)} | {torch.get_num_threads()} threads | {dtype} | "
          f"cvmm backend {backend} | torch {torch.__version__} | load {load_before}")

    generator = torch.Generator().manual_seed(0)
    module = make_experts(args.hidden, args.intermediate, args.experts, args.top_k, device, dtype)
    rows, checks, failed = [], {}, []
    print(f"{'tokens':>7} {'mode':17} " + " ".join(f"{n + ' ms':>14}" for n in IMPLEMENTATIONS)
          + " " + " ".join(f"{n + ' x cvmm':>18}" for n in IMPLEMENTATIONS[1:]))
    for tokens in token_counts:
        states, index, weights = make_routing(tokens, args.experts, args.top_k, args.hidden, device, dtype, generator)
        errors = check(module, states, index, weights, dtype)
        checks[str(tokens)] = errors
        failed += [f"{name} at {tokens} tokens ({error:.1e})" for name, error in errors.items()
                   if error > TOLERANCE[dtype]]
        for mode, backward in (("forward", False), ("forward+backward", True)):
            if backward and args.no_backward:
                continue
            ms = time_all(module, states, index, weights, device, args.reps, backward)
            rows.append(dict(tokens=tokens, mode=mode, ms=ms,
                             relative_to_cvmm={n: ms[n] / ms["cvmm"] for n in IMPLEMENTATIONS}))
            print(f"{tokens:7d} {mode:17} " + " ".join(f"{ms[n]:14.2f}" for n in IMPLEMENTATIONS) + " "
                  + " ".join(f"{ms[n] / ms['cvmm']:18.2f}" for n in IMPLEMENTATIONS[1:]))

    load_after = [round(x, 2) for x in os.getloadavg()]
    cores = os.cpu_count() or 1
    report = dict(
        machine=platform.node(), device=device_name(device), device_type=device.type, cores=cores,
        threads=torch.get_num_threads(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        torch=torch.__version__, transformers=transformers.__version__, dtype=str(dtype),
        cvmm_backend=backend, hidden=args.hidden, intermediate=args.intermediate,
        experts=args.experts, top_k=args.top_k, timing=f"wall-clock median of {args.reps} interleaved repetitions",
        load_before=load_before, load_after=load_after,
        under_load=max(load_before[0], load_after[0]) > 0.5 * cores, check=checks, results=rows,
    )
    slug = "".join(c if c.isalnum() else "-" for c in device_name(device).lower()).strip("-")
    path = args.out or RESULTS / f"experts_{device.type}_{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    if failed:
        print(f"experts implementations disagree with eager beyond {TOLERANCE[dtype]}: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
