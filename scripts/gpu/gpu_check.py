"""Correctness on a GPU: the Triton CVMM kernels and the whole model, checked before anything is timed.

    python scripts/gpu/gpu_check.py                  # CUDA: every section, paper shapes, >= 300 random problems
    python scripts/gpu/gpu_check.py --cpu-smoke      # anywhere: the same checks on small shapes, Triton interpreted

Sections (`--sections`, comma separated; all by default):
- `paper`: the CVMM op on every expert projection of the paper presets (SwitchHead V / O of the 47M and 262M
  models, SwitchAll's sigma-MoE keys / values) at the paper's token counts (batch x context).
- `sweep`: random problems (the four uses, N log-uniform from 1 to `--max-tokens`, odd sizes, k = 1..4, empty
  experts, transposed layouts).
  Every problem of `paper` and `sweep` runs forward and the three gradients (inputs, weight, gates) in each
  precision (CUDA: fp32 with TF32 off, fp32 with TF32 on, fp16, bf16; interpreter: fp32, fp16) and both reduction
  modes (atomic, deterministic), against the float64 PyTorch reference on the same rounded values; the error is
  max |got - want| / max |want| per tensor. Deterministic mode must also give bitwise equal results twice.
- `model`: whole models (RoPE, XL, SwitchAll; 2 layers of the 47M presets on CUDA, the tiny presets on CPU):
  logits and every parameter gradient with the Triton path against the PyTorch path (fp32, with the PyTorch run's
  ReLU decisions replayed in the Triton run: `ReluDecisions`; and bf16 autocast, each path against fp32), and cached
  decoding (one token at a time through the KV cache) against the full forward over the same tokens.
- `compile`: `torch.compile(fullgraph=True)` with inductor of a training step (loss and gradients against eager)
  and of static-cache `generate` (tokens against eager `generate`), for RoPE and XL; and compiled flex_attention
  for XL (logits and gradients against sdpa).

Writes `gpu_check_<device>.json` and `.md` to `--out-dir` (default benchmarks/results) with the device, driver,
torch and triton versions, and exits 1 if any check fails or errors (each failure is listed), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

# bench_cvmm (the paper's problems, their inputs) and machine (the device's description) are benchmark scripts, in a
# folder of scripts rather than a package: it goes on sys.path as each benchmark puts itself there. At import, so
# that the spawned workers of `op_section`'s pool, which import this file again, find them too.
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
SECTIONS = ("paper", "sweep", "model", "compile")
# max |got - want| / max |want| allowed per precision (the reference sees the same rounded inputs, so this is
# rounding of the outputs and of partial sums: a wrong row, slot, expert or gate gives errors of order 1)
TOLERANCE = {"fp32": 2e-5, "tf32": 1e-2, "fp16": 5e-3, "bf16": 2e-2}
MODEL_TOLERANCE = {"fp32": 1e-4}  # bf16: see bf16_row
SIZES = (1, 16, 17, 33, 64, 76, 100, 112, 129, 255, 412, 1024)  # d_in / d_out of the sweep: odd and paper sizes


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run on the CPU with TRITON_INTERPRET=1: small shapes, fp32 / fp16, few problems")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--cases", type=int, default=None, help="random problems in the sweep (default 320; smoke 8)")
    parser.add_argument("--max-tokens", type=int, default=None, help="largest N of the sweep (default 65536; smoke 48)")
    parser.add_argument("--paper-tokens", type=int, default=None,
                        help="tokens per paper problem (default: the paper's batch x context; smoke 24)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compile section")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep-precisions", choices=("all", "rotate"), default="all",
                        help="each random problem in every precision (all), or in fp32 and one other in turn "
                             "(rotate: twice the problems in the same time)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the op sections: the paper shapes may use 40%% of it, the sweep the rest; "
                        "problems not started in time are reported as not run")
    parser.add_argument("--out-dir", type=Path, default=BENCHMARKS / "results")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes for the op sections (compiling Triton kernels in parallel)")
    parser.add_argument("--name", default=None, help="result file stem (default: gpu_check_<device>)")
    parser.add_argument("--no-markdown", action="store_true", help="write the JSON only (scripts/gpu/gpu_report.py "
                        "renders it later)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


# ------------------------------------------------------------------------------------------------ comparisons
def relative_error(got, want) -> float:
    """max |got - want| / max |want| in float64; NaN / inf anywhere in `got` gives inf."""
    import torch

    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return math.inf
    if not torch.isfinite(got).all():
        return math.inf
    if want.numel() == 0:
        return 0.0
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def record(section: str, name: str, errors: dict[str, float], tolerance: float, **extra) -> dict:
    worst = max(errors.values()) if errors else 0.0
    return dict(section=section, name=name, status="ok" if worst <= tolerance else "mismatch", worst_error=worst,
                tolerance=tolerance, errors=errors, **extra)


def error_record(section: str, name: str, error: BaseException, **extra) -> dict:
    lines = traceback.format_exception_only(type(error), error)
    return dict(section=section, name=name, status="error", error="".join(lines).strip()[-600:], **extra)


# ------------------------------------------------------------------------------------------------ the op
def precisions(device_type: str) -> list[tuple[str, object, bool]]:
    import torch

    if device_type == "cuda":
        return [("fp32", torch.float32, False), ("tf32", torch.float32, True), ("fp16", torch.float16, False),
                ("bf16", torch.bfloat16, False)]
    return [("fp32", torch.float32, False), ("fp16", torch.float16, False)]  # the interpreter has no bf16 dot


def run_op(op: Callable, tensors, index, out_groups: int, upstream):
    """Output and (d inputs, d weight, d gates) of `op(inputs, index, weight, gates, out_groups)`."""
    import torch

    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    inputs, weight, gates = leaves
    out = op(inputs, index, weight, gates, out_groups)
    wanted = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out, wanted, upstream.to(out.dtype))
    return out.detach(), [g.detach() for g in grads]


def check_op_problem(section: str, problem: dict, tensors, index, fast: Callable, reference: Callable,
                     device_type: str, labels: Sequence[str] | None = None) -> list[dict]:
    """`fast` (in every precision, or those of `labels`, and both reduction modes) against `reference` (float64)
    on one problem."""
    import torch

    from switchhead import kernels

    out_groups = problem["out_groups"]
    names = ("output", "d_inputs", "d_weight") + (("d_gates",) if tensors[2] is not None else ())
    generator = torch.Generator().manual_seed(problem.get("seed", 0) + 7)
    rows = []
    upstream = None
    for label, dtype, tf32 in precisions(device_type):
        if labels is not None and label not in labels:
            continue
        low = [t.to(dtype) if t is not None else None for t in tensors[:2]] + [tensors[2]]  # gates stay fp32
        wide = [t.double() if t is not None else None for t in low]
        if upstream is None:  # one upstream gradient per problem, shared by every precision
            with torch.no_grad():
                shape = reference(wide[0], index, wide[1], wide[2], out_groups).shape
            upstream = torch.randn(shape, generator=generator, dtype=torch.float64).to(wide[0].device)
        want_out, want_grads = run_op(reference, wide, index, out_groups, upstream)
        previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        try:
            for mode in ("atomic", "deterministic"):
                name = f"{problem['name']} {label} {mode}"
                kernels.set_deterministic(mode == "deterministic")
                try:
                    out, grads = run_op(fast, low, index, out_groups, upstream)
                    errors = {n: relative_error(t, w) for n, t, w in zip(names, (out, *grads),
                                                                          (want_out, *want_grads))}
                    extra = {}
                    if mode == "deterministic":
                        again, again_grads = run_op(fast, low, index, out_groups, upstream)
                        extra["bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip((out, *grads),
                                                                                             (again, *again_grads)))
                    row = record(section, name, errors, TOLERANCE[label], precision=label, mode=mode,
                                 problem={k: v for k, v in problem.items() if k != "name"}, **extra)
                    if extra.get("bitwise_repeatable") is False:
                        row["status"] = "mismatch"
                    rows.append(row)
                except Exception as error:  # noqa: BLE001 - a failing kernel is a finding, reported with the rest
                    rows.append(error_record(section, name, error, precision=label, mode=mode))
        finally:
            kernels.set_deterministic(None)
            torch.set_float32_matmul_precision(previous)
    return rows


def triton_op(inputs, index, weight, gates, out_groups):
    from switchhead import kernels

    return kernels.cvmm(inputs, index, weight, gates, out_groups)


def reference_op(inputs, index, weight, gates, out_groups):
    """The model's PyTorch path (the "eager" entry of the Hub file's table, itself held against the naive twin
    in tests/model/test_expert_ops.py). On a GPU it runs its "all_experts" formulation, whose memory stays near
    G x N x d (the kernels' own PyTorch twin would materialise [G, N * R, d_out]: 34 GB in float64 for SwitchAll
    259M's sigma-MoE values at the paper's 32k tokens)."""
    from switchhead.expert_ops import expert_projection

    return expert_projection(inputs, index, weight, gates, out_groups, implementation="eager")


def random_problem(generator, index: int, max_tokens: int, sizes, element_budget: int) -> dict:
    """One random CVMM problem of the sweep (a `bench_cvmm.make_inputs` problem dict)."""
    import torch

    def draw(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    use = ("value", "output", "mlp_keys", "mlp_values")[index % 4]
    k = draw(1, 4)
    heads = draw(1, 4) if use in ("value", "output") else 1
    per_head = draw(k, max(k, 8))
    d_in, d_out = (sizes[draw(0, len(sizes) - 1)] for _ in range(2))
    tokens = int(round(math.exp(float(torch.rand(1, generator=generator)) * math.log(max_tokens))))
    slots = heads * k
    tokens = max(1, min(tokens, element_budget // max(1, slots * max(d_in, d_out))))
    rows, out_groups, gated = {"value": (1, heads, True), "output": (heads, 1, True), "mlp_keys": (1, 1, False),
                               "mlp_values": (k, 1, True)}[use]
    used = draw(1, per_head) if float(torch.rand(1, generator=generator)) < 0.3 else None  # others stay empty
    if used is not None and used < k:
        used = k
    return dict(name=f"sweep{index:03d}/{use}", tokens=tokens, rows=rows, slots=slots, gated=gated,
                out_groups=out_groups, experts=heads * per_head, heads=heads, d_in=d_in, d_out=d_out,
                used_experts=used, strided=bool(float(torch.rand(1, generator=generator)) < 0.2), seed=index)


@contextlib.contextmanager
def pinned_kernel_configs(index: int):
    """Run the CVMM kernels with only their `index`-th autotune config (modulo the count): no benchmarking, and a
    sweep of many problems goes through every config of both kernels, not only the ones the autotuner keeps."""
    module = importlib.import_module("switchhead.kernels.cvmm_triton")
    saved, chosen = [], {}
    for name in ("_gathered_expert_matmul", "_expert_weight_grad"):
        tuner = getattr(module, name)
        saved.append((tuner, tuner.configs))
        tuner.configs = [tuner.configs[index % len(tuner.configs)]]
        chosen[name] = str(tuner.configs[0])
    try:
        yield chosen
    finally:
        for tuner, configs in saved:
            tuner.configs = configs


def check_one_problem(task: tuple) -> tuple[int, list[dict] | None]:
    """(number, rows) of one op problem, or (number, None) when the wall-clock deadline has passed; runs in the
    checking process or in a worker of `op_section`'s pool."""
    import torch

    section, number, problem, device_type, wall_deadline, labels = task
    if time.time() > wall_deadline:
        return number, None
    from bench_cvmm import make_inputs

    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(1000 + problem.get("seed", 0))
    inputs, index, weight, gates = make_inputs(problem, device, torch.float32, generator)
    with pinned_kernel_configs(number + (3 if section == "paper" else 0)) as configs:
        rows = check_op_problem(section, problem, (inputs, weight, gates), index, triton_op, reference_op,
                                device.type, labels)
    for row in rows:
        row["kernel_configs"] = configs
    return number, rows


