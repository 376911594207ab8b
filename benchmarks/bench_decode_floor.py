"""Decoding against its memory floor on a GPU: one greedy step of SwitchHead and of its dense baseline, captured in a
CUDA graph, beside the fewest HBM bytes the step must read.

    python benchmarks/bench_decode_floor.py               # CUDA: 47M and 262M RoPE pairs, 4 batch x length cells
    python benchmarks/bench_decode_floor.py --cpu-smoke   # anywhere: tiny models, no graph (checks that it runs)

A decoding step reads every weight once and the whole key-value cache of its batch, so at batch 32 after 8k tokens
the dense 47M model must move 6.6 GiB and SwitchHead, whose cache has fewer heads, 2.1 GiB (benchmarks/roofline.py).
Whether that shows depends on what else the step costs: Python and kernel launches. This benchmark takes them out
of the figure: the cache is filled with random keys and values directly (no prefill: any content costs the same to
read), the step (forward, argmax, next position) is captured once in a CUDA graph and replayed; the same step run
eagerly gives the host-bound figure beside it. Before timing, the graph's tokens are checked against the eager
step's from the same state (the step itself is checked token for token against `generate` on the CPU in
tests/benchmarks/test_gpu_matrices.py).

Cells: {47M, 262M} x {dense, SwitchHead (its default experts path, the PyTorch "eager" path and the fused
block "switchhead_fused")} at batch 1 @ 1k,
32 @ 1k, 32 @ 8k, 128 @ 8k, bf16 weights, a static cache (Transformers' `StaticCache`, the cache `generate` compiles
with) of the length plus 128. A cell whose cache and weights would take more than 60% of the free memory is
skipped with its estimate. Each figure is printed beside its floor: bytes over the measured copy bandwidth.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from bench_e2e import Clock  # noqa: E402
from bench_long_context import (  # noqa: E402
    DENSE_47M, DENSE_262M, ROPE, SH_47M, SH_262M, build, capture, header, make_config)
from machine import describe, gpu_or_smoke, result_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MARGIN = 128  # cache positions beyond the filled length: the steps run while checking and timing
CELLS = ((1, 1024), (32, 1024), (32, 8192), (128, 8192))


class DecodeStep:
    """A model, a static cache filled with `length` random positions, and the greedy step from there.

    `step()` feeds the current token at the current position, writes the argmax into the token buffer and advances
    the position; every tensor it touches is allocated once, so the step can be captured in a CUDA graph. `reset()`
    rewinds to the filled state (the cache's counters back to `length`, the first token again)."""

    def __init__(self, model, batch: int, length: int, device, fill: bool = True):
        from transformers import StaticCache

        self.model, self.length = model, length
        config = model.config
        self.cache = StaticCache(config=config, max_cache_len=length + MARGIN)
        generator = torch.Generator().manual_seed(7)
        self.first = torch.randint(1, config.vocab_size, (batch, 1), generator=generator).to(device)
        self.token = self.first.clone()
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)
        with torch.no_grad():  # one step at position 0 allocates the cache's tensors (they are lazy)
            self.model(input_ids=self.token, position_ids=self.position, cache=self.cache, use_cache=True)
        if fill:
            noise = torch.Generator(device=device).manual_seed(11)
            for layer in self.cache.layers:
                layer.keys[:, :, :length].normal_(generator=noise)
                layer.values[:, :, :length].normal_(generator=noise)
        self.reset()

    def prefill(self, ids: torch.Tensor) -> None:
        """Fill the cache from a prompt instead (all but its last token); the step then continues the prompt as
        greedy `generate` would."""
        self.reset(0)
        with torch.no_grad():
            positions = torch.arange(ids.shape[1] - 1, device=ids.device)[None].expand(ids.shape[0], -1)
            self.model(input_ids=ids[:, :-1], position_ids=positions, cache=self.cache, use_cache=True)
        self.length = ids.shape[1] - 1
        self.first = ids[:, -1:].clone()
        self.reset()

    def reset(self, length: int | None = None):
        length = self.length if length is None else length
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)
        self.position.fill_(length)
        self.token.copy_(self.first)

    def step(self) -> torch.Tensor:
        logits = self.model(input_ids=self.token, position_ids=self.position, cache=self.cache, use_cache=True).logits
        self.token.copy_(logits[:, -1:].argmax(-1))
        self.position.add_(1)
        return self.token

    def tokens(self, run, steps: int) -> torch.Tensor:
        """`steps` tokens per row from the filled state through `run` (the step, or a graph's replay)."""
        self.reset()
        return torch.cat([run().clone() for _ in range(steps)], dim=1)


