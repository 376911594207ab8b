"""Where a step's device time goes: `torch.profiler` with CUDA activities around one training step and one decoding
step of each model of the GPU matrices, as a kernel table (launches, device time, the top kernels with their counts).

    python benchmarks/profile_steps.py               # CUDA
    python benchmarks/profile_steps.py --cpu-smoke   # anywhere: tiny models, CPU activities (checks that it runs)

Training: the 47M RoPE pair at T=512 (batch 128; SwitchHead on its "eager", "switchhead_fused" and "cvmm" experts
paths) and the 262M pair at T=8192 (batch 8; "eager" and "switchhead_fused"), bf16 autocast, after two warm-up steps.
Decoding: one eager step (not graph-captured, so that every launch shows) at batch 32 after 1,024 (47M) and 8,192
(262M) random cache positions, bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
from bench_decode_floor import MARGIN, DecodeStep  # noqa: E402
from bench_e2e import Trainer  # noqa: E402
from bench_long_context import DENSE_47M, DENSE_262M, ROPE, SH_47M, SH_262M, build, make_config  # noqa: E402
from machine import describe, gpu_or_smoke, result_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def plan(smoke: bool):
    """(kind, name, label, preset, overrides, experts, batch, length)."""
    if smoke:
        return [("train", "tiny@32", "dense", "tiny-dense", ROPE, None, 2, 32),
                ("train", "tiny@32", "switchhead/eager", "tiny-switchhead", {}, "eager", 2, 32),
                ("train", "tiny@32", "switchhead/fused", "tiny-switchhead", {}, "switchhead_fused", 2, 32),
                ("decode", "tiny b2@16", "dense", "tiny-dense", ROPE, None, 2, 16),
                ("decode", "tiny b2@16", "switchhead", "tiny-switchhead", {}, None, 2, 16)]
    return [("train", "47m-rope@512", "dense", DENSE_47M, ROPE, None, 128, 512),
            ("train", "47m-rope@512", "switchhead/eager", SH_47M, {}, "eager", 128, 512),
            ("train", "47m-rope@512", "switchhead/cvmm", SH_47M, {}, "cvmm", 128, 512),
            ("train", "47m-rope@512", "switchhead/fused", SH_47M, {}, "switchhead_fused", 128, 512),
            ("decode", "47m-rope b32@1024", "dense", DENSE_47M, ROPE, None, 32, 1024),
            ("decode", "47m-rope b32@1024", "switchhead", SH_47M, {}, None, 32, 1024),
            ("decode", "47m-rope b32@1024", "switchhead/eager", SH_47M, {}, "eager", 32, 1024),
            ("decode", "47m-rope b32@1024", "switchhead/fused", SH_47M, {}, "switchhead_fused", 32, 1024),
            ("train", "262m-rope@8192", "dense", DENSE_262M, ROPE, None, 8, 8192),
            ("train", "262m-rope@8192", "switchhead/eager", SH_262M, {}, "eager", 8, 8192),
            ("train", "262m-rope@8192", "switchhead/fused", SH_262M, {}, "switchhead_fused", 8, 8192),
            ("decode", "262m-rope b32@8192", "dense", DENSE_262M, ROPE, None, 32, 8192),
            ("decode", "262m-rope b32@8192", "switchhead", SH_262M, {}, None, 32, 8192)]


def profile_one(kind, preset, overrides, experts, batch, length, device, smoke, attn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if kind == "train":
        config = make_config(preset, dict(overrides, max_position_embeddings=length), smoke, attn)
        model = build(config, device, experts)
        trainer = Trainer(model, batch, length, device, torch.bfloat16 if device.type == "cuda" else None)
        trainer.step()
        trainer.step()
        run = trainer.step
    else:
        config = make_config(preset, dict(overrides, max_position_embeddings=length + MARGIN), smoke, attn)
        model = build(config, device, experts).eval().to(torch.bfloat16)
        decode = DecodeStep(model, batch, length, device)

        def run():
            with torch.no_grad():
                decode.step()

        run()
        run()
        decode.reset()
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    if device.type == "cuda":
        table = roofline.kernel_table(prof)
    else:  # the CPU smoke: operators stand in for kernels
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        table = dict(kernels=sum(e.count for e in ops), device_us=None,
                     top=[dict(name=e.key[:120], count=e.count, us=e.self_cpu_time_total) for e in ops[:25]])
    table["experts_implementation"] = model.config._experts_implementation
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return table


def markdown(report: dict, top: int = 6) -> str:
    env = report["environment"]
    lines = [f"# Kernel tables ({'CPU smoke' if report['smoke'] else env['device']})", "",
             f"Device: {env['device']}; torch {env['torch']}; triton {env['triton']}; transformers "
             f"{env['transformers']}. One step each under `torch.profiler` (training: bf16 autocast; decoding: bf16 "
             "weights, the eager step). Launches: every device kernel and copy the step ran.", "",
             "| step | model | experts | launches | device ms | top kernels (count, ms) |", "|---|---|---|---|---|---|"]
    for entry in report["profiles"]:
        if "error" in entry:
            lines.append(f"| {entry['kind']} {entry['name']} | {entry['label']} | | {entry['error']} | | |")
            continue
        kernels = "; ".join(f"`{r['name'][:60]}` x{r['count']}, {r['us'] / 1e3:.2f}" for r in entry["top"][:top])
        device_ms = f"{entry['device_us'] / 1e3:.2f}" if entry.get("device_us") else "-"
        experts = entry.get("experts_implementation", "-") if entry["label"].startswith("switchhead") else "-"
        lines.append(f"| {entry['kind']} {entry['name']} | {entry['label']} | {experts} | {entry['kernels']} | "
                     f"{device_ms} | {kernels} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = gpu_or_smoke("profile_steps", args.cpu_smoke)
    if device is None:
        return 2
    env = describe(device)
    path = result_path(args.out, RESULTS, "profiles", env, args.cpu_smoke)
    report = dict(environment=env, smoke=args.cpu_smoke, profiles=[])
    for kind, name, label, preset, overrides, experts, batch, length in plan(args.cpu_smoke):
        entry = dict(kind=kind, name=name, label=label, preset=preset, batch=batch, length=length)
        try:
            entry.update(profile_one(kind, preset, overrides, experts, batch, length, device, args.cpu_smoke,
                                     args.attn))
            top = ", ".join(f"{r['name'][:40]} x{r['count']}" for r in entry["top"][:3])
            print(f"profile {kind} {name} {label}: {entry['kernels']} launches, "
                  f"{(entry['device_us'] or 0) / 1e3:.2f} ms on the device; top: {top}", flush=True)
        except Exception as error:  # noqa: BLE001 (recorded; the other profiles go on)
            entry["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
            print(f"profile {kind} {name} {label}: {entry['error']}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["profiles"].append(entry)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
