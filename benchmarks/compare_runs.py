"""Two versions of the package side by side: the ratios of bench_model.py or bench_experts.py runs of each.

    python benchmarks/compare_runs.py --before b1.json b2.json --after a1.json a2.json --out results/NAME.md

Each run compares models (bench_model: SwitchHead / its dense baseline) or implementations (bench_experts: every
implementation's time / cvmm's) within itself, so a ratio is comparable between runs of different code where raw
times are not (the machine's load moves them together). For each ratio: every before and after run, the spread of
the before runs (run-to-run noise of one version), and the after runs' median against the before runs' median.
Lower is better for times and memory, higher for tokens/s (bench_model), and for "x cvmm" (bench_experts) higher
means cvmm is faster.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def ratios_of(run: dict) -> dict[str, float]:
    """Name -> ratio of one run of either script."""
    if "ratios" in run:  # bench_model.py: {variant: {measure: SwitchHead / dense}}
        return {f"{variant} {measure}": value for variant, measures in run["ratios"].items()
                for measure, value in measures.items() if value is not None and "paired" not in measure}
    if "results" in run:  # bench_experts.py: [{tokens, mode, ms: {implementation: ms}}]
        out = {}
        for row in run["results"]:
            for name, ms in row["ms"].items():
                if name != "cvmm":
                    out[f"{row['tokens']} tokens {row['mode']}: {name} x cvmm"] = ms / row["ms"]["cvmm"]
        return out
    raise ValueError("not a bench_model.py or bench_experts.py result (no 'ratios' or 'results')")


def table(before: list[dict], after: list[dict]) -> list[str]:
    b_runs, a_runs = [ratios_of(r) for r in before], [ratios_of(r) for r in after]
    # a ratio measured by at least one run of each version (runs of a partial mode leave rows out: "-")
    names = list(dict.fromkeys(n for r in b_runs for n in r if any(n in a for a in a_runs)))
    head = ([f"before {i + 1}" for i in range(len(b_runs))] + [f"after {i + 1}" for i in range(len(a_runs))]
            + ["before spread", "after / before (medians)"])
    lines = ["| ratio | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for name in names:
        b, a = [r.get(name) for r in b_runs], [r.get(name) for r in a_runs]
        bm, am = [v for v in b if v is not None], [v for v in a if v is not None]
        spread = f"{(max(bm) - min(bm)) / statistics.median(bm):.1%}" if len(bm) > 1 else "-"
        cells = ["-" if v is None else f"{v:.3f}" for v in b + a]
        cells += [spread, f"{statistics.median(am) / statistics.median(bm):.3f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", type=Path, required=True, help="runs of the earlier version")
    parser.add_argument("--after", nargs="+", type=Path, required=True, help="runs of the later version")
    parser.add_argument("--title", default="Before and after")
    parser.add_argument("--note", default="", help="how the runs were taken (versions, order), printed under the title")
    parser.add_argument("--out", type=Path, default=None, help="Markdown file to write (also printed)")
    args = parser.parse_args(argv)
    before = [json.loads(p.read_text()) for p in args.before]
    after = [json.loads(p.read_text()) for p in args.after]
    machine = before[0].get("machine")
    machine = machine.get("cpu", machine) if isinstance(machine, dict) else before[0].get("device", machine)
    lines = [f"# {args.title}", "", f"Machine: {machine}. Runs: before {', '.join(p.name for p in args.before)}; "
             f"after {', '.join(p.name for p in args.after)}. {args.note}".rstrip(), ""]
    lines += table(before, after)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