def cell(preset: str, overrides: dict, experts, batch: int, length: int, args, device, ceilings) -> dict:
    config = make_config(preset, dict(overrides, max_position_embeddings=length + MARGIN), args.cpu_smoke, args.attn)
    parameters, embedding = roofline.parameter_counts(config)
    floor_bytes = roofline.decode_bytes(config, parameters, embedding, batch, length + MARGIN)
    row = dict(preset=preset, experts=experts, batch=batch, length=length, cache_length=length + MARGIN,
               floor_bytes=floor_bytes, kv_bytes=roofline.kv_cache_bytes(config, batch, length + MARGIN))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        if floor_bytes > 0.6 * free:
            row["skipped"] = f"cache and weights {floor_bytes / 2 ** 30:.1f} GiB, {free / 2 ** 30:.1f} GiB free"
            return row
    model = build(config, device, experts).eval().to(torch.bfloat16)
    row["experts_implementation"] = model.config._experts_implementation
    clock = Clock(device)
    with torch.no_grad():
        decode = DecodeStep(model, batch, length, device)
        eager_tokens = decode.tokens(decode.step, args.check_steps)
        graph, run = None, decode.step
        try:
            graph = capture(decode.step, device)
        except Exception as error:  # noqa: BLE001 (a step that cannot be captured is timed eagerly, and said)
            row["graph_error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            torch.cuda.synchronize()
        if graph is not None:
            graph_tokens = decode.tokens(graph["replay"], args.check_steps)
            row["graph_tokens_equal_eager"] = bool(torch.equal(graph_tokens, eager_tokens))
            run = graph["replay"]
        samples = []
        for _ in range(args.reps):
            decode.reset()
            samples.append(clock(lambda: [run() for _ in range(args.steps)]) / args.steps)
        decode.reset()
        eager = [clock(lambda: [decode.step() for _ in range(args.eager_steps)]) / args.eager_steps
                 for _ in range(2)]
    row.update(graph=graph is not None, step_seconds=statistics.median(samples), samples=samples,
               eager_step_seconds=statistics.median(eager))
    if ceilings.get("copy_bytes_per_s"):
        row["floor_seconds"] = floor_bytes / ceilings["copy_bytes_per_s"]
        row["floor_fraction"] = row["floor_seconds"] / row["step_seconds"]  # 1.0 = at the memory floor
    del decode, graph, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


SPEEDUP_TARGETS = {("47m-rope", 32, 1024): 1.25, ("262m-rope", 32, 1024): 1.4, ("47m-rope", 32, 8192): 2.0,
                   ("262m-rope", 32, 8192): 2.0}  # dense step time / SwitchHead's (for the record)
FLOOR_TARGET = 0.5  # at batch 32 after 8k tokens, both models at >= 50% of their HBM floor


def markdown(report: dict) -> str:
    lines = header(report, "Decoding step against its HBM floor") + [
        "Transformers' StaticCache filled with random keys and values. One greedy step (forward, argmax, next "
        "position) captured in a CUDA graph, median of "
        f"{report['reps']} x {report['steps']} replays; eager: the same step without the graph (Python and launches "
        "included). Floor: the weights (bf16) and the whole allocated cache, read once, over the copy bandwidth. "
        "Speed-up: dense step time over this model's (tokens/s ratio).", "",
        "| pair | batch @ tokens | model | experts | graph ms | floor ms | of floor | eager ms | speed-up (graph) | "
        "speed-up (eager) | target | graph = eager |", "|---" * 12 + "|"]
    for row in report["rows"]:
        cell = f"| {row['pair']} | {row['batch']} @ {row['length']} | {row['label']} |"
        if "step_seconds" not in row:
            lines.append(f"{cell} | {row.get('skipped') or row.get('error')} | | | | | | | | |")
            continue
        switchhead = row["label"].startswith("switchhead")
        target = ""
        bound = SPEEDUP_TARGETS.get((row["pair"], row["batch"], row["length"]))
        if switchhead and bound and row.get("speedup"):
            target = f">= {bound}: {'met' if row['speedup'] >= bound else 'missed'}"
        if row["batch"] == 32 and row["length"] == 8192 and row.get("floor_fraction") is not None:
            at = row["floor_fraction"] >= FLOOR_TARGET
            target += f"{'; ' if target else ''}floor >= {FLOOR_TARGET}: {'met' if at else 'missed'}"
        same = {True: "yes", False: "no", None: "-"}[row.get("graph_tokens_equal_eager")]
        if row.get("graph_error"):
            same = f"not captured: {row['graph_error']}"
        lines.append(
            f"{cell} {row.get('experts_implementation', '-') if switchhead else '-'} | "
            f"{row['step_seconds'] * 1e3:.3f} | "
            + (f"{row['floor_seconds'] * 1e3:.3f} | {row['floor_fraction']:.2f} | " if "floor_seconds" in row
               else "- | - | ")
            + f"{row['eager_step_seconds'] * 1e3:.2f} | "
            + (f"{row['speedup']:.2f} | {row['eager_speedup']:.2f} | " if row.get("speedup") else "- | - | ")
            + f"{target} | {same} |")
    if report.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(report['not_run'])}."]
    return "\n".join(lines) + "\n"


