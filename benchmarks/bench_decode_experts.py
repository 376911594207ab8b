"""SwitchHead's V and O expert projections at one token with weights out of cache: every PyTorch formulation.

Decoding one token is bound by reading the weights: each layer's are read once per step, long after the previous
step left the cache. This script times what the "eager" rule (`expert_ops.choose_formulation`) chooses among for
one token, on the 47M presets' attention shapes (RoPE: H=2, E=5, d=412, dh=64; XL: dh=76), for every k from 1 to E,
with each repetition walking a ring of distinct weight sets larger than the last-level cache (`--ring-mib`), so
that every call reads its weights from memory as in a decoding step:

- `per_head`: every expert of a head, the gates scattered into dense `[H, E]` (reads all H*E matrices);
- `batched`: the selected H*k matrices copied (`index_select`), then one `bmm` (reads k of E, writes a copy that
  stays in cache);
- `all_experts`: every row times every expert, mixed (reads all);
- `grouped`: slots sorted by expert, `torch._grouped_mm` (reads the selected ones, more small ops);
- and, as the yardstick, the dense baseline's V and O (`nn.Linear` 412 -> 410 and back, the 47M dense pair).

Each formulation is first checked against `expert_ops.naive` (exit status 1 on a mismatch). Times are the median
over interleaved repetitions (each repetition runs every formulation over the whole ring, in a rotating order), in
microseconds per layer for V and O together. Writes JSON and Markdown to benchmarks/results/ with the CPU, threads,
versions and the load average before and after.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_decode_experts.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from switchhead import expert_ops
from switchhead.configuration_switchhead import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name, file_slug, save_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"rope": "wt103-45m-switchhead-rope", "xl": "wt103-47m-switchhead-xl"}
DENSE_WIDTH = 410  # the 47M dense baseline's H * dh (10 x 41)
FORMULATIONS = {
    "per_head": expert_ops._per_head,
    "batched": expert_ops._batched,
    "all_experts": expert_ops._all_experts,
    "grouped": expert_ops._grouped,
}


def ring_size(bytes_per_set: int, ring_mib: int) -> int:
    return max(2, -(-ring_mib * 2**20 // bytes_per_set))


def make_case(preset: str, k: int, ring_mib: int, generator: torch.Generator) -> dict:
    fields = PRESETS[preset]
    heads, experts = fields["num_attention_heads"], fields["num_attention_experts"]
    d, dh = fields["hidden_size"], fields["head_dim"]
    per_set = 2 * heads * experts * d * dh * 4
    sets = ring_size(per_set, ring_mib)
    local = torch.stack([torch.randperm(experts, generator=generator)[:k] for _ in range(heads)])  # [H, k]
    index = (local + torch.arange(heads)[:, None] * experts).reshape(1, heads * k)
    return dict(
        heads=heads, experts=experts, d=d, dh=dh, sets=sets, index=index,
        value_gates=torch.rand(1, heads * k, generator=generator),
        output_gates=torch.rand(1, heads * k, generator=generator),
        x=torch.randn(1, 1, d, generator=generator), rows=torch.randn(1, heads, dh, generator=generator),
        values=[torch.randn(heads * experts, d, dh, generator=generator) for _ in range(sets)],
        outputs=[torch.randn(heads * experts, dh, d, generator=generator) for _ in range(sets)],
    )


def both_sides(formulation, case: dict, i: int):
    values = formulation(case["x"], case["index"], case["values"][i], case["value_gates"], case["heads"])
    output = formulation(case["rows"], case["index"], case["outputs"][i], case["output_gates"], 1)
    return values, output


def check(case: dict) -> list[str]:
    """Formulations whose values or output differ from the naive twin's on the first weight set."""
    want = both_sides(expert_ops.naive, case, 0)
    wrong = []
    for name, formulation in FORMULATIONS.items():
        got = both_sides(formulation, case, 0)
        if not all(torch.allclose(g, w, rtol=1e-4, atol=1e-4) for g, w in zip(got, want)):
            wrong.append(name)
    return wrong


