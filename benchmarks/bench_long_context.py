"""Training at long context on a GPU: SwitchHead against its dense baseline at 65,536 tokens a step, where fewer
attention heads must pay (the attention core is 8% of the dense 47M step at T=512 and 72% at T=16k), and prefill at
batch 1.

    python benchmarks/bench_long_context.py train               # the training matrix (CUDA)
    python benchmarks/bench_long_context.py prefill             # prefill at batch 1, 1k and 16k tokens (CUDA)
    python benchmarks/bench_long_context.py train --cpu-smoke   # anywhere: 2-layer models, tiny shapes

Training matrix (each group is one context; its models run interleaved, medians over the repetitions): the 47M RoPE
pair at T = 512, 4k, 16k and the 262M RoPE pair at T = 1k, 8k, 16k, batch = 65,536 / T; SwitchHead with its experts
on the PyTorch all-experts path ("eager") and as the fused block ("switchhead_fused") at every context, and on the
sparse Triton kernel ("cvmm") at the paper contexts only; the 47M Transformer-XL pair at the paper's batch and
context (64 x 256); and an alignment control, the dense 47M with d_head and d_ff rounded to multiples of 64 (a
control of the dense baseline's unaligned shapes, not a SwitchHead figure). AdamW (fused), fp32 weights, bf16
autocast, sdpa attention (flash where it runs).
Each model reports its step time (CUDA events), peak memory (weights, gradients and optimizer state, plus the rise
of the allocator's peak during a step), its model FLOPs (benchmarks/roofline.py) and the time those FLOPs take at
the measured bf16 matmul ceiling, i.e. measured over ideal. Ratios are SwitchHead / dense of the same group.

Prefill: batch 1, bf16 weights, a static cache, the forward captured in a CUDA graph (so the figure is the device's
time, not Python's), at 1k and 16k tokens; the FLOP floor beside each.

A group whose weights and optimizer state alone would not fit is not started; an out-of-memory error is recorded and
the run goes on. `--time-budget` starts no group the time left cannot hold (judged from the groups run so far). The
JSON is rewritten after every group, so a run stopped at a limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from bench_e2e import Clock, Trainer  # noqa: E402
from machine import describe, gpu_or_smoke, result_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = 65536
SH_47M, DENSE_47M = "wt103-45m-switchhead-rope", "wt103-47m-dense-xl"
SH_262M, DENSE_262M = "wt103-243m-switchhead-rope", "wt103-262m-dense-xl"
ROPE = dict(position_encoding="rope", xl_memory_length=0)
ALIGNED_47M = dict(ROPE, head_dim=64, intermediate_size=2048)  # 41 -> 64, 2053 -> 2048


def groups(smoke: bool) -> list[dict]:
    """The training matrix, most valuable first (contexts never measured before the paper's)."""
    def member(label, preset, overrides, experts=None, position_term=None):
        return dict(label=label, preset=preset, overrides=overrides, experts=experts, position_term=position_term)

    def pair(name, sh, dense, context, kernels, batch=None, extra=()):
        members = [member("dense", dense, dict(ROPE, max_position_embeddings=context)),
                   member("switchhead/auto", sh, dict(max_position_embeddings=context), "switchhead_auto"),
                   member("switchhead/eager", sh, dict(max_position_embeddings=context), "eager"),
                   member("switchhead/fused", sh, dict(max_position_embeddings=context), "switchhead_fused")]
        if kernels:
            members.append(member("switchhead/cvmm", sh, dict(max_position_embeddings=context), "cvmm"))
        members += list(extra)
        return dict(name=f"{name}@{context}", context=context, batch=batch or TOKENS // context, members=members)

    if smoke:  # the same code paths on tiny presets
        return [pair("tiny-rope", "tiny-switchhead", "tiny-dense", 64, True, batch=2),
                dict(name="tiny-xl@32", context=32, batch=2,
                     members=[member("dense", "tiny-dense-xl", {}),
                              member("dense/gathered", "tiny-dense-xl", {}, None, "gathered"),
                              member("switchhead/auto", "tiny-switchhead-xl", {}, "switchhead_auto"),
                              member("switchhead/auto-gathered", "tiny-switchhead-xl", {}, "switchhead_auto",
                                     "gathered"),
                              member("switchhead/eager", "tiny-switchhead-xl", {}, "eager"),
                              member("switchhead/fused", "tiny-switchhead-xl", {}, "switchhead_fused")])]
    aligned = member("dense/aligned-64", DENSE_47M, dict(ALIGNED_47M, max_position_embeddings=512))
    return [
        pair("47m-rope", SH_47M, DENSE_47M, 4096, False),
        pair("262m-rope", SH_262M, DENSE_262M, 8192, False),
        pair("47m-rope", SH_47M, DENSE_47M, 16384, False),
        pair("262m-rope", SH_262M, DENSE_262M, 16384, False),
        pair("47m-rope", SH_47M, DENSE_47M, 512, True, extra=[aligned]),
        pair("262m-rope", SH_262M, DENSE_262M, 1024, True),
        dict(name="47m-xl@256", context=256, batch=64,
             members=[member("dense", DENSE_47M, {}),
                      member("dense/gathered", DENSE_47M, {}, None, "gathered"),
                      member("switchhead/auto", "wt103-47m-switchhead-xl", {}, "switchhead_auto"),
                      member("switchhead/auto-gathered", "wt103-47m-switchhead-xl", {}, "switchhead_auto",
                             "gathered"),
                      member("switchhead/eager", "wt103-47m-switchhead-xl", {}, "eager"),
                      member("switchhead/fused", "wt103-47m-switchhead-xl", {}, "switchhead_fused"),
                      member("switchhead/cvmm", "wt103-47m-switchhead-xl", {}, "cvmm")]),
    ]


class PositionTerm:
    """While active, XL's position term as `term` builds it: "gathered", the gather over distances (the reference
    twin of the relative shift, timed as a control); None, the model's own."""

    def __init__(self, term: str | None):
        self.term, self.saved = term, None

    def __enter__(self):
        from switchhead import positions

        if self.term == "gathered":
            self.saved = positions.xl_position_bias
            positions.xl_position_bias = positions.xl_position_bias_gathered
        return self

    def __exit__(self, *exc):
        from switchhead import positions

        if self.saved is not None:
            positions.xl_position_bias, self.saved = self.saved, None


def make_config(preset: str, overrides: dict, smoke: bool, attn: str) -> SwitchHeadConfig:
    small = dict(num_hidden_layers=2) if smoke else {}
    config = SwitchHeadConfig.from_preset(preset, **{**overrides, **small, "hidden_dropout": 0.0})
    config._attn_implementation = attn
    return config


def build(config, device, experts):
    torch.manual_seed(0)
    with torch.device(device):
        model = SwitchHeadForCausalLM(config)
    if experts is not None:
        model.set_experts_implementation(experts)
    return model


def static_bytes_estimate(config) -> int:
    """fp32 weights, gradients and AdamW's two moments, from a meta-device build (nothing allocated)."""
    parameters, _ = roofline.parameter_counts(config)
    return 16 * parameters


# ------------------------------------------------------------------------------------------------ training
def run_group(group: dict, args, device, ceilings: dict, log) -> dict:
    smoke = args.cpu_smoke
    clock = Clock(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    result = dict(group=group["name"], context=group["context"], batch=group["batch"], members={}, errors={})
    configs = {m["label"]: make_config(m["preset"], m["overrides"], smoke, args.attn) for m in group["members"]}
    need = sum(static_bytes_estimate(c) for c in configs.values())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if need > 0.6 * free:
            result["errors"]["group"] = (f"not started: weights and optimizer state alone need {need / 2 ** 30:.1f} "
                                         f"GiB of {free / 2 ** 30:.1f} GiB free")
            return result
    trainers = {}
    for m in group["members"]:
        label, config = m["label"], configs[m["label"]]
        entry = result["members"][label] = dict(preset=m["preset"], overrides=m["overrides"],
                                                experts=m["experts"], samples=[])
        if m.get("position_term"):
            entry["position_term"] = m["position_term"]
        try:
            model = build(config, device, m["experts"])
            entry["parameters"] = sum(p.numel() for p in model.parameters())
            entry["experts_implementation"] = model.config._experts_implementation
            trainer = Trainer(model, group["batch"], group["context"], device, autocast)
            step, term = trainer.step, PositionTerm(m.get("position_term"))

            def stepped(step=step, term=term):
                with term:
                    return step()

            trainer.step = stepped
            trainer.step()  # warm-up: kernels compiled and tuned, optimizer state allocated
            trainer.step()
            entry["peak_bytes"] = trainer.peak_bytes()
            entry["model_flops"] = roofline.training_flops(config, group["batch"], group["context"])
            trainers[label] = trainer
        except torch.OutOfMemoryError as error:
            result["errors"][label] = f"out of memory: {str(error).splitlines()[0][:200]}"
            trainers.pop(label, None)
            torch.cuda.empty_cache()
    for rep in range(args.reps):
        for label, trainer in trainers.items():
            result["members"][label]["samples"].append(
                statistics.median(clock(trainer.step) for _ in range(args.steps)))
    del trainers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    summarize_group(result, ceilings)
    log(f"{group['name']} (batch {group['batch']}): " + ", ".join(
        f"{label} {e['seconds'] * 1e3:.1f} ms ({e.get('over_ideal', math.nan):.2f}x ideal)"
        for label, e in result["members"].items() if "seconds" in e) +
        "".join(f"; {k}: {v}" for k, v in result["errors"].items()))
    return result


def summarize_group(result: dict, ceilings: dict) -> None:
    dense = result["members"].get("dense", {})
    for label, entry in result["members"].items():
        if not entry["samples"]:
            continue
        entry["seconds"] = statistics.median(entry["samples"])
        if ceilings.get("matmul_flops") and entry.get("model_flops"):
            entry["ideal_seconds"] = entry["model_flops"] / ceilings["matmul_flops"]
            entry["over_ideal"] = entry["seconds"] / entry["ideal_seconds"]
            entry["tflops"] = entry["model_flops"] / entry["seconds"] / 1e12
        if label != "dense" and dense.get("seconds"):
            entry["time_ratio"] = entry["seconds"] / dense["seconds"]
            if entry.get("peak_bytes") and dense.get("peak_bytes"):
                entry["memory_ratio"] = entry["peak_bytes"] / dense["peak_bytes"]
            entry["flop_ratio"] = entry["model_flops"] / dense["model_flops"]


# ------------------------------------------------------------------------------------------------ prefill
def prefill_cell(preset: str, overrides: dict, tokens: int, args, device, ceilings: dict) -> dict:
    """Batch-1 prefill of `tokens` tokens into a static cache, bf16 weights, captured in a CUDA graph on a GPU."""
    from transformers import StaticCache

    config = make_config(preset, dict(overrides, max_position_embeddings=tokens), args.cpu_smoke, args.attn)
    model = build(config, device, None).eval().to(torch.bfloat16)
    cache = StaticCache(config=model.config, max_cache_len=tokens)
    ids = torch.randint(1, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(3)).to(device)
    positions = torch.arange(tokens, device=device)[None]

    def forward():
        for layer in cache.layers:  # start from an empty cache (in the graph too: the counter lives on the device)
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.zero_()
        return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1).logits

    with torch.no_grad():
        eager_logits = forward().float()
        graph, graph_error = None, None
        try:
            graph = capture(forward, device)
        except Exception as error:  # noqa: BLE001 (a forward that cannot be captured is timed eagerly, and said)
            graph_error = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            torch.cuda.synchronize()
        if graph is not None:
            graph_logits = graph["replay"]().float()
            agree = bool(torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1)))
            run = graph["replay"]
        else:
            agree, run = None, forward
        clock = Clock(device)
        samples = [clock(run) for _ in range(args.reps * 3)]
    seconds = statistics.median(samples)
    flops = roofline.forward_flops(config, 1, tokens)
    cell = dict(preset=preset, tokens=tokens, seconds=seconds, samples=samples, graph=graph is not None,
                graph_argmax_equals_eager=agree, model_flops=flops)
    if graph_error:
        cell["graph_error"] = graph_error
    if ceilings.get("matmul_flops"):
        cell["ideal_seconds"] = flops / ceilings["matmul_flops"]
        cell["over_ideal"] = seconds / cell["ideal_seconds"]
    del model, cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cell


