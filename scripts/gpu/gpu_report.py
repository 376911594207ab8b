"""Render what one GPU run (`bash scripts/gpu/gpu_run.sh all`) brought back, on any machine.

    python scripts/gpu/gpu_report.py RETURNED_FOLDER [--out-dir benchmarks/results/gpu]

A run writes JSON only (few files, each complete as soon as its stage ends); this writes, beside copies of them in
`--out-dir`, each stage's Markdown (the stage script's own `markdown()`) and `run.md`: the machine and
versions, each stage's status and seconds, and the headline ratios against their targets. Each timing is reported
only where the checks it rests on passed: the kernel timings on the op checks (paper shapes and random problems),
an end-to-end pair on its SwitchHead variant's whole-model checks; otherwise run.md says which check failed.
A folder may hold more end-to-end files than the run's (`e2e*.json`, e.g. a pair rerun afterwards).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# each stage's Markdown is its script's own `markdown()`: gpu_check's, beside this file, and the benchmarks'
# bench_cvmm and bench_e2e, in a folder of scripts rather than a package: it goes on sys.path as each benchmark puts
# itself there
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

STAGE_FILES = {"check": "gpu_check.json", "cvmm": "cvmm.json", "e2e": "e2e.json", "e2e_compiled": "e2e_compiled.json",
               "e2e_eager": "e2e_eager.json", "e2e_262m": "e2e_262m.json", "compile": "gpu_check_compile.json",
               "check_model": "gpu_check_model.json", "long_train": "long_train.json",
               "decode_floor": "decode_floor.json", "profiles": "profiles.json", "prefill": "prefill.json",
               "generate_host": "generate_host.json", "e2e_moeut": "e2e_moeut.json"}
MATRICES = {"long_train": "Training at long context", "decode_floor": "Decoding against its HBM floor",
            "prefill": "Prefill at batch 1", "profiles": "Kernel tables",
            "generate_host": "A step of compiled generate on the host"}
# the targets, for the record: (measure, sign, bound)
KERNEL_TARGET = 0.8  # forward+backward throughput as a fraction of the same-FLOP dense matmul
E2E_TARGETS = {"train_time": ("<=", 0.7), "train_peak_memory": ("<=", 0.7), "decode_tok_s@b32": (">=", 1.3)}


def load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


PAIR_VARIANT = {"47m-rope": "switchhead-rope", "262m-rope": "switchhead-rope", "47m-xl": "switchhead-xl",
                "262m-xl": "switchhead-xl", "moeut-44m": "moeut"}


def correctness(check: dict | None, sections=None, variant: str | None = None) -> tuple[bool, str]:
    """(passed, why): the check ran, every section asked for (all of the check's by default) has rows, and none
    of them failed; with `variant`, only the model rows of that variant count in the model section."""
    if check is None:
        return False, "the correctness stage wrote no report"
    sections = list(sections or check["sections"])
    rows = [r for r in check["results"] if r["section"] in sections
            and (variant is None or r["section"] != "model" or r["name"].startswith(variant + " "))]
    failed = [r for r in rows if r["status"] in ("mismatch", "error")]
    if failed:
        return False, f"{len(failed)} correctness check(s) failed, e.g. {failed[0]['section']} / {failed[0]['name']}"
    missing = [s for s in sections if not any(r["section"] == s for r in rows)]
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
    lines = ["| pair | SwitchHead's experts | measure | SwitchHead / dense | target |", "|---|---|---|---|---|"]
    for report in reports:
        for pair in report["pairs"]:
            experts = pair.get("experts_implementation", "?")
            for measure, value in pair["ratios"].items():
                if value is None:
                    continue
                target = ""
                if measure in E2E_TARGETS and (measure.startswith("decode") or "47m" in pair["pair"]) \
                        and not pair["pair"].startswith("moeut"):  # the targets are SwitchHead's
                    sign, bound = E2E_TARGETS[measure]
                    met = value <= bound if sign == "<=" else value >= bound
                    target = f"{sign} {bound}: {'met' if met else 'missed'}"
                label = f"{measure} (compiled, static cache)" if pair.get("compiled_decode") else measure
                lines.append(f"| {pair['pair']} | {experts} | {label} | {value:.3f} | {target} |")
        if report.get("not_run"):
            lines.append(f"| {', '.join(report['not_run'])} | {report.get('experts_implementation', '?')} | "
                         "not run (time budget) | | |")
    return lines


def formulation_lines(long_train: dict | None, decode_floor: dict | None) -> list[str]:
    """The evidence "switchhead_auto"'s CUDA rule is set from: in every cell of the training and decoding matrices
    that timed more than one SwitchHead formulation, each one's time over the fastest's (1.000: the fastest). A
    formulation is named by the experts implementation the run recorded."""
    cells = []  # (matrix, cell, {experts implementation: seconds})
    for group in (long_train or {}).get("groups", []):
        timed = {member.get("experts_implementation", label): member["seconds"]
                 for label, member in group["members"].items()
                 if label.startswith("switchhead") and member.get("seconds") and not member.get("position_term")}
        cells.append(("training", group["group"], timed))
    decode = {}
    for row in (decode_floor or {}).get("rows", []):
        if row.get("label", "").startswith("switchhead") and row.get("step_seconds"):
            key = f"{row['pair']} {row['batch']} @ {row['length']}"
            decode.setdefault(key, {})[row.get("experts_implementation", row["label"])] = row["step_seconds"]
    cells += [("decoding (graph)", key, timed) for key, timed in decode.items()]
    cells = [cell for cell in cells if len(cell[2]) > 1]
    if not cells:
        return []
    names = sorted({name for _, _, timed in cells for name in timed})
    lines = ["| matrix | cell | fastest | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for matrix, cell, timed in cells:
        best = min(timed, key=timed.get)
        ratios = [f"{timed[name] / timed[best]:.3f}" if name in timed else "-" for name in names]
        lines.append(f"| {matrix} | {cell} | {best} | " + " | ".join(ratios) + " |")
    return lines


def render(folder: Path, out_dir: Path) -> Path:
    import bench_cvmm
    import bench_decode_floor
    import bench_e2e
    import bench_generate_host
    import bench_long_context
    import gpu_check
    import profile_steps

    out_dir.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.is_file() and path.suffix in (".json", ".txt") and path.resolve() != (out_dir / path.name).resolve():
            shutil.copyfile(path, out_dir / path.name)
    summary = load(folder, "summary.json") or {"stages": []}
    files = dict(STAGE_FILES)
    files.update({p.stem: p.name for p in sorted(folder.glob("e2e*.json")) if p.name not in STAGE_FILES.values()})
    reports = {stage: load(folder, name) for stage, name in files.items()}
    renderers = {"check": gpu_check.markdown, "compile": gpu_check.markdown, "cvmm": bench_cvmm.markdown,
                 "check_model": gpu_check.markdown, "long_train": bench_long_context.markdown,
                 "prefill": bench_long_context.markdown, "decode_floor": bench_decode_floor.markdown,
                 "profiles": profile_steps.markdown, "generate_host": bench_generate_host.markdown,
                 **{k: bench_e2e.markdown for k in reports if k.startswith("e2e")}}
    checks = reports["check"] or reports["check_model"]  # the whole-model checks, with the op sections or alone
    withheld = {}  # end-to-end file -> its pairs whose whole-model checks did not pass
    for stage, report in reports.items():
        if report is None:
            continue
        if stage.startswith("e2e"):
            verdicts = {p["pair"]: correctness(checks, ("model",), PAIR_VARIANT.get(p["pair"], "?"))
                        for p in report["pairs"]}
            withheld[stage] = {pair: why for pair, (ok, why) in verdicts.items() if not ok}
            report = dict(report, pairs=[p for p in report["pairs"] if p["pair"] not in withheld[stage]])
            reports[stage] = report
        text = renderers[stage](report)
        if withheld.get(stage):
            text += "".join(f"\nWithheld: {pair} ({why}).\n" for pair, why in withheld[stage].items())
        (out_dir / files[stage]).with_suffix(".md").write_text(text)
    passed, why = correctness(checks)
    ops_passed, ops_why = correctness(reports["check"], ("paper", "sweep"))
    env = next((r["environment"] for r in reports.values() if r), {})
    lines = ["# GPU run", "", f"Device: {env.get('device', '?')}; driver {env.get('driver')}; CUDA "
             f"{env.get('cuda')}; torch {env.get('torch')}; triton {env.get('triton')}; transformers "
             f"{env.get('transformers')}. Budget {summary.get('budget_s')} s, {summary.get('elapsed_s')} s used.", "",
             "| stage | status | seconds | budget (s) |", "|---|---|---|---|"]
    for entry in summary["stages"]:
        lines.append(f"| {entry['stage']} | {entry['status']} | {entry.get('seconds', '-')} | "
                     f"{entry.get('budget_s', '-')} |")
    lines += ["", f"Correctness: {'every check passed' if passed else 'FAILED: ' + why}.", ""]
    if checks is not None:
        failed = [r for r in checks["results"] if r["status"] in ("mismatch", "error")]
        lines += [f"- failed: {r['section']} / {r['name']}" for r in failed] + ([""] if failed else [])
    if reports["cvmm"] is not None:
        lines += ["## Kernel: forward+backward as a fraction of a same-FLOP dense matmul (bf16)", ""]
        lines += [*kernel_lines(reports["cvmm"]), ""] if ops_passed else [
            f"Not reported: the op checks did not pass ({ops_why}).", ""]
    e2e = [r for k, r in reports.items() if k.startswith("e2e") and r is not None]
    if e2e:
        lines += ["## End to end: SwitchHead / parameter-matched dense", ""]
        lines += [f"- {pair}: not reported ({why})." for pairs in withheld.values() for pair, why in pairs.items()]
        lines += ["", *e2e_lines(e2e), ""]
    formulations = formulation_lines(reports.get("long_train"), reports.get("decode_floor"))
    if formulations:
        lines += ["## SwitchHead's formulations against each other (time over the fastest's)", "",
                  "What `\"switchhead_auto\"`'s rule on CUDA is set from; columns are the experts implementations "
                  "the runs recorded (`eager`: the PyTorch path, `cvmm`: the Triton kernel, `switchhead_fused`: the "
                  "fused attention block).", "",
                  *formulations, ""]
    matrices = [stage for stage in MATRICES if reports.get(stage) is not None]
    if matrices:
        lines += ["## Long context, decoding, prefill, kernel tables, host cost", ""]
        lines += [f"- {MATRICES[stage]}: [{files[stage][:-5]}.md]({files[stage][:-5]}.md)" for stage in matrices]
        lines.append("")
    path = out_dir / "run.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the files a gpu_run.sh run wrote to $OUT")
    parser.add_argument("--out-dir", type=Path, default=BENCHMARKS / "results" / "gpu")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"gpu_report: error: {args.folder} is not a folder; pass the folder the run's files came back in",
              file=sys.stderr)
        return 2
    print(f"wrote {render(args.folder, args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
