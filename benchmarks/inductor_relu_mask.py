"""Why an inductor-compiled training step is slower than eager on this CPU: the ReLU mask kernels.

    OMP_NUM_THREADS=1 python benchmarks/inductor_relu_mask.py [--simdlen 8]

A dense MLP block of the 47M models (412 -> 2053 -> 412, ReLU; batch 2 x 256 tokens), forward + backward, eager
against `torch.compile`: the step time and the self time of every kernel, from the profiler (inductor's kernel
profiling on). On the Xeon measured here (AVX-512) inductor fuses the ReLU with the boolean mask its backward keeps,
and that kernel, which stores a 16-lane boolean mask per step, takes many times eager's `clamp_min`; the backward's
read of the mask is slower than eager's `threshold_backward` too. Every model here has this MLP (SwitchHead and
dense alike), which is why compiled training is slower than eager for all of them on the CPU measured.
`--simdlen 8` (AVX2 code) shows how much of it is the AVX-512 path. Writes a JSON beside the other results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe  # noqa: E402


class ReluMLP(nn.Module):
    def __init__(self, d: int, inner: int):
        super().__init__()
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simdlen", type=int, default=None, help="inductor's cpp.simdlen (default: its choice)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results"
                        / "inductor_relu_mask.json")
    args = parser.parse_args(argv)
    import torch._inductor.config as inductor_config
    from torch.profiler import profile

    inductor_config.cpp.enable_kernel_profile = True
    if args.simdlen is not None:
        inductor_config.cpp.simdlen = args.simdlen
    torch.manual_seed(0)
    mlp = ReluMLP(412, 2053)
    x = torch.randn(2, 256, 412, requires_grad=True)
    compiled = torch.compile(mlp, fullgraph=True)

    def step(fn):
        fn(x).square().mean().backward()

    for fn in (compiled, compiled, mlp, mlp):  # compile and warm up
        step(fn)
    report = {"machine": describe(torch.device("cpu")), "simdlen": args.simdlen, "shape": [2, 256, 412, 2053]}
    times = {"eager": [], "compiled": []}
    for _ in range(args.reps):  # interleaved
        for name, fn in (("eager", mlp), ("compiled", compiled)):
            start = time.perf_counter()
            step(fn)
            times[name].append(time.perf_counter() - start)
    report["step_ms"] = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    report["kernels_ms"] = {}
    for name, fn in (("eager", mlp), ("compiled", compiled)):
        with profile() as prof:
            step(fn)
        rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        report["kernels_ms"][name] = {e.key: e.self_cpu_time_total / 1e3 for e in rows[:6]}
    print(f"step: eager {report['step_ms']['eager']:.1f} ms, compiled {report['step_ms']['compiled']:.1f} ms "
          f"({report['step_ms']['compiled'] / report['step_ms']['eager']:.2f}x)")
    for name, kernels in report["kernels_ms"].items():
        print(f"{name}:")
        for kernel, ms in kernels.items():
            print(f"  {ms:8.2f} ms  {kernel}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