def capture(step, device):
    """`step` captured in a CUDA graph (after warm-up runs on a side stream, as capture requires), or None on the
    CPU. Returns {"replay": callable returning the graph's output tensor}."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()

    def replay():
        graph.replay()
        return output

    return dict(replay=replay, graph=graph)


def run_prefill(args, device, ceilings, log, save) -> list:
    pairs = ([("tiny", "tiny-switchhead", {}, "tiny-dense", dict(ROPE))] if args.cpu_smoke else
             [("47m-rope", SH_47M, {}, DENSE_47M, ROPE), ("262m-rope", SH_262M, {}, DENSE_262M, ROPE)])
    lengths = [16, 32] if args.cpu_smoke else [1024, 16384]
    rows = []
    for tokens in lengths:
        for name, sh, sh_over, dense, dense_over in pairs:
            row = dict(pair=name, tokens=tokens)
            try:
                row["switchhead"] = prefill_cell(sh, sh_over, tokens, args, device, ceilings)
                row["dense"] = prefill_cell(dense, dense_over, tokens, args, device, ceilings)
                row["time_ratio"] = row["switchhead"]["seconds"] / row["dense"]["seconds"]
                log(f"prefill {name} {tokens}: switchhead {row['switchhead']['seconds'] * 1e3:.2f} ms, dense "
                    f"{row['dense']['seconds'] * 1e3:.2f} ms, ratio {row['time_ratio']:.2f}")
            except Exception as error:  # noqa: BLE001 (recorded; the other cells go on)
                row["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
                log(f"prefill {name} {tokens}: {row['error']}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            save(rows)
    return rows


# ------------------------------------------------------------------------------------------------ report
TRAIN_TARGETS = {"47m-rope@512": 0.80, "262m-rope@1024": 0.90, "47m-rope@4096": 0.65, "262m-rope@8192": 0.75,
                 "262m-rope@16384": 0.65, "47m-xl@256": 0.72}  # time, SwitchHead / dense (for the record)
MEMORY_TARGETS = {"rope": 0.85, "xl": 0.65}
PREFILL_TARGETS = {("47m-rope", 1024): 1.1, ("262m-rope", 1024): 1.1, ("262m-rope", 16384): 0.7}


def verdict(value, bound) -> str:
    return "" if value is None or bound is None else f"<= {bound}: {'met' if value <= bound else 'missed'}"


def header(report: dict, what: str) -> list[str]:
    env, ceil = report["environment"], report.get("ceilings") or {}
    measured = (f"measured ceilings: bf16 matmul {ceil['matmul_flops'] / 1e12:.0f} TFLOP/s, copy "
                f"{ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s" if ceil.get("matmul_flops") else "no ceilings (CPU)")
    return [f"# {what} ({'CPU smoke' if report['smoke'] else env['device']})", "",
            f"Device: {env['device']}; driver {env.get('driver')}; CUDA {env.get('cuda')}; torch {env['torch']}; "
            f"triton {env['triton']}; transformers {env['transformers']}; {report['precision']}; {measured}.", ""]


def markdown(report: dict) -> str:
    if report["stage"] == "prefill":
        lines = header(report, "Prefill, batch 1") + [
            "Static cache, bf16 weights, the forward captured in a CUDA graph. Ideal: model FLOPs over the measured "
            "matmul ceiling.", "",
            "| pair | tokens | SwitchHead ms | dense ms | SwitchHead / dense | target | x ideal (SwitchHead / dense) "
            "| graph = eager (argmax) |", "|---|---|---|---|---|---|---|---|"]
        for row in report.get("prefill", []):
            if "error" in row:
                lines.append(f"| {row['pair']} | {row['tokens']} | {row['error']} | | | | | |")
                continue
            moe, dense = row["switchhead"], row["dense"]
            ideal = " / ".join(f"{c['over_ideal']:.1f}" if "over_ideal" in c else "-" for c in (moe, dense))
            same = " / ".join({True: "yes", False: "no", None: "-"}[c.get("graph_argmax_equals_eager")]
                              for c in (moe, dense))
            lines.append(f"| {row['pair']} | {row['tokens']} | {moe['seconds'] * 1e3:.2f} | "
                         f"{dense['seconds'] * 1e3:.2f} | {row['time_ratio']:.2f} | "
                         f"{verdict(row['time_ratio'], PREFILL_TARGETS.get((row['pair'], row['tokens'])))} | "
                         f"{ideal} | {same} |")
        return "\n".join(lines) + "\n"
    lines = header(report, f"Training step, {report['tokens_per_step']:,} tokens") + [
        f"AdamW (fused), fp32 weights, bf16 autocast, attention {report['attn']}; medians of {report['reps']} "
        f"interleaved repetitions of {report['steps']} steps. Predicted: the ratio of model FLOPs "
        "(benchmarks/roofline.py), what the step would take if time followed FLOPs. Ideal: model FLOPs over the "
        "measured matmul ceiling.", "",
        "| group (batch) | model | experts | ms | peak GiB | TFLOP/s | x ideal | time / dense | predicted | "
        "measured / predicted | memory / dense | time target | memory target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for group in report["groups"]:
        kind = "xl" if "-xl@" in group["group"] else "rope"
        for label, entry in group["members"].items():
            if "seconds" not in entry:
                continue
            ratio, memory, predicted = (entry.get(k) for k in ("time_ratio", "memory_ratio", "flop_ratio"))
            switchhead = label.startswith("switchhead")
            cells = [f"{group['group']} ({group['batch']})", label,
                     entry.get("experts_implementation", "-") if switchhead else "-",
                     f"{entry['seconds'] * 1e3:.1f}",
                     f"{entry['peak_bytes'] / 2 ** 30:.2f}" if entry.get("peak_bytes") else "-",
                     f"{entry['tflops']:.0f}" if "tflops" in entry else "-",
                     f"{entry['over_ideal']:.1f}" if "over_ideal" in entry else "-",
                     f"{ratio:.3f}" if ratio else "-", f"{predicted:.3f}" if ratio else "-",
                     f"{ratio / predicted:.2f}" if ratio else "-", f"{memory:.3f}" if memory else "-",
                     verdict(ratio, TRAIN_TARGETS.get(group["group"])) if switchhead else "",
                     verdict(memory, MEMORY_TARGETS[kind]) if switchhead else ""]
            lines.append("| " + " | ".join(cells) + " |")
        for where, error in group["errors"].items():
            lines.append(f"| {group['group']} | {where} | {error} | | | | | | | | | | |")
    if report.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(report['not_run'])}."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ driver
def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("train", "prefill"))
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, 2-layer tiny models, tiny shapes")
    parser.add_argument("--only", default="", help="train: only the groups whose name contains this text")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions (medians over them)")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps per model and repetition")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds: start no group the time left "
                        "cannot hold")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/"
                        "long_context_<stage>_<device>.json)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.reps, args.steps = 1, 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = gpu_or_smoke("bench_long_context", args.cpu_smoke)
    if device is None:
        return 2
    env = describe(device)
    path = result_path(args.out, RESULTS, f"long_context_{args.stage}", env, args.cpu_smoke)
    ceilings = roofline.measure_ceilings(device)
    report = dict(environment=env, smoke=args.cpu_smoke, stage=args.stage, tokens_per_step=TOKENS, reps=args.reps,
                  steps=args.steps, attn=args.attn, ceilings=ceilings, precision="bf16 autocast, fp32 weights"
                  if args.stage == "train" else "bf16 weights", groups=[], not_run=[])

    def log(line):
        print(line, flush=True)

    def save(rows=None):
        if rows is not None:
            report["prefill"] = rows
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)

    if ceilings.get("matmul_flops"):
        log(f"ceilings: bf16 matmul {ceilings['matmul_flops'] / 1e12:.0f} TFLOP/s, copy "
            f"{ceilings['copy_bytes_per_s'] / 1e9:.0f} GB/s")
    begun = time.perf_counter()
    deadline = begun + args.time_budget if args.time_budget else math.inf
    if args.stage == "prefill":
        run_prefill(args, device, ceilings, log, save)
    else:
        todo = [g for g in groups(args.cpu_smoke) if args.only in g["name"]]
        longest = 0.0
        for number, group in enumerate(todo):
            started = time.perf_counter()
            if started + longest > deadline:
                report["not_run"] = [g["name"] for g in todo[number:]]
                log(f"out of time: {', '.join(report['not_run'])} not run")
                break
            report["groups"].append(run_group(group, args, device, ceilings, log))
            report["groups"][-1]["wall_seconds"] = time.perf_counter() - started
            longest = max(longest, report["groups"][-1]["wall_seconds"])
            save()
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