def pairs(smoke: bool):
    if smoke:
        return [("tiny", ("tiny-dense", dict(ROPE)), ("tiny-switchhead", {}))]
    return [("47m-rope", (DENSE_47M, ROPE), (SH_47M, {})), ("262m-rope", (DENSE_262M, ROPE), (SH_262M, {}))]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="CPU, 2-layer tiny models, short caches")
    parser.add_argument("--only", default="", help="only the pairs whose name contains this text")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of --steps replays (median)")
    parser.add_argument("--steps", type=int, default=32, help="steps per timed repetition")
    parser.add_argument("--eager-steps", type=int, default=8, help="steps per timed repetition of the eager step")
    parser.add_argument("--check-steps", type=int, default=4, help="tokens compared between graph and eager")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds: start no cell after this")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.reps, args.steps, args.eager_steps, args.check_steps = 1, 2, 2, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = gpu_or_smoke("bench_decode_floor", args.cpu_smoke)
    if device is None:
        return 2
    env = describe(device)
    path = result_path(args.out, RESULTS, "decode_floor", env, args.cpu_smoke)
    ceilings = roofline.measure_ceilings(device)
    cells = [(2, 16), (1, 8)] if args.cpu_smoke else list(CELLS)
    report = dict(environment=env, smoke=args.cpu_smoke, precision="bf16 weights", cache="StaticCache",
                  ceilings=ceilings, reps=args.reps, steps=args.steps, rows=[], not_run=[])

    def save():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)

    deadline = time.perf_counter() + args.time_budget if args.time_budget else math.inf
    for name, (dense, dense_over), (sh, sh_over) in pairs(args.cpu_smoke):
        if args.only not in name:
            continue
        for batch, length in cells:
            if time.perf_counter() > deadline:
                report["not_run"].append(f"{name} b{batch}@{length}")
                continue
            rows = {}
            for label, preset, overrides, experts in (("dense", dense, dense_over, None),
                                                      ("switchhead", sh, sh_over, None),
                                                      ("switchhead/eager", sh, sh_over, "eager"),
                                                      ("switchhead/fused", sh, sh_over, "switchhead_fused")):
                try:
                    rows[label] = cell(preset, overrides, experts, batch, length, args, device, ceilings)
                except Exception as error:  # noqa: BLE001 (recorded; the other cells go on)
                    rows[label] = dict(preset=preset, experts=experts, batch=batch, length=length,
                                       error=f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows[label].update(pair=name, label=label)
                report["rows"].append(rows[label])
            dense_s = rows["dense"].get("step_seconds")
            line = []
            for label, row in rows.items():
                if dense_s and row.get("step_seconds") and label != "dense":
                    row["speedup"] = dense_s / row["step_seconds"]  # tokens/s over dense's
                    row["eager_speedup"] = rows["dense"]["eager_step_seconds"] / row["eager_step_seconds"]
                if row.get("step_seconds"):
                    line.append(f"{label} {row['step_seconds'] * 1e3:.3f} ms (floor "
                                f"{row.get('floor_seconds', math.nan) * 1e3:.3f}, eager "
                                f"{row['eager_step_seconds'] * 1e3:.2f})")
                else:
                    line.append(f"{label}: {row.get('skipped') or row.get('error')}")
            print(f"decode {name} b{batch}@{length}: " + "; ".join(line), flush=True)
            save()
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