def rotated_precisions(number: int, device_type: str) -> list[str]:
    """The precisions of the sweep's `number`-th problem under --sweep-precisions rotate: fp32 (the tightest
    tolerance, where an indexing or accumulation bug shows most plainly) and one of the others in turn. The turn
    steps with number // 2 + number // 5, so that over a sweep each other precision meets every use (number
    modulo 4) and every pinned autotune config (number modulo the config count, for any count up to 12). Half the
    compilations and runs of all four, so a fresh machine checks twice the problems."""
    labels = [label for label, _, _ in precisions(device_type)]
    others = labels[1:]
    return [labels[0], others[(number // 2 + number // 5) % len(others)]] if len(others) > 1 else labels


def op_section(section: str, problems: list[dict], device, log, deadline: float = math.inf,
               pool=None, rotate: bool = False) -> list[dict]:
    """Check every problem with one autotune config pinned per problem, in turn (so the problems go through every
    config of both kernels and each compiles one config, not all); stops starting problems at `deadline`.

    With a `pool` (multiprocessing, spawned) the problems are shared among its worker processes: a fresh GPU
    machine spends most of this section compiling Triton kernels, one at a time per process, and the compiled
    kernels land in Triton's cache on disk, where the later stages find them. Rows come in the problems' order."""
    wall_deadline = time.time() + (deadline - time.perf_counter()) if deadline != math.inf else math.inf
    tasks = [(section, number, problem, device.type, wall_deadline,
              rotated_precisions(number, device.type) if rotate else None) for number, problem in enumerate(problems)]
    outcomes = pool.imap(check_one_problem, tasks) if pool is not None else map(check_one_problem, tasks)
    rows, skipped = [], 0
    for (number, problem_rows), problem in zip(outcomes, problems):
        if problem_rows is None:
            skipped += 1
            continue
        rows += problem_rows
        bad = [r for r in problem_rows if r["status"] != "ok"]
        log(f"{section:7} {problem['name']:44} N={problem['tokens']:<6} "
            f"{'ok' if not bad else 'FAIL ' + ', '.join(r['name'].split(' ', 1)[1] for r in bad)}")
    if skipped:
        log(f"{section:7} out of time: {skipped} of {len(problems)} problems not run")
        rows.append(dict(section=section, name=f"{skipped} problems not run (time budget)", status="not run"))
    return rows


# ------------------------------------------------------------------------------------------------ models
def model_presets(smoke: bool) -> dict[str, tuple[str, dict]]:
    if smoke:
        return {"switchhead-rope": ("tiny-switchhead", {}), "switchhead-xl": ("tiny-switchhead-xl", {}),
                "switchall-rope": ("tiny-switchall", {}), "moeut": ("tiny-moeut", {})}
    two = dict(num_hidden_layers=2, hidden_dropout=0.0)
    # MoEUT: its 2 shared blocks applied twice each (4 applications), so that sharing is in the check
    return {"switchhead-rope": ("wt103-45m-switchhead-rope", two), "switchhead-xl": ("wt103-47m-switchhead-xl", two),
            "switchall-xl": ("wt103-47m-switchall-xl", two), "moeut": ("moeut-44m", dict(two, num_hidden_layers=4))}


def build_model(preset: str, overrides: dict, device, attn: str = "sdpa", train: bool = False):
    """A freshly initialised model (seed 0); `train=True`: training mode with every dropout off (comparable runs)."""
    import torch

    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset(preset, **overrides)
    config._attn_implementation = attn
    model = SwitchHeadForCausalLM(config).to(device)
    if not train:
        return model.eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def loss_and_grads(model, ids, autocast_dtype=None):
    import torch

    with torch.autocast(ids.device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    named = [(n.removeprefix("_orig_mod."), p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.loss, [p for _, p in named], allow_unused=True)
    return out.logits.detach().float(), {n: g for (n, _), g in zip(named, grads) if g is not None}


# Under bf16 autocast both paths round differently at every layer, and a freshly initialised 47M model's logits
# and gradients move by 0.3-0.8 of their largest value between fp32 and bf16 on the PyTorch path alone (measured on
# the CPU with the 2-layer presets of this section), so the two bf16 paths are not compared with each other: each
# is compared with the fp32 PyTorch result, and the Triton path may be at most BF16_FACTOR times as far from it as
# the PyTorch path is (plus BF16_FLOOR), per tensor. A wrong row, gate or expert puts it much further.
BF16_FACTOR, BF16_FLOOR = 1.5, 1e-3


def bf16_row(variant, preset, triton_run, torch_run, fp32_run, fast="triton", **extra) -> dict:
    """The record of one bf16 model check: each bf16 run against the fp32 reference, tensor by tensor (`fast`: the
    path checked against the PyTorch one, "triton" or "fused")."""
    (logits, grads), (torch_logits, torch_grads), (want_logits, want_grads) = triton_run, torch_run, fp32_run
    pairs = {"logits": (relative_error(logits, want_logits), relative_error(torch_logits, want_logits))}
    for name in want_grads:
        if name in grads and name in torch_grads:
            pairs[name] = (relative_error(grads[name], want_grads[name]),
                           relative_error(torch_grads[name], want_grads[name]))
    ratios = {name: fast / (BF16_FACTOR * ref + BF16_FLOOR) for name, (fast, ref) in pairs.items()}
    worst = max(ratios, key=ratios.get)
    errors = {f"logits vs fp32 ({fast})": pairs["logits"][0], "logits vs fp32 (torch)": pairs["logits"][1],
              f"worst tensor {worst} vs fp32 ({fast})": pairs[worst][0],
              f"worst tensor {worst} vs fp32 (torch)": pairs[worst][1]}
    row = record("model", f"{variant} {fast} vs torch bf16 (each against fp32)", errors, math.inf, preset=preset,
                 **extra)
    # worst_error / tolerance is the worst ratio of the checked path's distance to the allowed distance
    row.update(worst_error=ratios[worst], tolerance=1.0, status="ok" if ratios[worst] <= 1.0 else "mismatch",
               rule=f"{fast} error <= {BF16_FACTOR} x torch error + {BF16_FLOOR}, per tensor")
    missing = sorted(set(want_grads) ^ set(grads))
    if missing:
        row.update(status="mismatch", missing_gradients=missing)
    return row


def diagnose_fp32_mismatch(variant: str, model, ids, triton_run, torch_run, worst: str | None,
                           decisions: ReluDecisions | None = None) -> dict:
    """Where an fp32 whole-model check failed: which side is wrong, and does it depend on the autotuner?

    Runs the Triton path again with the first autotune config pinned (no benchmarking), and the PyTorch path in
    float64 on a copy of the model, then reports, for the worst parameter of the failed check and for the logits,
    how far the Triton run, the pinned Triton run and the PyTorch fp32 run each are from float64 (`worst`: that
    parameter's name, as the check found it). The side far from float64 is the wrong one; both near it would mean
    the check's tolerance is too tight. With `decisions`, the reruns replay the PyTorch run's ReLU decisions too."""
    import copy

    import torch

    logits, grads = triton_run
    want_logits, want_grads = torch_run
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")

    def held(on):  # the PyTorch run's ReLU decisions, replayed in `on` (the model or its float64 copy)
        if decisions is None:
            return contextlib.nullcontext()
        replayer = decisions if on is model else ReluDecisions(on)
        replayer.masks = decisions.masks
        return replayer.replay()

    try:
        model.set_experts_implementation("cvmm")
        with pinned_kernel_configs(0) as configs, held(model):
            pinned_logits, pinned_grads = loss_and_grads(model, ids, None)
        wide = copy.deepcopy(model).double()
        wide.set_experts_implementation("eager")
        with held(wide):
            wide_logits, wide_grads = loss_and_grads(wide, ids, None)
        del wide
    finally:
        torch.set_float32_matmul_precision(previous)
    errors = {}
    for label, (run_logits, run_grads) in (("triton", (logits, grads)), ("triton pinned", (pinned_logits, pinned_grads)),
                                           ("torch", (want_logits, want_grads))):
        errors[f"logits vs fp64 ({label})"] = relative_error(run_logits, wide_logits)
        if worst is not None:
            errors[f"{worst} vs fp64 ({label})"] = relative_error(run_grads[worst], wide_grads[worst])
    far = {label: errors[f"{worst} vs fp64 ({label})"] for label in ("triton", "torch")} if worst else {}
    wrong = [label for label, error in far.items() if error > MODEL_TOLERANCE["fp32"]]
    return dict(section="diagnosis", name=f"{variant} fp32 mismatch against float64, and with a config pinned",
                status="mismatch" if wrong else "ok", errors=errors, worst_parameter=worst, kernel_configs=configs,
                wrong_side=wrong or None)


class ReluDecisions:
    """Holds the ReLU decisions of one run of a model and replays them in the runs compared with it.

    A pre-activation within rounding of zero is positive in one run and negative in another (on an H100, a fresh
    2-layer SwitchAll-XL had one sigma-MoE key unit at +2.1e-7 in fp32 and -4.2e-7 in float64: a 3.6% gradient
    difference with the logits within 1.2e-6). The ReLU's derivative jumps there, so the gradients of two correct
    runs can differ by percents while the forward agrees: the whole-model check would test where the kinks fall, not
    the expert op. So the reference run records each ReLU's mask (`record`), and every run compared with it
    multiplies by those masks instead (`replay`), counting the pre-activations whose own sign disagrees (`kinks`):
    the values differ only there, by a rounding error, and the gradients then differ only by the arithmetic under
    test."""

    def __init__(self, model):
        from switchhead.expert_ops import relu

        self.masks, self.kinks = [], 0
        self.modules = [m for m in model.modules() if getattr(m, "act_fn", None) is relu]
        if not self.modules and getattr(model.config, "hidden_act", None) == "relu":
            raise RuntimeError("the model's ReLUs were not found: the check cannot hold its kinks fixed")

    @contextlib.contextmanager
    def _patched(self, replace):
        originals = [m.act_fn for m in self.modules]
        calls = itertools.count()  # the ReLUs run in the same order in every run of a model
        for module, original in zip(self.modules, originals):
            module.act_fn = lambda x, original=original: replace(x, original, next(calls))
        try:
            yield self
        finally:
            for module, original in zip(self.modules, originals):
                module.act_fn = original

    def record(self):
        self.masks.clear()

        def replace(x, original, _):
            self.masks.append((x > 0).detach())
            return original(x)
        return self._patched(replace)

    def replay(self):
        def replace(x, _, number):
            mask = self.masks[number]
            self.kinks += int(((x > 0) != mask).sum())
            return x * mask.to(x.dtype)
        return self._patched(replace)


def model_section(smoke: bool, device, log) -> list[dict]:
    import torch

    rows = []
    batch, length = (2, 12) if smoke else (4, 128)
    for variant, (preset, overrides) in model_presets(smoke).items():
        try:
            model = build_model(preset, overrides, device, train=True)
            ids = torch.randint(1, model.config.vocab_size, (batch, length),
                                generator=torch.Generator().manual_seed(5)).to(device)
            previous = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("highest")
            decisions = ReluDecisions(model)
            try:
                runs = {}
                for label, autocast in (("fp32", None), ("bf16", torch.bfloat16)):
                    if autocast is not None and device.type != "cuda":
                        continue  # the interpreter has no bf16 dot
                    # the PyTorch path first: in fp32 its ReLU decisions are replayed in the Triton run
                    for backend, implementation in (("torch", "eager"), ("triton", "cvmm"),
                                                    ("fused", "switchhead_fused")):
                        model.set_experts_implementation(implementation)
                        held = (decisions.record() if backend == "torch" else decisions.replay()) \
                            if label == "fp32" else contextlib.nullcontext()
                        with held:
                            runs[label, backend] = loss_and_grads(model, ids, autocast)
            finally:
                torch.set_float32_matmul_precision(previous)
            (logits, grads), (want_logits, want_grads) = runs["fp32", "triton"], runs["fp32", "torch"]
            errors = {"logits": relative_error(logits, want_logits)}
            worst = max(((relative_error(grads[n], want_grads[n]), n) for n in want_grads if n in grads),
                        default=(0.0, None))
            errors["gradients (worst parameter)"] = worst[0]
            row = record("model", f"{variant} triton vs torch fp32", errors, MODEL_TOLERANCE["fp32"],
                         preset=preset, batch=batch, length=length, worst_parameter=worst[1],
                         relu_kinks_held=decisions.kinks)
            missing = sorted(set(want_grads) ^ set(grads))
            if missing:
                row.update(status="mismatch", missing_gradients=missing)
            rows.append(row)
            if row["status"] != "ok":
                rows.append(diagnose_fp32_mismatch(variant, model, ids, (logits, grads), (want_logits, want_grads),
                                                   row["worst_parameter"], decisions))
            # the fused attention block (one input GEMM, recomputing value mix): fp32 against the PyTorch path
            fused_logits, fused_grads = runs["fp32", "fused"]
            fused_errors = {"logits": relative_error(fused_logits, want_logits), "gradients (worst parameter)": max(
                (relative_error(fused_grads[n], want_grads[n]) for n in want_grads if n in fused_grads), default=0.0)}
            rows.append(record("model", f"{variant} fused vs torch fp32", fused_errors, MODEL_TOLERANCE["fp32"],
                               preset=preset, batch=batch, length=length))
            if set(fused_grads) != set(want_grads):
                rows[-1].update(status="mismatch", missing_gradients=sorted(set(want_grads) ^ set(fused_grads)))
            for fast in ("triton", "fused"):
                if ("bf16", fast) in runs:
                    rows.append(bf16_row(variant, preset, runs["bf16", fast], runs["bf16", "torch"],
                                         runs["fp32", "torch"], fast=fast, batch=batch, length=length))
            rows.append(cached_decoding_row(variant, preset, model, device, smoke))
        except Exception as error:  # noqa: BLE001
            rows.append(error_record("model", variant, error, preset=preset))
        log(f"model   {variant:44} {', '.join(r['status'] for r in rows if variant in r['name'])}")
    return rows


def cached_decoding_row(variant, preset, model, device, smoke) -> dict:
    """Greedy decoding through the KV cache: every step's logits against a full forward over the same tokens."""
    import torch

    from switchhead.transformers_compat import output_cache

    model.eval()
    prompt, steps = (6, 3) if smoke else (32, 8)
    ids = torch.randint(1, model.config.vocab_size, (2, prompt), generator=torch.Generator().manual_seed(6)).to(device)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    errors = {}
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            cache, sequence = output_cache(out), ids
            for step in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                sequence = torch.cat([sequence, token], 1)
                out = model(input_ids=token, cache=cache, use_cache=True)
                cache = output_cache(out)
                full = model(input_ids=sequence, use_cache=False).logits[:, -1]
                errors[f"step {step}"] = relative_error(out.logits[:, -1], full)
    finally:
        torch.set_float32_matmul_precision(previous)
    model.train()
    return record("model", f"{variant} cached vs uncached decoding", errors, MODEL_TOLERANCE["fp32"], preset=preset)


def compile_section(smoke: bool, device, backend: str, log,
                    emit: Callable[[dict], None] | None = None) -> list[dict]:
    """The compile checks; `emit` sees each row as it is made (the caller saves the report after each)."""
    import torch
    from transformers import CompileConfig

    rows = _EmittingList(emit)
    batch, length = (2, 12) if smoke else (4, 128)
    variants = {k: v for k, v in model_presets(smoke).items() if k in ("switchhead-rope", "switchhead-xl")}
    for variant, (preset, overrides) in variants.items():
        name = f"{variant} compiled training step ({backend}, fullgraph)"
        try:
            model = build_model(preset, overrides, device, train=True)
            ids = torch.randint(1, model.config.vocab_size, (batch, length),
                                generator=torch.Generator().manual_seed(8)).to(device)
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            start = time.perf_counter()
            logits, grads = loss_and_grads(compiled, ids)
            compile_s = time.perf_counter() - start
            want_logits, want_grads = loss_and_grads(model, ids)
            errors = {"logits": relative_error(logits, want_logits), "gradients (worst parameter)": max(
                relative_error(grads[n], want_grads[n]) for n in want_grads)}
            rows.append(record("compile", name, errors, 1e-3, preset=preset, compile_s=compile_s))
        except Exception as error:  # noqa: BLE001
            rows.append(error_record("compile", name, error, preset=preset))
        name = f"{variant} compiled static-cache generate ({backend}, fullgraph)"
        try:
            model = build_model(preset, overrides, device)
            prompt = torch.randint(1, model.config.vocab_size, (2, 8 if smoke else 32),
                                   generator=torch.Generator().manual_seed(9)).to(device)
            kwargs = dict(max_new_tokens=4 if smoke else 16, do_sample=False, pad_token_id=0, eos_token_id=None)
            eager = model.generate(prompt, **kwargs)
            torch._dynamo.reset()
            config = CompileConfig(fullgraph=True, backend=backend, dynamic=False)
            config._compile_all_devices = True  # Transformers auto-compiles on accelerators only unless told
            start = time.perf_counter()
            compiled = model.generate(prompt, cache_implementation="static", compile_config=config, **kwargs)
            compile_s = time.perf_counter() - start
            really = getattr(model, "_compiled_call", None) is not None
            same = compiled.shape == eager.shape and bool((compiled == eager).all())
            rows.append(dict(section="compile", name=name, status="ok" if same and really else "mismatch",
                             tokens_equal=same, compiled=really, preset=preset, compile_s=compile_s))
        except Exception as error:  # noqa: BLE001
            rows.append(error_record("compile", name, error, preset=preset))
        log(f"compile {variant:44} {', '.join(r['status'] for r in rows if variant in r['name'])}")
    if flex_compiles_here(device):
        rows.append(flex_row(smoke, device, variants["switchhead-xl"], log))
    else:
        log(f"compile {'switchhead-xl flex_attention':44} not on this processor: {FLEX_CPU_NEEDS}")
    return list(rows)


FLEX_CPU_NEEDS = ("inductor compiles flex_attention on a CPU only with its AVX2 kernels (not without AVX2, nor under "
                  "ATEN_CPU_CAPABILITY=default), and Transformers always compiles it")


def flex_compiles_here(device) -> bool:
    """Whether torch.compile can lower flex_attention on `device` (on a CPU, torch's own test of the processor)."""
    if device.type != "cpu":
        return True
    from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

    return bool(check_cpu_supported())


class _EmittingList(list):
    """A list that hands each appended row to a callback as well."""

    def __init__(self, emit):
        super().__init__()
        self.emit = emit

    def append(self, row):
        super().append(row)
        if self.emit is not None:
            self.emit(row)


def flex_row(smoke, device, preset_overrides, log) -> dict:
    """XL with compiled flex_attention (Transformers compiles it on first use) against sdpa: forward and backward
    on CUDA, forward only on the CPU (FlexAttention has no CPU backward)."""
    import torch

    preset, overrides = preset_overrides
    name = "switchhead-xl flex_attention (compiled) vs sdpa"
    try:
        sdpa = build_model(preset, overrides, device, attn="sdpa", train=True)
        flex = build_model(preset, overrides, device, attn="flex_attention", train=True)
        flex.load_state_dict(sdpa.state_dict())
        batch, length = (2, 16) if smoke else (4, 256)
        ids = torch.randint(1, sdpa.config.vocab_size, (batch, length),
                            generator=torch.Generator().manual_seed(10)).to(device)
        kinks = None
        start = time.perf_counter()
        if device.type == "cuda":
            held, replayed = ReluDecisions(sdpa), ReluDecisions(flex)  # sdpa's ReLU decisions, replayed in flex
            with held.record():
                want_logits, want_grads = loss_and_grads(sdpa, ids)
            replayed.masks = held.masks
            with replayed.replay():
                logits, grads = loss_and_grads(flex, ids)  # compiles flex_attention on first use
            compile_s = time.perf_counter() - start
            kinks = replayed.kinks
            errors = {"logits": relative_error(logits, want_logits), "gradients (worst parameter)": max(
                relative_error(grads[n], want_grads[n]) for n in want_grads)}
        else:
            with torch.no_grad():
                logits = flex(input_ids=ids, use_cache=False).logits
                compile_s = time.perf_counter() - start
                errors = {"logits": relative_error(logits, sdpa(input_ids=ids, use_cache=False).logits)}
            name += " (forward only on the CPU)"
        row = record("compile", name, errors, 1e-3, preset=preset, first_call_s=compile_s, relu_kinks_held=kinks)
    except Exception as error:  # noqa: BLE001
        row = error_record("compile", name, error, preset=preset)
    log(f"compile {'switchhead-xl flex_attention':44} {row['status']}")
    return row


# ------------------------------------------------------------------------------------------------ report
def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU correctness check ({'CPU smoke, Triton interpreted' if report['smoke'] else 'CUDA'})", "",
             f"Device: {env['device']}; driver {env.get('driver')}; torch {env['torch']}; triton {env['triton']}; "
             f"transformers {env['transformers']}; {report['seconds']:.0f} s.", ""]
    summary = {}
    for row in report["results"]:
        counts = summary.setdefault(row["section"], {"ok": 0, "mismatch": 0, "error": 0, "not run": 0})
        counts[row["status"]] += 1
    lines += ["| section | checks | ok | mismatch | error | not run | worst error / tolerance |",
              "|---|---|---|---|---|---|---|"]
    for section, counts in summary.items():
        ratios = [r["worst_error"] / r["tolerance"] for r in report["results"]
                  if r["section"] == section and "worst_error" in r and r["tolerance"]]
        worst = f"{max(ratios):.3g}" if ratios else "-"
        lines.append(f"| {section} | {sum(counts.values())} | {counts['ok']} | {counts['mismatch']} | "
                     f"{counts['error']} | {counts['not run']} | {worst} |")
    failures = [r for r in report["results"] if r["status"] != "ok"]
    lines += ["", f"## Failures and problems not run ({len(failures)})", ""]
    for row in failures:
        detail = row.get("error") or ", ".join(f"{k} {v:.3g}" for k, v in row.get("errors", {}).items()) or "-"
        lines.append(f"- {row['section']} / {row['name']}: {row['status']}: {detail}")
    per_precision = {}
    for row in report["results"]:
        if "precision" in row and "worst_error" in row:
            key = (row["section"], row["precision"], row["mode"])
            per_precision[key] = max(per_precision.get(key, 0.0), row["worst_error"])
    if per_precision:
        lines += ["", "## Worst relative error per precision and mode", "", "| section | precision | mode | worst |"
                  " tolerance |", "|---|---|---|---|---|"]
        for (section, precision, mode), worst in sorted(per_precision.items()):
            lines.append(f"| {section} | {precision} | {mode} | {worst:.3g} | {TOLERANCE[precision]:g} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke and os.environ.get("TRITON_INTERPRET") != "1":  # Triton reads it at import: start again
        return subprocess.call([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)],
                               env=dict(os.environ, TRITON_INTERPRET="1"))
    import torch

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("switchhead gpu_check: error: no CUDA device; run with --cpu-smoke for the interpreted CPU check",
              file=sys.stderr)
        return 2
    smoke = args.cpu_smoke
    cases = args.cases if args.cases is not None else (8 if smoke else 320)
    max_tokens = args.max_tokens or (48 if smoke else 65536)
    paper_tokens = args.paper_tokens or (24 if smoke else None)
    started = time.perf_counter()
    deadline = started + args.time_budget if args.time_budget else math.inf

    def log(line):
        print(line, flush=True)

    results = []
    from bench_cvmm import paper_problems
    from machine import describe

    env = describe(device, interpreted=smoke)
    slug = "".join(c if c.isalnum() else "-" for c in env["device"].lower()).strip("-")[:40]
    stem = args.out_dir / (args.name or f"gpu_check_{'smoke_' if smoke else ''}{slug}")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def save():  # after every section, so that a run cut short still leaves what it checked
        report = dict(environment=env, smoke=smoke, sections=args.sections, cases=cases, max_tokens=max_tokens,
                      sweep_precisions=args.sweep_precisions,
                      seconds=time.perf_counter() - started, results=results)
        tmp = stem.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, stem.with_suffix(".json"))
        if not args.no_markdown:
            stem.with_suffix(".md").write_text(markdown(report))

    pool = None
    if args.jobs > 1 and {"paper", "sweep"} & set(args.sections):
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(args.jobs)
    if "paper" in args.sections:
        problems = paper_problems(paper_tokens)
        if smoke:  # interpreter: the model widths are far too slow; keep the routing, shrink the widths
            problems = [dict(p, d_in=min(p["d_in"], 40), d_out=min(p["d_out"], 24)) for p in problems
                        if p["name"].startswith("wt103-47m-")]  # the four uses: V, O, keys, values
        paper_deadline = started + 0.4 * args.time_budget if args.time_budget else math.inf
        results += op_section("paper", problems, device, log, min(deadline, paper_deadline), pool)
        save()
    if "sweep" in args.sections:
        generator = torch.Generator().manual_seed(args.seed)
        sizes = (1, 5, 16, 17, 33) if smoke else SIZES
        budget = 2 ** 12 if smoke else 2 ** 26
        results += op_section("sweep", [random_problem(generator, i, max_tokens, sizes, budget)
                                        for i in range(cases)], device, log, deadline, pool,
                              rotate=args.sweep_precisions == "rotate")
        save()
    if pool is not None:
        pool.terminate()
    if "model" in args.sections:
        results += model_section(smoke, device, log)
        save()
    if "compile" in args.sections:
        def emit(row):
            results.append(row)
            save()

        compile_section(smoke, device, args.compile_backend, log, emit)
    save()
    failures = [r for r in results if r["status"] in ("mismatch", "error")]
    print(f"{len(results)} checks, {len(failures)} failed; wrote {stem}.json" + ("" if args.no_markdown else " / .md"))
    for row in failures:
        print(f"FAILED {row['section']} / {row['name']}: {row.get('error') or row.get('errors')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
