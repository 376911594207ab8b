"""Inductor-compiled training step against eager on the CPU: the model's ReLU against ATen's, and aggressive
recomputation.

    OMP_NUM_THREADS=1 python benchmarks/bench_compiled_train.py [--models switchhead-rope,dense-rope] [--reps 4]

For each 47M model of bench_model.py (batch 2 x 256, fp32, sdpa): the eager training step (forward + backward of
the LM loss) and `torch.compile(model, fullgraph=True)` in three settings, each in its own process, interleaved
with eager steps (medians):
- "compiled": inductor's defaults, the model as it is. Under compile its MLP ReLU is `_ReluFromOutput`, whose
  backward multiplies by the sign of the output, so the partitioner keeps only the ReLU output;
- "compiled_aten_relu": inductor's defaults with the MLPs' activation swapped back to `F.relu`. AOTAutograd's
  partitioner then makes the forward store the ReLU's boolean mask for the backward, and inductor's CPU kernels for
  storing and reading it are slow on AVX-512 (`inductor_relu_mask.py`): what the model's ReLU avoids;
- "compiled_aggressive": `F.relu` with `torch._functorch.config.aggressive_recomputation = True` (the backward
  recomputes the mask; a process-wide setting, the other way out).
Writes JSON + Markdown to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch._functorch.config as functorch_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402
from switchhead import modeling_switchhead  # noqa: E402
from machine import describe, portable_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


VARIANTS = ("compiled", "compiled_aten_relu", "compiled_aggressive")
HEADINGS = {"compiled": "the model (defaults)", "compiled_aten_relu": "F.relu (defaults)",
            "compiled_aggressive": "F.relu, aggressive recomputation"}


def measure(name: str, variant: str, batch: int, context: int, reps: int, quick: bool = False) -> dict:
    """Eager and compiled steps of one model, interleaved; run in its own process (see `main`), because dynamo's
    cache is keyed on the forward's code, not on the functorch settings a graph was partitioned under."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = bench_model.build(name, quick, "sdpa")
    if variant != "compiled":  # ATen's ReLU in every dense MLP (eager runs it either way)
        swapped = [module for module in model.modules() if getattr(module, "act_fn", None) is modeling_switchhead.relu]
        if not swapped:
            raise RuntimeError(f"{name}: no MLP uses the model's relu; nothing to compare against F.relu")
        for module in swapped:
            module.act_fn = torch.nn.functional.relu
    eager = bench_model.train_step(model, batch, context)
    with functorch_config.patch(aggressive_recomputation=variant == "compiled_aggressive"):
        compiled = bench_model.train_step(torch.compile(model, fullgraph=True, dynamic=False), batch, context, model)
        compile_s = bench_model.timed(compiled)
        compiled()
        eager()
        samples = {"eager": [], "compiled": []}
        for _ in range(reps):
            samples["eager"].append(bench_model.timed(eager))
            samples["compiled"].append(bench_model.timed(compiled))
    return {"compile_s": compile_s, "samples": samples}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="switchhead-rope,dense-rope,switchhead-xl,dense-xl")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"a subset of {','.join(VARIANTS)}")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2-layer models (use a small --context)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "compiled_train_cpu.json")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.batch, args.context, args.reps, args.quick)))
        return 0
    models = args.models.split(",")
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    runs = {}
    for name in models:
        for variant in variants:
            child = [sys.executable, __file__, "--child", name, variant, "--reps", str(args.reps), "--batch",
                     str(args.batch), "--context", str(args.context)] + ["--quick"] * args.quick
            result = subprocess.run(child, capture_output=True, text=True)
            if result.returncode != 0:
                print(result.stderr[-2000:], file=sys.stderr)
                return 1
            runs[f"{name}/{variant}"] = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{name} {variant}: compiled in {runs[f'{name}/{variant}']['compile_s']:.0f} s", flush=True)

    def ratio(key):
        samples = runs[key]["samples"]
        return statistics.median(samples["compiled"]) / statistics.median(samples["eager"])

    ratios = {name: {v: ratio(f"{name}/{v}") for v in variants} for name in models}
    report = dict(machine=describe(torch.device("cpu")), settings={k: portable_path(v) if isinstance(v, Path) else str(v) for k, v in vars(args).items()},
                  load_average=os.getloadavg(), runs=runs, ratios=ratios)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    lines = ["# Compiled (inductor) training step against eager, CPU", "",
             f"{report['machine']['device']}, {os.environ.get('OMP_NUM_THREADS', '1')} thread(s), torch "
             f"{report['machine']['torch']}, batch {args.batch} x {args.context}, fp32, sdpa. Each ratio: medians of "
             f"{args.reps} repetitions of the compiled and the eager step, interleaved in one process (one process "
             f"per model and setting). Load average after {tuple(round(x, 2) for x in report['load_average'])}.", "",
             "| model | eager s | " + " | ".join(f"{HEADINGS[v]}: compiled / eager" for v in variants) + " |",
             "|---|---|" + "---|" * len(variants)]
    for name in models:
        eager_s = statistics.median(runs[f"{name}/{variants[0]}"]["samples"]["eager"])
        lines.append(f"| {name} | {eager_s:.3f} | " + " | ".join(f"{ratios[name][v]:.2f}" for v in variants) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
