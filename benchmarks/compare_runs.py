"""Two versions of the package side by side: the ratios of bench_model.py or bench_experts.py runs of each.

    python benchmarks/compare_runs.py --before b1.json b2.json --after a1.json a2.json --out results/NAME.md
    python benchmarks/compare_runs.py --before-commit 28ce4f7 --runs 2 --runs-dir results/NAME --out results/NAME.md \
        -- bench_model.py --decode-only --no-reference --threads 1

The second form takes the runs itself: it builds the package as of the given commit from `git archive` (no
worktree, no checkout of this one touched) into a folder that goes first on PYTHONPATH, then runs this tree's
benchmark script (the words after `--`) alternately on the earlier and on the installed version, in the order
before, after, after, before, ... so that a drift of the machine's speed falls on both versions alike.

Each run compares models (bench_model: SwitchHead / its dense baseline) or implementations (bench_experts: every
implementation's time / cvmm's) within itself, so a ratio is comparable between runs of different code where raw
times are not (the machine's load moves them together). For each ratio: every before and after run, the spread of
the before runs (run-to-run noise of one version), and the after runs' median against the before runs' median.
Lower is better for times and memory, higher for tokens/s (bench_model), and for "x cvmm" (bench_experts) higher
means cvmm is faster.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent


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


def install_commit(commit: str, folder: Path) -> Path:
    """The package as of `commit` (this repository), installed into `folder`/site; returns that folder."""
    source, site = folder / "source", folder / "site"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(BENCHMARKS.parent), "archive", commit], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:  # (extraction filters exist from Python 3.10.12 / 3.11.4)
        tar.extractall(source, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(source)], check=True)
    return site


def order(runs: int) -> list[str]:
    """before, after, after, before, before, after, ...: `runs` of each, alternating in mirrored pairs."""
    return [version for i in range(runs) for version in (("before", "after") if i % 2 == 0 else ("after", "before"))]


def take_runs(site: Path, bench: list[str], runs: int, folder: Path, run=subprocess.run) -> dict[str, list[Path]]:
    """Run benchmarks/`bench` (script and its arguments, without --out) `runs` times on each version, interleaved:
    "before" with `site` first on PYTHONPATH, "after" with the installed package. Returns the JSON paths by version.
    """
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, list[Path]] = {"before": [], "after": []}
    for version in order(runs):
        env = dict(os.environ)
        if version == "before":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        found = run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('switchhead').origin)"],
                    env=env, check=True, capture_output=True, text=True).stdout.strip()
        if (version == "before") != Path(found).is_relative_to(site):  # the version we mean is the one imported
            raise RuntimeError(f"the {version} run would import switchhead from {found}")
        out = folder / f"{version}_{len(paths[version]) + 1}.json"
        print(f"{version} run {len(paths[version]) + 1}: switchhead from {found}", flush=True)
        run([sys.executable, str(BENCHMARKS / bench[0]), *bench[1:], "--out", str(out)], env=env, check=True)
        paths[version].append(out)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", type=Path, help="runs of the earlier version")
    parser.add_argument("--after", nargs="+", type=Path, help="runs of the later version")
    parser.add_argument("--before-commit", default=None,
                        help="take the runs: this commit against the installed package (benchmark after `--`)")
    parser.add_argument("--runs", type=int, default=2, help="with --before-commit: runs of each version")
    parser.add_argument("--runs-dir", type=Path, default=None, help="with --before-commit: where the runs' JSON go")
    parser.add_argument("--title", default="Before and after")
    parser.add_argument("--note", default="", help="how the runs were taken (versions, order), printed under the title")
    parser.add_argument("--out", type=Path, default=None, help="Markdown file to write (also printed)")
    args = parser.parse_args(argv)
    if args.before_commit:
        if not bench or args.runs_dir is None:
            parser.error("--before-commit needs --runs-dir and the benchmark after `--`")
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            site = install_commit(args.before_commit, Path(folder))
            paths = take_runs(site, bench, args.runs, args.runs_dir)
        args.before, args.after = paths["before"], paths["after"]
        head = subprocess.run(["git", "-C", str(BENCHMARKS.parent), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
        args.note = (f"Before: {args.before_commit}; after: the installed package (tree at {head}); "
                     f"`{' '.join(bench)}`, order "
                     f"{', '.join(order(args.runs))}. {args.note}").rstrip()
    elif not (args.before and args.after):
        parser.error("give --before and --after runs, or --before-commit")
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
