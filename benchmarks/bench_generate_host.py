"""What a step of compiled `generate` costs on the host: SwitchHead and its dense baseline against Transformers'
own Llama of the dense model's shape, interleaved, medians; on any device.

    python benchmarks/bench_generate_host.py                   # CUDA if present, else CPU; tiny models
    python benchmarks/bench_generate_host.py --shape 47m-rope  # the 47M RoPE pair's shapes
    python benchmarks/bench_generate_host.py --cpu-smoke       # two steps, one repetition (checks that it runs)

The user's path: `generate` with `cache_implementation="static"`, which compiles the decoding step (on CUDA with
Transformers' default compile config, CUDA graphs included; on a CPU, where `generate` does not compile by itself,
with the same call forced: `CompileConfig(mode="default")` on every device). A step's time is
`generate(long) - generate(short)` over the steps between, so the prompt and the compilation drop out. Tiny models
make the device's work negligible, so the step is what the host spends: `generate`'s loop, the compiled call's guard
check, and launching (or, on a CPU, running) the graph. One profiled `generate` per model splits the step into the
guard check (`TorchDynamo Cache Lookup`), the compiled region, and the rest (`generate`'s own loop).

Llama is the control: what Transformers' generation costs for a model of this size. What SwitchHead adds on the host
is its step less dense's (same package, same code path) and less Llama's (another model's code).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from machine import describe, result_path, save_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MEMBERS = ("llama", "switchhead", "dense", "switchhead/fused")  # in order of value, should the budget run out
PROFILED = {"guards": "TorchDynamo Cache Lookup", "compiled region": "Torch-Compiled Region"}


def configs(shape: str):
    """(SwitchHead, dense) configurations: tiny ones, or a RoPE pair's (`roofline.rope_configs`)."""
    from switchhead import SwitchHeadConfig

    if shape != "tiny":
        return roofline.rope_configs(shape, 2048)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, intermediate_size=256,
                  position_encoding="rope", max_position_embeddings=2048, xl_memory_length=0)
    return (SwitchHeadConfig(**common, num_attention_heads=2, head_dim=32, num_attention_experts=4,
                             num_attention_experts_per_tok=2),
            SwitchHeadConfig(**common, attention_type="dense", num_attention_heads=4))


