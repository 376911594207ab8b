"""How long the command line and `import switchhead` take to start, against an earlier commit: fresh processes,
interleaved (each case runs the baseline and this checkout in turn, in alternating order), medians of the repeats.

    python benchmarks/bench_startup.py --baseline eb37a58        # before the lazy imports
    python benchmarks/bench_startup.py --baseline main --repeats 9

Each tree is the package laid out as it installs (scripts/package_tree.py), put first on sys.path, so both run in
this Python environment with the same torch and Transformers. `import torch, transformers` is the floor: what
Transformers itself costs. On a machine shared with other work the spread is wide; the medians are what to read,
and the floor says how loaded the machine was.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "scripts"), str(Path(__file__).resolve().parent)]

import machine  # noqa: E402
import package_tree  # noqa: E402

CLI = "import sys; from switchhead.cli import main; sys.exit(main(sys.argv[1:]))"
CASES = {
    "import torch, transformers": ("import torch, transformers", []),
    "import switchhead": ("import switchhead", []),
    "switchhead --version": (CLI, ["--version"]),
    "switchhead --help": (CLI, ["--help"]),
    "switchhead eval --help": (CLI, ["eval", "--help"]),
    "switchhead upcycle --help": (CLI, ["upcycle", "--help"]),
    "switchhead train --steps x (argument error)": (CLI, ["train", "--steps", "x"]),
}


def seconds(tree: Path, code: str, argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); {code}", *argv],
                   capture_output=True, timeout=600)
    return time.perf_counter() - started


def tree_of(commit: str | None, root: Path) -> Path:
    """The package of `commit` (None: this checkout's working tree) laid out under `root`."""
    source = REPO
    if commit is not None:
        source = root / "source"
        source.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package_tree.link_tree(root / "tree", repo=source)
    return root / "tree"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the commit to compare with (e.g. the one before a change)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=None, help="result path (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    import torch

    info = machine.describe(torch.device("cpu"))
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "base").mkdir()
        (Path(scratch) / "head").mkdir()
        trees = {"baseline": tree_of(args.baseline, Path(scratch) / "base"), "this": tree_of(None, Path(scratch) / "head")}
        times = {case: {label: [] for label in trees} for case in CASES}
        for repeat in range(args.repeats):
            for case, (code, case_argv) in CASES.items():
                order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
                for label in order:
                    times[case][label].append(seconds(trees[label], code, case_argv))
    rows = {case: {label: statistics.median(values) for label, values in by_label.items()}
            for case, by_label in times.items()}
    report = dict(benchmark="startup", baseline=args.baseline, repeats=args.repeats, machine=info, median_s=rows,
                  all_s=times)
    lines = [f"# Start-up, {info['device']} ({args.repeats} repeats, interleaved, medians; a shared machine: read",
             "the floor `import torch, transformers` for its load)", "",
             f"| case | baseline {args.baseline} (s) | this (s) |", "|---|---|---|"]
    lines += [f"| {case} | {row['baseline']:.2f} | {row['this']:.2f} |" for case, row in rows.items()]
    path = args.output or REPO / "benchmarks" / "results" / f"startup_{machine.file_slug(info['device'])}.json"
    machine.save_results(path, report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