def dense_ring(d: int, ring_mib: int, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    sets = ring_size(2 * d * DENSE_WIDTH * 4, ring_mib)
    return [(torch.randn(DENSE_WIDTH, d, generator=generator), torch.randn(d, DENSE_WIDTH, generator=generator))
            for _ in range(sets)]


def time_ring(fn, sets: int) -> float:
    """Microseconds per layer: one pass over the ring."""
    start = time.perf_counter()
    for i in range(sets):
        fn(i)
    return (time.perf_counter() - start) / sets * 1e6


def run(args) -> dict:
    generator = torch.Generator().manual_seed(0)
    report = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "transformers": transformers.__version__,
                          "python": platform.python_version(), "hostname": platform.node()},
              "load_average_before": os.getloadavg(), "ring_mib": args.ring_mib, "reps": args.reps, "rows": []}
    for variant, preset in SHAPES.items():
        d = PRESETS[preset]["hidden_size"]
        dense = dense_ring(d, args.ring_mib, generator)
        x = torch.randn(1, d, generator=generator)
        for k in range(1, PRESETS[preset]["num_attention_experts"] + 1):
            case = make_case(preset, k, args.ring_mib, generator)
            wrong = check(case)
            if wrong:
                print(f"{variant} k={k}: {', '.join(wrong)} differ from the naive twin", file=sys.stderr)
                sys.exit(1)
            runs = {name: (lambda i, f=f, c=case: both_sides(f, c, i), case["sets"])
                    for name, f in FORMULATIONS.items()}
            runs["dense V + O"] = (lambda i: torch.nn.functional.linear(
                torch.nn.functional.linear(x, dense[i][0]), dense[i][1]), len(dense))
            heads, experts = case["heads"], case["experts"]
            chosen = expert_ops.choose_formulation(1, heads * k, 1, heads, heads * experts, grouped_routing=True)
            chosen = chosen.__name__.lstrip("_")
            times: dict[str, list[float]] = {name: [] for name in runs}
            names = list(runs)
            with torch.no_grad():
                for name in names:  # warm-up: one pass each
                    time_ring(*runs[name])
                for rep in range(args.reps):
                    for name in names[rep % len(names):] + names[:rep % len(names)]:
                        times[name].append(time_ring(*runs[name]))
            row = {"variant": variant, "k": k, "experts": case["experts"], "rule_chooses": chosen,
                   "us_per_layer": {name: statistics.median(v) for name, v in times.items()}}
            report["rows"].append(row)
            print(variant, k, {n: round(v, 1) for n, v in row["us_per_layer"].items()}, "rule:", chosen, flush=True)
    report["load_average_after"] = os.getloadavg()
    return report


def markdown(report: dict) -> str:
    m = report["machine"]
    names = list(report["rows"][0]["us_per_layer"])
    before, after = (tuple(round(x, 2) for x in report[key]) for key in ("load_average_before", "load_average_after"))
    lines = [
        "# SwitchHead's V and O at one token, weights out of cache", "",
        f"CPU: {m['cpu']} ({m['threads']} threads), torch {m['torch']}. A ring of {report['ring_mib']} MiB of weight "
        f"sets per formulation, median of {report['reps']} interleaved repetitions; microseconds per layer for V and "
        f"O together (lower is better). Load average before {before}, after {after}. "
        f"`python benchmarks/bench_decode_experts.py --threads {m['threads']}`.", "",
        "| shape | k of E | " + " | ".join(names) + " | the rule's choice |",
        "|---|---|" + "---:|" * len(names) + "---|",
    ]
    for row in report["rows"]:
        cells = " | ".join(f"{row['us_per_layer'][n]:.0f}" for n in names)
        lines.append(f"| {row['variant']} | {row['k']} of {row['experts']} | {cells} | {row['rule_chooses']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    parser.add_argument("--ring-mib", type=int, default=128,
                        help="weight bytes walked per formulation and repetition (more than the last-level cache)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (Markdown beside it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args)
    slug = file_slug(report["machine"]["cpu"])
    save_results(args.out or RESULTS / f"decode_experts_cpu_{slug}_{args.threads}t.json", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