def llama_like(dense):
    """Transformers' Llama with the dense model's width, depth, heads and MLP width (SwiGLU, RMSNorm: its own code);
    an odd head width is rounded up to even (Llama's RoPE rotates every channel, in pairs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=dense.vocab_size, hidden_size=dense.hidden_size, num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads, num_key_value_heads=dense.num_attention_heads,
        head_dim=dense.head_dim + dense.head_dim % 2, intermediate_size=dense.intermediate_size,
        max_position_embeddings=dense.max_position_embeddings))


def build(member: str, shape: str, device, dtype):
    from switchhead import SwitchHeadForCausalLM

    moe, dense = configs(shape)
    torch.manual_seed(0)
    if member == "llama":
        model = llama_like(dense)
    else:
        model = SwitchHeadForCausalLM(dense if member == "dense" else moe)
        if member == "switchhead/fused":
            model.set_experts_implementation("switchhead_fused")
    return model.to(device=device, dtype=dtype).eval()


def generation_config(new_tokens: int, device):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    compile_config = None
    if device.type != "cuda":  # generate compiles on accelerators only; the same call, forced
        compile_config = CompileConfig(fullgraph=True, mode="default", dynamic=False)
        compile_config._compile_all_devices = True
    return GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                            cache_implementation="static", compile_config=compile_config, pad_token_id=0)


def clock(model, ids, new_tokens: int, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, generation_config=generation_config(new_tokens, device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def profiled_step(model, ids, new_tokens: int, device) -> dict:
    """Microseconds per compiled call in the guard check and in the compiled region, from one profiled `generate`
    (the profiler's own cost is in both)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = clock(model, ids, new_tokens, device)
    parts, calls = {}, 0
    for event in prof.key_averages():
        for part, prefix in PROFILED.items():
            if event.key.startswith(prefix):
                parts[part] = parts.get(part, 0.0) + event.cpu_time_total
                if part == "compiled region":
                    calls += event.count
    return dict(compiled_calls=calls, profiled_generate_s=wall,
                microseconds={part: total / max(calls, 1) for part, total in parts.items()})


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    began = time.perf_counter()
    budget = math.inf if args.time_budget is None else args.time_budget
    ids = torch.randint(0, 100, (args.batch, args.prompt), device=device)
    short, long = args.short, args.short + args.steps
    models, compile_s, not_run = {}, {}, []
    for member in MEMBERS:  # compiles both cache lengths (a static cache's length is in its shape)
        if models and time.perf_counter() - began > budget / 2:  # the rest of the budget is for timing
            not_run.append(member)
            continue
        models[member] = build(member, args.shape, device, dtype)
        start = time.perf_counter()
        clock(models[member], ids, short, device)
        clock(models[member], ids, long, device)
        compile_s[member] = time.perf_counter() - start
    steps = {member: [] for member in models}
    for rep in range(args.reps):
        if rep and time.perf_counter() - began > budget * 0.8:
            break
        for member, model in models.items():
            steps[member].append((clock(model, ids, long, device) - clock(model, ids, short, device)) / args.steps)
    rows = []
    llama_s = statistics.median(steps["llama"])
    dense_s = statistics.median(steps["dense"]) if "dense" in steps else None
    for member, model in models.items():
        step = statistics.median(steps[member])
        row = dict(member=member, step_ms=step * 1e3, ratio_to_llama=step / llama_s,
                   ratio_to_dense=step / dense_s if dense_s else None,
                   first_calls_s=compile_s[member], parameters=sum(p.numel() for p in model.parameters()))
        row.update(profiled_step(model, ids, long, device))
        rows.append(row)
        print(f"{member:17}: {step * 1e3:7.3f} ms a step, {step / llama_s:.3f} of Llama's; profiled (us a step): "
              + ", ".join(f"{k} {v:.0f}" for k, v in row["microseconds"].items()))
    return dict(environment=describe(device), smoke=args.cpu_smoke, shape=args.shape, batch=args.batch,
                prompt=args.prompt, steps=args.steps, reps=len(steps["llama"]),
                dtype=str(dtype).removeprefix("torch."), rows=rows, not_run=not_run)


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# A step of compiled `generate` on the host ({env['device']})", "",
             f"Models: {report['shape']} shapes, {report['dtype']} weights; batch {report['batch']}, a prompt of "
             f"{report['prompt']} tokens, a step timed as the difference of two `generate` calls {report['steps']} "
             f"steps apart, median of {report['reps']} interleaved repetitions; torch {env['torch']}, transformers "
             f"{env['transformers']}" + (f"; {env['threads']} torch thread(s)" if env.get("threads") else "")
             + ". `python benchmarks/bench_generate_host.py" + ("" if report["shape"] == "tiny" else
                                                                 f" --shape {report['shape']}")
             + (f" --threads {env['threads']}" if env.get("threads") else "") + "` reproduces it.", "",
             "The parts come from one `generate` under `torch.profiler` (its overhead included), per compiled call: "
             "the guard check and the compiled region; the rest of a step is `generate`'s own loop.", "",
             "| model | ms a step | / Llama | / dense | guards us (profiled) | compiled region us (profiled) |",
             "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        us = row["microseconds"]
        lines.append(f"| {row['member']} | {row['step_ms']:.3f} | {row['ratio_to_llama']:.3f} | "
                     f"{_ratio(row['ratio_to_dense'])} | {us.get('guards', 0):.0f} | "
                     f"{us.get('compiled region', 0):.0f} |")
    if report.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(report['not_run'])}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny models, two steps, one repetition")
    parser.add_argument("--shape", default="tiny", choices=("tiny", *roofline.PAIR_PRESETS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--short", type=int, default=4, help="new tokens of the shorter generate call")
    parser.add_argument("--steps", type=int, default=64, help="steps between the two generate calls")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (medians over them)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: compile no further model after half of it, start no repetition after 80%%")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on a CPU (default: torch's)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/"
                        "generate_host_<device>.json)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_smoke:
        args.shape, args.steps, args.reps, args.short, args.prompt = "tiny", 2, 1, 2, 4
    # the models share wrapper functions (Transformers' and ours), and dynamo keeps its compiled entries per function:
    # room for every model at both cache lengths, so that none falls back to running uncompiled
    with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit, 4 * len(MEMBERS))):
        report = run(args)
    path = result_path(args.out, RESULTS, "generate_host", report["environment"], args.cpu_smoke)
    save_results(path, report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
