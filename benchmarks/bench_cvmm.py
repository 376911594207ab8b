"""Benchmark of the CVMM expert projections on the paper's shapes.

For the value and output projections of the 47M and 262M SwitchHead presets and the sigma-MoE keys / values of
the SwitchAll presets (tokens = batch x context of PAPER_TRAINING), times forward, backward and forward+backward
of: our `switchhead.kernels.cvmm` (Triton on a GPU), the PyTorch reference (the model's "eager" projection),
`torch.nn.functional.grouped_mm` (bf16), a naive per-expert loop, and a dense `torch.mm` with the same FLOPs (the
practical limit). Prints TFLOP/s and each one's throughput as a fraction of the dense mm (dense time / its time),
then times a whole one-layer model of each preset (forward+backward) with our op against the reference, and
writes a JSON with the machine and device names to benchmarks/results/. Before timing a shape it checks the op
against the fp32 reference (exit status 1 on a mismatch).

    python benchmarks/bench_cvmm.py --full        # GPU: the full paper shapes, bf16, triton.testing.do_bench medians
    python benchmarks/bench_cvmm.py --full --authors-cvmm PATH/TO/their/switchhead/cvmm.py   # + the authors' kernel
    python benchmarks/bench_cvmm.py               # anywhere: small token counts (CPU: wall-clock medians)
    python benchmarks/bench_cvmm.py --cpu-smoke   # CPU, Triton interpreted, tiny shapes: checks that it all runs

The authors' CVMM kernel (the public `switchhead/cvmm.py` of the paper's code) is loaded at run time from the path
given, never copied here; it is called through its own `CVMMSel` (sorted ids, input rows, output slots, and the
gates as its reduction weight) and checked against the reference like ours. Its backward needs CUDA.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from switchhead import SwitchHeadConfig
from switchhead.training.paper import PAPER_TRAINING
from switchhead import kernels
from switchhead.expert_ops import expert_projection

RESULTS = Path(__file__).resolve().parent / "results"
SWITCHHEAD_PRESETS = ("wt103-47m-switchhead-xl", "c4-47m-switchhead-xl", "wt103-262m-switchhead-xl",
                      "c4-262m-switchhead-xl")
SWITCHALL_PRESETS = ("wt103-47m-switchall-xl", "wt103-259m-switchall-xl")


# ---------------------------------------------------------------------------------------------------- problems
def paper_problems(token_override: int | None) -> list[dict]:
    """One dict per projection: name, tokens N, rows R, slots S, gated, out_groups, G, heads, d_in, d_out."""
    problems = []
    for preset in SWITCHHEAD_PRESETS + SWITCHALL_PRESETS:
        config = SwitchHeadConfig.from_preset(preset)
        training = PAPER_TRAINING[preset]
        tokens = token_override or training["batch_size"] * training["context"]
        heads, k, d, dh = (config.num_attention_heads, config.num_attention_experts_per_tok, config.hidden_size,
                           config.head_dim)
        experts = heads * config.num_attention_experts
        if preset in SWITCHHEAD_PRESETS:
            problems += [
                dict(name=f"{preset}/value", tokens=tokens, rows=1, slots=heads * k, gated=True, out_groups=heads,
                     experts=experts, heads=heads, d_in=d, d_out=dh),
                dict(name=f"{preset}/output", tokens=tokens, rows=heads, slots=heads * k, gated=True, out_groups=1,
                     experts=experts, heads=heads, d_in=dh, d_out=d),
            ]
        else:
            k_mlp, size = config.num_mlp_experts_per_tok, config.mlp_expert_size
            problems += [
                dict(name=f"{preset}/mlp_keys", tokens=tokens, rows=1, slots=k_mlp, gated=False, out_groups=1,
                     experts=config.num_mlp_experts, heads=1, d_in=d, d_out=size),
                dict(name=f"{preset}/mlp_values", tokens=tokens, rows=k_mlp, slots=k_mlp, gated=True, out_groups=1,
                     experts=config.num_mlp_experts, heads=1, d_in=size, d_out=d),
            ]
    return problems


def make_inputs(problem: dict, device: torch.device, dtype: torch.dtype, generator: torch.Generator):
    """(inputs, expert_index, weight, gates) of a problem: uniform top-k routing, each head picking k distinct experts
    of its own (among its first `used_experts` when the problem sets it: the others get no rows); with `strided`
    the inputs and weight are transposed views (same values, odd strides)."""
    n, heads = problem["tokens"], problem["heads"]
    per_head, k = problem["experts"] // heads, problem["slots"] // heads
    pool = problem.get("used_experts") or per_head
    picks = torch.rand(n, heads, pool, generator=generator).argsort(-1)[..., :k]
    index = (picks + torch.arange(heads)[:, None] * per_head).reshape(n, heads * k).to(device)

    def make(*shape, scale=1.0):
        if problem.get("strided"):
            return (torch.randn(*reversed(shape), generator=generator) * scale).to(device, dtype).permute(
                *reversed(range(len(shape))))
        return (torch.randn(*shape, generator=generator) * scale).to(device, dtype)

    inputs = make(n, problem["rows"], problem["d_in"])
    weight = make(problem["experts"], problem["d_in"], problem["d_out"], scale=problem["d_in"] ** -0.5)
    gates = None
    if problem["gated"]:
        gates = torch.rand(n, problem["slots"], generator=generator).to(device)  # fp32, as the router gives them
    return inputs, index, weight, gates


# ---------------------------------------------------------------------------------------------------- contenders
def grouped_mm_projection(inputs, expert_index, weight, gates, out_groups):
    """Sort rows by expert, one `grouped_mm`, unsort; dims padded to 8 (grouped_mm needs 16-byte rows)."""
    n, r, d_in = inputs.shape
    slots, (g, _, d_out) = expert_index.shape[1], weight.shape
    flat = expert_index.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    offsets = torch.cumsum(torch.bincount(flat, minlength=g), 0).to(torch.int32)
    rows = inputs.reshape(n * r, d_in).index_select(0, order // (slots // r))
    pad_in, pad_out = -d_in % 8, -d_out % 8
    padded_weight = F.pad(weight, (0, pad_out, 0, pad_in))
    sorted_out = F.grouped_mm(F.pad(rows, (0, pad_in)), padded_weight, offs=offsets)[:, :d_out]
    out = torch.empty_like(sorted_out).index_copy(0, order, sorted_out).view(n, slots, d_out)
    if gates is None:
        return out
    return (out * gates.unsqueeze(-1).to(out.dtype)).view(n, out_groups, slots // out_groups, d_out).sum(2)


def per_expert_loop(inputs, expert_index, weight, gates, out_groups):
    """The naive MoE loop: for each expert, find its rows (a host sync), matmul, scatter back."""
    n, r, d_in = inputs.shape
    slots, (g, _, d_out) = expert_index.shape[1], weight.shape
    rows = inputs.unsqueeze(2).expand(n, r, slots // r, d_in).reshape(n * slots, d_in)
    flat = expert_index.reshape(-1)
    out = rows.new_zeros(n * slots, d_out)
    for e in range(g):
        chosen = (flat == e).nonzero().squeeze(1)
        out = out.index_add(0, chosen, rows.index_select(0, chosen) @ weight[e])
    out = out.view(n, slots, d_out)
    if gates is None:
        return out
    return (out * gates.unsqueeze(-1).to(out.dtype)).view(n, out_groups, slots // out_groups, d_out).sum(2)


def load_authors_cvmm(path: Path):
    """The authors' `cvmm.py`, imported from `path` (it registers its op `mylib::cvmm_triton` once)."""
    spec = importlib.util.spec_from_file_location("switchhead_bench_authors_cvmm", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import the authors' CVMM from {path}: expected their switchhead/cvmm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not (hasattr(module, "cvmm") and hasattr(module, "CVMMSel")):
        raise ValueError(f"{path} has no cvmm() / CVMMSel: expected the authors' switchhead/cvmm.py")
    return module


def authors_projection(module) -> Callable:
    """Our (inputs [N, R, d_in], expert_index [N, S], weight, gates, out_groups) call in the authors' terms.

    Their kernel multiplies input row `sel_index[m]` by `keys[sel[m]]` for each sorted slot m and writes output
    row `out_index[m]`; the result `[N, S, d_out]` is then contracted with `reduction_weight` over its last axis.
    So: sel = the sorted ids, sel_index = the slot's input row (slot // (S / R) of the flattened inputs),
    out_index = the slot, reduction_weight = the gates as `[N, out_groups, S / out_groups]`.
    """
    def run(inputs, expert_index, weight, gates, out_groups):
        n, rows, _ = inputs.shape
        slots = expert_index.shape[1]
        sorted_ids, order = expert_index.reshape(-1).sort()
        selection = module.CVMMSel(
            raw_sel=expert_index, sel=sorted_ids.view_as(expert_index), sel_index=order // (slots // rows),
            out_index=order,
            reduction_weight=None if gates is None else gates.view(n, out_groups, slots // out_groups))
        low_precision = inputs.dtype in (torch.float16, torch.bfloat16)  # their output dtype is autocast's
        with torch.autocast(inputs.device.type, dtype=inputs.dtype, enabled=low_precision):
            return module.cvmm(inputs, selection, weight)

    return run


def backend_of(device: torch.device, dtype: torch.dtype) -> str:
    """What our op runs for tensors on `device` of `dtype`: "triton", or "torch" (the model's "eager" entry)."""
    return "triton" if kernels.triton_runs(device, dtype) else "torch"


def ours(inputs, expert_index, weight, gates, out_groups):
    """The op's "cvmm" entry: the Triton kernels where they run, else the model's "eager" projection."""
    return expert_projection(inputs, expert_index, weight, gates, out_groups, implementation="cvmm")


def reference(inputs, expert_index, weight, gates, out_groups):
    return expert_projection(inputs, expert_index, weight, gates, out_groups, implementation="eager")


CONTENDERS: dict[str, Callable] = {
    "cvmm": ours, "cvmm_atomic": ours,  # the default (slots summed in a fixed order); set_deterministic(False)
    "reference": reference,
    "grouped_mm": grouped_mm_projection, "per_expert_loop": per_expert_loop,
}


# ---------------------------------------------------------------------------------------------------- timing
def median_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median"))
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_modes(forward: Callable[[], torch.Tensor], leaves: list[torch.Tensor], device, reps) -> dict[str, float]:
    """Median ms of forward, backward (all leaves' gradients) and forward+backward."""
    out = forward()
    upstream = torch.randn_like(out)

    def backward_only():
        torch.autograd.grad(out, leaves, upstream, retain_graph=True)

    def forward_backward():
        torch.autograd.grad(forward(), leaves, upstream)

    with torch.no_grad():
        fwd = median_ms(forward, device, reps)
    return {"forward": fwd, "backward": median_ms(backward_only, device, reps),
            "forward+backward": median_ms(forward_backward, device, reps)}


CHECK_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}
CHECK_TOLERANCE_BY_NAME = {str(k): v for k, v in CHECK_TOLERANCE.items()}


def check_against_reference(problem, inputs, index, weight, gates, fn=None) -> dict:
    """`fn` (default: our op) vs the fp32 PyTorch reference on the same values: max |error| / max |reference| of
    the output and of each gradient, so the timings below are known to come from a correct kernel here."""
    fn = fn or ours
    leaves = [t.detach().requires_grad_() for t in (inputs, weight, gates) if t is not None]
    wide = [t.detach().float().requires_grad_() for t in leaves]
    args = lambda ts: (ts[0], index, ts[1], ts[2] if len(ts) > 2 else None, problem["out_groups"])  # noqa: E731
    out, want = fn(*args(leaves)), reference(*args(wide))
    upstream = torch.randn_like(want)
    grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype))
    want_grads = torch.autograd.grad(want, wide, upstream)
    errors = {}
    with torch.no_grad():
        for name, got, ref in zip(("output", "d_inputs", "d_weight", "d_gates"), (out, *grads), (want, *want_grads)):
            errors[name] = float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return errors


