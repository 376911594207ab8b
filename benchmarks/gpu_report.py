"""Render what one GPU session (`bash benchmarks/gpu_run.sh all`) brought back, on any machine.

    python benchmarks/gpu_report.py RETURNED_FOLDER [--out-dir benchmarks/results/gpu]

The session sends JSON only (the device tool returns at most 8 files); this writes, beside copies of them in
`--out-dir`, each stage's Markdown (the stage script's own `markdown()`) and `session.md`: the machine and
versions, each stage's status and seconds, and the headline ratios against their targets. The timing stages are
reported only when the correctness stage ran and every check in it passed; otherwise session.md says why not.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

STAGE_FILES = {"check": "gpu_check.json", "cvmm": "cvmm.json", "e2e": "e2e.json", "e2e_262m": "e2e_262m.json",
               "compile": "gpu_check_compile.json"}
# the targets, for the record: (measure, sign, bound)
KERNEL_TARGET = 0.8  # forward+backward throughput as a fraction of the same-FLOP dense matmul
E2E_TARGETS = {"train_time": ("<=", 0.7), "train_peak_memory": ("<=", 0.7), "decode_tok_s@b32": (">=", 1.3)}


def load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def correctness(check: dict | None) -> tuple[bool, str]:
    """(passed, why): the check ran, every section it was asked for has rows, and none failed."""
    if check is None:
        return False, "the correctness stage wrote no report"
    rows = check["results"]
    failed = [r for r in rows if r["status"] in ("mismatch", "error")]
    if failed:
        return False, f"{len(failed)} correctness check(s) failed, e.g. {failed[0]['section']} / {failed[0]['name']}"
    missing = [s for s in check["sections"] if not any(r["section"] == s for r in rows)]
    if missing:
        return False, f"the correctness stage did not reach: {', '.join(missing)}"
    return True, ""


def kernel_lines(cvmm: dict) -> list[str]:
    """Per paper problem: forward+backward fraction of dense for ours and each contender, and the verdict."""
    timed = [r for r in cvmm["results"] if r.get("mode") == "forward+backward" and "fraction_of_dense" in r]
    impls = [i for i in dict.fromkeys(r["impl"] for r in timed) if i != "dense_mm"]
    lines = ["| problem | " + " | ".join(impls) + " | ours >= 0.8 dense, faster than grouped_mm and authors' |",
             "|---" * (len(impls) + 2) + "|"]
    for problem in dict.fromkeys(r["problem"] for r in timed):
        got = {r["impl"]: r for r in timed if r["problem"] == problem}
        ours = got.get("cvmm")
        verdict = "-"
        if ours is not None:
            rivals = [got[i]["ms"] for i in ("grouped_mm", "authors_cvmm") if i in got]
            met = ours["fraction_of_dense"] >= KERNEL_TARGET and all(ours["ms"] < ms for ms in rivals)
            verdict = "met" if met else "missed"
        cells = [f"{got[i]['fraction_of_dense']:.2f}" if i in got else "-" for i in impls]
        lines.append(f"| {problem} | " + " | ".join(cells) + f" | {verdict} |")
    return lines


def e2e_lines(reports: list[dict]) -> list[str]:
    lines = ["| pair | measure | SwitchHead / dense | target |", "|---|---|---|---|"]
    for report in reports:
        for pair in report["pairs"]:
            for measure, value in pair["ratios"].items():
                if value is None:
                    continue
                target = ""
                if measure in E2E_TARGETS and (measure.startswith("decode") or "47m" in pair["pair"]):
                    sign, bound = E2E_TARGETS[measure]
                    met = value <= bound if sign == "<=" else value >= bound
                    target = f"{sign} {bound}: {'met' if met else 'missed'}"
                lines.append(f"| {pair['pair']} | {measure} | {value:.3f} | {target} |")
        if report.get("not_run"):
            lines.append(f"| {', '.join(report['not_run'])} | not run (time budget) | | |")
    return lines


def render(folder: Path, out_dir: Path) -> Path:
    import bench_cvmm
    import bench_e2e
    import gpu_check

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.is_file() and path.suffix in (".json", ".txt") and path.resolve() != (out_dir / path.name).resolve():
            shutil.copyfile(path, out_dir / path.name)
    summary = load(folder, "summary.json") or {"stages": []}
    reports = {stage: load(folder, name) for stage, name in STAGE_FILES.items()}
    renderers = {"check": gpu_check.markdown, "compile": gpu_check.markdown, "cvmm": bench_cvmm.markdown,
                 "e2e": bench_e2e.markdown, "e2e_262m": bench_e2e.markdown}
    for stage, report in reports.items():
        if report is not None:
            (out_dir / STAGE_FILES[stage]).with_suffix(".md").write_text(renderers[stage](report))
    passed, why = correctness(reports["check"])
    env = next((r["environment"] for r in (reports["check"], reports["e2e"], reports["compile"]) if r), {})
    lines = ["# GPU session", "", f"Device: {env.get('device', '?')}; driver {env.get('driver')}; CUDA "
             f"{env.get('cuda')}; torch {env.get('torch')}; triton {env.get('triton')}; transformers "
             f"{env.get('transformers')}. Budget {summary.get('budget_s')} s, {summary.get('elapsed_s')} s used.", "",
             "| stage | status | seconds | budget (s) |", "|---|---|---|---|"]
    for entry in summary["stages"]:
        lines.append(f"| {entry['stage']} | {entry['status']} | {entry.get('seconds', '-')} | "
                     f"{entry.get('budget_s', '-')} |")
    lines += ["", f"Correctness: {'every check passed' if passed else 'FAILED: ' + why}.", ""]
    if not passed:
        lines += ["The timing stages are not reported: their kernels are not known to be correct on this device."]
    else:
        if reports["cvmm"] is not None:
            lines += ["## Kernel: forward+backward as a fraction of a same-FLOP dense matmul (bf16)", "",
                      *kernel_lines(reports["cvmm"]), ""]
        e2e = [r for r in (reports["e2e"], reports["e2e_262m"]) if r is not None]
        if e2e:
            lines += ["## End to end: SwitchHead / parameter-matched dense", "", *e2e_lines(e2e), ""]
    path = out_dir / "session.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the files a gpu_run.sh session wrote to $OUT")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results" / "gpu")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"gpu_report: error: {args.folder} is not a folder; pass the folder the session's files came back in",
              file=sys.stderr)
        return 2
    print(f"wrote {render(args.folder, args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
