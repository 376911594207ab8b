"""Inductor-compiled training step against eager on the CPU, with and without aggressive recomputation (issue #14).

    OMP_NUM_THREADS=1 python benchmarks/bench_compiled_train.py [--models switchhead-rope,dense-rope] [--reps 4]

For each 47M model of bench_model.py (batch 2 x 256, fp32, sdpa): the eager training step (forward + backward of
the LM loss), `torch.compile(model, fullgraph=True)` with inductor's defaults, and the same compiled with
`torch._functorch.config.aggressive_recomputation = True`, interleaved (medians). With the
defaults, AOTAutograd's partitioner makes the forward store the ReLU's boolean mask for the backward, and
inductor's CPU kernel for that is slow on AVX-512 (`inductor_relu_mask.py`); with aggressive recomputation the
backward recomputes the mask from the ReLU output it keeps anyway. Writes JSON + Markdown to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
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
from machine import describe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


@contextlib.contextmanager
def recomputation(aggressive: bool):
    previous = functorch_config.aggressive_recomputation
    functorch_config.aggressive_recomputation = aggressive
    try:
        yield
    finally:
        functorch_config.aggressive_recomputation = previous


def measure(name: str, aggressive: bool, batch: int, context: int, reps: int) -> dict:
    """Eager and compiled steps of one model, interleaved; run in its own process (see `main`), because dynamo's
    cache is keyed on the forward's code, not on the functorch settings a graph was partitioned under."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = bench_model.build(name, False, "sdpa")
    eager = bench_model.train_step(model, batch, context)
    with recomputation(aggressive):
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
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "AGGRESSIVE"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS / "compiled_train_cpu.json")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1] == "1", args.batch, args.context, args.reps)))
        return 0
    models = args.models.split(",")
    runs = {}
    for name in models:
        for variant, aggressive in (("compiled", "0"), ("compiled_aggressive", "1")):
            result = subprocess.run([sys.executable, __file__, "--child", name, aggressive, "--reps", str(args.reps),
                                     "--batch", str(args.batch), "--context", str(args.context)],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                print(result.stderr[-2000:], file=sys.stderr)
                return 1
            runs[f"{name}/{variant}"] = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"{name} {variant}: compiled in {runs[f'{name}/{variant}']['compile_s']:.0f} s", flush=True)

    def ratio(key):
        samples = runs[key]["samples"]
        return statistics.median(samples["compiled"]) / statistics.median(samples["eager"])

    ratios = {name: {v: ratio(f"{name}/{v}") for v in ("compiled", "compiled_aggressive")} for name in models}
    report = dict(machine=describe(torch.device("cpu")), settings={k: str(v) for k, v in vars(args).items()},
                  load_average=os.getloadavg(), runs=runs, ratios=ratios)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    lines = ["# Compiled (inductor) training step against eager, CPU", "",
             f"{report['machine']['device']}, {os.environ.get('OMP_NUM_THREADS', '1')} thread(s), torch "
             f"{report['machine']['torch']}, batch {args.batch} x {args.context}, fp32, sdpa. Each ratio: medians of "
             f"{args.reps} repetitions of the compiled and the eager step, interleaved in one process (one process "
             f"per model and setting). Load average after {tuple(round(x, 2) for x in report['load_average'])}.", "",
             "| model | eager s | compiled / eager (defaults) | compiled / eager (aggressive recomputation) |",
             "|---|---|---|---|"]
    for name in models:
        eager_s = statistics.median(runs[f"{name}/compiled_aggressive"]["samples"]["eager"])
        lines.append(f"| {name} | {eager_s:.3f} | {ratios[name]['compiled']:.2f} | "
                     f"{ratios[name]['compiled_aggressive']:.2f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