def bench_problem(problem, device, dtype, reps, generator, check_only=False, contenders=None) -> list[dict]:
    """Check rows (our op, and the authors' kernel when given) then timing rows for one problem."""
    contenders = CONTENDERS if contenders is None else contenders
    inputs, index, weight, gates = make_inputs(problem, device, dtype, generator)
    rows = []
    for name in [n for n in ("cvmm", "authors_cvmm") if n in contenders]:
        try:
            errors = check_against_reference(problem, inputs, index, weight, gates, contenders[name])
            rows.append(dict(problem=problem["name"], impl=name, mode="check", relative_errors=errors,
                             backend=backend_of(device, dtype) if name == "cvmm" else "authors",
                             ok=max(errors.values()) <= CHECK_TOLERANCE[dtype]))
        except Exception as error:  # noqa: BLE001 - reported as a failed check
            rows.append(dict(problem=problem["name"], impl=name, mode="check", relative_errors={}, ok=False,
                             backend="authors" if name != "cvmm" else backend_of(device, dtype),
                             error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
    if check_only:
        return rows
    m, d_in, d_out = problem["tokens"] * problem["slots"], problem["d_in"], problem["d_out"]
    flops = {"forward": 2 * m * d_in * d_out}
    flops["backward"] = 2 * flops["forward"]  # d inputs and d weight
    flops["forward+backward"] = 3 * flops["forward"]
    # the practical limit: one dense matmul with the same FLOPs
    a = torch.randn(m, d_in, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(d_in, d_out, device=device, dtype=dtype, requires_grad=True)
    timings = {"dense_mm": time_modes(lambda: a @ b, [a, b], device, reps)}
    leaves = [t.requires_grad_() for t in (inputs, weight, gates) if t is not None]
    for name, fn in contenders.items():
        if name == "grouped_mm" and dtype != torch.bfloat16:
            continue  # grouped_mm is a bf16 kernel
        if name == "cvmm_atomic" and backend_of(device, dtype) != "triton":
            continue  # the PyTorch path has no atomics
        if name == "authors_cvmm" and not any(r["impl"] == name and r["ok"] for r in rows):
            timings[name] = {"error": "skipped: it failed its check on this problem"}
            continue
        kernels.set_deterministic(False if name == "cvmm_atomic" else None)  # forward and backward alike
        try:
            timings[name] = time_modes(lambda fn=fn: fn(inputs, index, weight, gates, problem["out_groups"]), leaves,
                                       device, reps)
        except Exception as error:  # noqa: BLE001 - a contender that cannot run here is reported, not fatal
            timings[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        finally:
            kernels.set_deterministic(None)
    for name, modes in timings.items():
        for mode, ms in modes.items():
            if mode == "error":
                rows.append(dict(problem=problem["name"], impl=name, mode="all", error=ms))
                continue
            rows.append(dict(problem=problem["name"], impl=name, mode=mode, ms=ms,
                             tflops=flops[mode] / ms / 1e9, fraction_of_dense=timings["dense_mm"][mode] / ms))
    return rows


def autotune_choices() -> dict[str, dict[str, str]]:
    """The configs Triton's autotuner kept for each key of our two kernels (empty when they never ran)."""
    if "switchhead.kernels.cvmm_triton" not in sys.modules:
        return {}
    module = sys.modules["switchhead.kernels.cvmm_triton"]
    choices = {}
    for name in ("_gathered_expert_matmul", "_expert_weight_grad"):
        cache = getattr(getattr(module, name, None), "cache", {}) or {}
        choices[name] = {str(key): str(config) for key, config in cache.items()}
    return choices


def markdown(report: dict) -> str:
    """Forward+backward (and forward) of every contender as a fraction of the same-FLOP dense matmul."""
    lines = [f"# CVMM benchmark ({'paper shapes' if report['full_paper_shapes'] else 'small token counts'})", "",
             f"Device: {report['device']}; torch {report['torch']}; triton {report['triton']}; dtype "
             f"{report['dtype']}; cvmm backend {report['cvmm_backend']}; timing: {report['timing']}.", "",
             "Throughput as a fraction of a dense matmul with the same FLOPs (1.0 = the practical limit; "
             "higher is better), forward+backward / forward:", ""]
    timed = [r for r in report["results"] if "fraction_of_dense" in r and r["impl"] != "dense_mm"]
    impls = list(dict.fromkeys(r["impl"] for r in timed))
    problems = list(dict.fromkeys(r["problem"] for r in timed))
    lines += ["| problem | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]
    for problem in problems:
        cells = []
        for impl in impls:
            got = {r["mode"]: r for r in timed if r["problem"] == problem and r["impl"] == impl}
            if "forward+backward" in got and "forward" in got:
                cells.append(f"{got['forward+backward']['fraction_of_dense']:.2f} / "
                             f"{got['forward']['fraction_of_dense']:.2f}")
            else:
                cells.append("-")
        lines.append(f"| {problem} | " + " | ".join(cells) + " |")
    checks = [r for r in report["results"] if r["mode"] == "check"]
    bad = [r for r in checks if not r["ok"]]
    lines += ["", f"Checks against the fp32 reference: {len(checks) - len(bad)} of {len(checks)} within "
              f"{CHECK_TOLERANCE_BY_NAME.get(report['dtype'], '?')}."]
    lines += [f"- {r['problem']} {r['impl']}: {r.get('error') or r['relative_errors']}" for r in bad]
    layers = [r for r in report["results"] if r["mode"] == "layer forward+backward"]
    if layers:
        lines += ["", "| layer (forward+backward) | batch x length | cvmm ms | reference ms | speed-up |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['problem']} | {r['batch']} x {r['length']} | {r['ms']:.3f} | {r['reference_ms']:.3f} | "
                  f"{r['speedup_over_reference']:.2f} |" for r in layers]
    if report.get("not_run"):
        lines += ["", f"Not run (time budget): {', '.join(report['not_run'])}."]
    return "\n".join(lines) + "\n"


def matches(only: str, name: str) -> bool:
    """--only: the name contains the text, or one of its comma separated parts ("" matches everything)."""
    return any(part in name for part in only.split(","))


def bench_layers(device, dtype, token_override, reps, only, deadline=float("inf"), not_run=None):
    """A whole decoder layer (attention + MLP, forward+backward) of each preset, cvmm on our op vs the reference:
    yields one row per preset; presets reached after `deadline` are named in `not_run` instead.

    One-layer model of the preset, fp32 parameters; on CUDA under autocast in `dtype` as in training.
    """
    from switchhead import SwitchHeadModel

    for preset in SWITCHHEAD_PRESETS + SWITCHALL_PRESETS:
        if not matches(only, preset):
            continue
        if time.perf_counter() > deadline:
            if not_run is not None:
                not_run.append(f"{preset}/layer")
            continue
        config = SwitchHeadConfig.from_preset(preset, num_hidden_layers=1, vocab_size=256, hidden_dropout=0.0,
                                              use_cache=False)
        context = PAPER_TRAINING[preset]["context"]
        batch, length = (PAPER_TRAINING[preset]["batch_size"], context) if token_override is None else (
            max(1, token_override // context), min(context, token_override))
        model = SwitchHeadModel(config).to(device).train()
        embeds = torch.randn(batch, length, config.hidden_size, device=device, requires_grad=True)
        autocast = torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda" and dtype != torch.float32)

        def step():
            with autocast:
                hidden = model(inputs_embeds=embeds).last_hidden_state
            torch.autograd.grad(hidden.float().square().mean(), [embeds, *model.parameters()], allow_unused=True)

        timings = {}
        for backend, implementation in (("auto", "cvmm"), ("torch", "eager")):
            model.set_experts_implementation(implementation)
            timings[backend] = median_ms(step, device, reps)
        yield dict(problem=f"{preset}/layer", impl="cvmm", mode="layer forward+backward", ms=timings["auto"],
                   batch=batch, length=length, reference_ms=timings["torch"],
                   speedup_over_reference=timings["torch"] / timings["auto"])


def _portable(path: Path) -> str:
    """`path` as the results file records it (relative to the checkout; machine.portable_path)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import portable_path

    return portable_path(path)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_name

    return cpu_name()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="paper token counts (batch x context); needs a GPU")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="CPU, Triton interpreted (TRITON_INTERPRET=1), tiny shapes, one repetition")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per problem (default: 64 without --full)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--only", default="", help="run only problems (and layers) whose name contains this text, "
                        "or one of these comma separated texts")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions on CPU (GPU uses do_bench)")
    parser.add_argument("--authors-cvmm", type=Path, default=None,
                        help="path of the authors' switchhead/cvmm.py, to time their kernel too")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/...); "
                        "the Markdown table goes beside it")
    parser.add_argument("--check-only", action="store_true", help="only compare cvmm with the reference; no timing")
    parser.add_argument("--no-layers", action="store_true", help="skip the whole-layer forward+backward timings")
    parser.add_argument("--no-markdown", action="store_true", help="write the JSON only (scripts/gpu/gpu_report.py "
                        "renders it later)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: start no new problem (or layer) after this; the JSON is written after each "
                        "problem, so a run cut short keeps what it measured")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    deadline = started + args.time_budget if args.time_budget else float("inf")
    if args.cpu_smoke:
        if args.full:
            parser.error("--cpu-smoke and --full exclude each other")
        if os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it at import: start again with it set
            return subprocess.call([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)],
                                   env=dict(os.environ, TRITON_INTERPRET="1"))
        args.reps, args.tokens = 1, args.tokens or 16
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    if args.full and device.type != "cuda":
        print("bench_cvmm: error: --full needs a CUDA GPU (the paper shapes take minutes per contender on a CPU); "
              "run without it for the small CPU benchmark", file=sys.stderr)
        return 2
    if args.authors_cvmm is not None and not args.authors_cvmm.is_file():
        print(f"bench_cvmm: error: --authors-cvmm {args.authors_cvmm} is not a file; pass the path of the "
              "authors' switchhead/cvmm.py", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    tokens = None if args.full else (args.tokens or 64)
    backend = backend_of(device, dtype)
    contenders = dict(CONTENDERS)
    if args.authors_cvmm is not None:
        contenders["authors_cvmm"] = authors_projection(load_authors_cvmm(args.authors_cvmm))
    print(f"device: {device_name(device)} | dtype {dtype} | cvmm backend: {backend} | torch {torch.__version__}")

    generator = torch.Generator().manual_seed(0)
    rows = []
    header = f"{'problem':44} {'impl':16} {'mode':17} {'ms':>9} {'TFLOP/s':>8} {'x dense':>8}"
    print(header)
    problems = [p for p in paper_problems(tokens) if matches(args.only, p["name"])]
    if args.cpu_smoke:  # the interpreter runs block by block: keep the routing, shrink the widths
        problems = [dict(p, d_in=min(p["d_in"], 40), d_out=min(p["d_out"], 24)) for p in problems
                    if p["name"].startswith("wt103-47m-")]  # the four uses: V, O, keys, values
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    slug = "".join(c if c.isalnum() else "-" for c in device_name(device).lower()).strip("-")
    kind = "full" if args.full else "smoke" if args.cpu_smoke else "small"
    path = args.out or RESULTS / f"cvmm_{slug}_{kind}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    not_run: list[str] = []

    def save():  # after every problem: a run stopped by its caller keeps what it measured
        report = dict(machine=platform.node(), device=device_name(device), device_type=device.type,
                      dtype=str(dtype), cvmm_backend=backend, full_paper_shapes=args.full, tokens_override=tokens,
                      torch=torch.__version__, triton=triton_version, timing="triton.testing.do_bench median"
                      if device.type == "cuda" else f"wall-clock median of {args.reps}",
                      authors_cvmm=_portable(args.authors_cvmm) if args.authors_cvmm else None,
                      autotune=autotune_choices(), seconds=time.perf_counter() - started, not_run=not_run,
                      results=rows)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)
        if not args.no_markdown:
            path.with_suffix(".md").write_text(markdown(report))

    for number, problem in enumerate(problems):
        if time.perf_counter() > deadline:
            not_run += [p["name"] for p in problems[number:]]
            print(f"out of time: {len(not_run)} problem(s) not run: {', '.join(not_run)}")
            break
        for row in bench_problem(problem, device, dtype, args.reps, generator, args.check_only, contenders):
            rows.append(row)
            if row["mode"] == "check":
                worst = max(row["relative_errors"].values(), default=float("nan"))
                print(f"{row['problem']:44} {row['impl']:16} {'check':17} max relative error {worst:.2e} "
                      f"({'ok' if row['ok'] else 'MISMATCH'}, {row['backend']} backend) {row.get('error', '')}")
            elif "error" in row:
                print(f"{row['problem']:44} {row['impl']:16} error: {row['error']}")
            else:
                print(f"{row['problem']:44} {row['impl']:16} {row['mode']:17} {row['ms']:9.3f} "
                      f"{row['tflops']:8.2f} {row['fraction_of_dense']:8.2f}")
        save()

    if not args.check_only and not args.no_layers and not args.cpu_smoke:
        if time.perf_counter() > deadline:
            not_run.append("whole-layer timings")
            print("out of time: the whole-layer timings not run")
        else:
            print(f"{'layer':44} {'batch x length':16} {'cvmm ms':>9} {'reference ms':>13} {'speed-up':>9}")
            for row in bench_layers(device, dtype, tokens, args.reps, args.only, deadline, not_run):
                rows.append(row)
                print(f"{row['problem']:44} {str(row['batch']) + ' x ' + str(row['length']):16} "
                      f"{row['ms']:9.3f} {row['reference_ms']:13.3f} {row['speedup_over_reference']:9.2f}")
                save()
    save()
    print(f"wrote {path}" + ("" if args.no_markdown else f" and {path.with_suffix('.md').name}"))
    # the exit status is about our kernel; a contender that fails its check is reported in its rows and not timed
    mismatches = [f"{row['problem']} ({row['impl']})" for row in rows
                  if row["mode"] == "check" and row["impl"] == "cvmm" and not row["ok"]]
    if mismatches:
        print(f"disagreement with the reference beyond {CHECK_TOLERANCE[dtype]} on: {', '.join(mismatches)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
