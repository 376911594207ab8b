"""Compile check of the CVMM Triton kernels for Ampere (sm_80), Hopper (sm_90) and Blackwell (sm_100), no GPU needed:
every launch the dispatcher makes must compile, fit its shared memory and spill no register.

    python scripts/gpu/gpu_audit.py              # every launch x autotune config x architecture
    python scripts/gpu/gpu_audit.py --quick      # a representative subset, sm_90 only (the test's)

The dispatcher itself (`cvmm_forward_triton` and `cvmm_backward_triton`) runs on meta tensors for the paper's
projections (bench_cvmm.paper_problems, at the training batch) and a few off-paper shapes (odd sizes, transposed
layouts, a problem large enough for an unsplit weight gradient), in fp32 (IEEE and TF32), fp16 and bf16, atomic and
deterministic, as it would on a GPU with the target's multiprocessor count. Each kernel launch is recorded with its
arguments specialised the way Triton's launcher does (integers equal to 1 become constants, sizes and pointers
divisible by 16 are marked so), and each distinct launch is compiled with every autotune config of its kernel through
`triton.compile` (Triton's compiler and the ptxas in its wheel). cuobjdump reads each cubin: registers, stack,
shared memory, spill stores (STL) and loads (LDL). A spill moves registers through local memory in the inner loop,
which no timing on a GPU would point at; a config that spills here is a config to change. JSON (every compile) and
Markdown (per config and per architecture) go to benchmarks/results/; the exit status is 1 when a launch of our
kernels fails to compile, spills or needs more shared memory than a block may have.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be decorated for the real compiler, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

from switchhead.kernels.cvmm import key_dtype  # noqa: E402 - the op's sort keys (the audit decorates its own kernels)

REPO = Path(__file__).resolve().parents[2]
# bench_cvmm (the paper's problems) and machine (the machine's description) are benchmark scripts, in a folder of
# scripts rather than a package: it goes on sys.path as each benchmark puts itself there
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
RESULTS = BENCHMARKS / "results"
KERNELS = REPO / "kernels" / "cvmm_triton.py"
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# The most shared memory one block may opt into (CUDA C++ Programming Guide, compute capabilities 8.0, 9.0, 10.0),
# and the multiprocessor counts of an A100, H100 SXM and B200, on which the weight gradient's split depends.
ARCHS = {
    80: dict(gpu="A100", shared_per_block=163 * 1024, multiprocessors=108),
    90: dict(gpu="H100 SXM", shared_per_block=227 * 1024, multiprocessors=132),
    100: dict(gpu="B200", shared_per_block=227 * 1024, multiprocessors=148),
}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (dtype, fp32 matmul precision) of every mode the dispatcher has: fp32 IEEE ("highest") and TF32 ("high")
PRECISIONS = [("fp32", "highest"), ("fp32", "high"), ("fp16", "highest"), ("bf16", "highest")]


# ------------------------------------------------------------------------------------------------ problems
def off_paper_problems() -> list[dict]:
    """Shapes the paper's do not reach: odd sizes (no vector loads), transposed layouts (no unit stride), and an
    expert grid large enough that the weight gradient is not split (its output in the weight's dtype)."""
    return [
        dict(name="odd/value", tokens=300, rows=1, slots=4, gated=True, out_groups=2, experts=6, heads=2, d_in=37,
             d_out=23),
        dict(name="transposed/output", tokens=256, rows=2, slots=4, gated=True, out_groups=1, experts=8, heads=2,
             d_in=40, d_out=72, strided=True),
        dict(name="large/mlp_values", tokens=8192, rows=4, slots=4, gated=True, out_groups=1, experts=64, heads=1,
             d_in=2048, d_out=4096),
    ]


def paper_problems() -> list[dict]:
    """The projections of the paper's presets at their training batch (bench_cvmm's list)."""
    import bench_cvmm

    return bench_cvmm.paper_problems(None)


# The quick subset: every flag of both kernels in at least one dtype (see `audit_launches`)
QUICK_CASES = [("wt103-47m-switchhead-xl/value", "bf16", "highest", False),
               ("wt103-47m-switchall-xl/mlp_keys", "fp16", "highest", False),
               ("c4-262m-switchhead-xl/output", "fp32", "high", False),
               ("odd/value", "fp32", "highest", True)]


def meta_tensor(shape, dtype, strided=False) -> torch.Tensor:
    """A meta tensor (no memory); `strided` gives it the reversed (transposed) layout."""
    if strided:
        return torch.empty(*reversed(shape), device="meta", dtype=dtype).permute(*reversed(range(len(shape))))
    return torch.empty(*shape, device="meta", dtype=dtype)


# ------------------------------------------------------------------------------------------------ recording
def specialise(tuner, args: tuple, kwargs: dict, backend) -> dict:
    """A launch of an autotuned kernel as Triton's launcher would compile it: signature, constants, the arguments
    marked divisible by 16 (the binder's rules: `native_specialize_impl`), plus the launch's own constexprs."""
    from triton._C.libtriton import native_specialize_impl

    fn = tuner.fn
    bound = dict(zip(fn.arg_names, args))
    bound.update(kwargs)
    signature, constants, divisible = {}, {}, []
    for param in fn.params:
        if param.is_constexpr:
            if param.name in bound:  # the config's block sizes come later
                signature[param.name] = "constexpr"
                constants[param.name] = bound[param.name]
            continue
        kind, spec = native_specialize_impl(backend, bound[param.name], param.is_const, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constants[param.name] = spec
        elif spec == "D":
            divisible.append(param.name)
    return dict(signature=signature, constants=constants, divisible=divisible)


class _Recorder:
    """Stands in for an autotuned kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running."""

    def __init__(self, name: str, tuner, sink: list, label: dict, backend):
        self.name, self.tuner, self.sink, self.label, self.backend = name, tuner, sink, label, backend

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            launch = specialise(self.tuner, args, kwargs, self.backend)
            self.sink.append(dict(kernel=self.name, label=dict(self.label), **launch))

        return launch


KERNEL_NAMES = ("_gathered_expert_matmul", "_expert_weight_grad")


def record_launches(module, problem: dict, dtype_name: str, precision: str, deterministic: bool,
                    multiprocessors: int, sink: list, label: dict) -> None:
    """One forward and one full backward (d inputs, d weight, d gates) of `problem` through the module's launchers,
    with its kernels replaced by recorders and the GPU's multiprocessor count given where the module asks for it."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    saved = {name: getattr(module, name) for name in KERNEL_NAMES}
    counter = module._multiprocessors
    for name in KERNEL_NAMES:
        setattr(module, name, _Recorder(name, saved[name], sink, label, backend))
    module._multiprocessors = lambda device: multiprocessors
    dtype = DTYPES[dtype_name]
    n, rows, slots = problem["tokens"], problem["rows"], problem["slots"]
    strided = problem.get("strided", False)
    inputs = meta_tensor((n, rows, problem["d_in"]), dtype, strided)
    weight = meta_tensor((problem["experts"], problem["d_in"], problem["d_out"]), dtype, strided)
    gates = meta_tensor((n, slots), torch.float32, strided) if problem["gated"] else None
    sorted_expert = meta_tensor((n * slots,), key_dtype(problem["experts"]))  # the sort keys `cvmm` makes
    order = meta_tensor((n * slots,), torch.int64)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        out = module.cvmm_forward_triton(inputs, weight, gates, sorted_expert, order, problem["out_groups"],
                                         deterministic)
        module.cvmm_backward_triton(torch.empty_like(out), inputs, weight, gates, sorted_expert, order,
                                    problem["out_groups"], True, True, deterministic)
    finally:
        torch.set_float32_matmul_precision(previous)
        for name, kernel in saved.items():
            setattr(module, name, kernel)
        module._multiprocessors = counter


def audit_launches(module, problems: list[dict], multiprocessors: int, quick: bool) -> list[dict]:
    """Every distinct launch ("unit") the dispatcher makes for `problems` in every dtype and mode (QUICK_CASES if
    quick), each with the labels of every call that makes it."""
    by_name = {p["name"]: p for p in problems}
    cases = ([(by_name[name], d, p, det) for name, d, p, det in QUICK_CASES] if quick else
             [(problem, d, p, det) for problem in problems for d, p in PRECISIONS for det in (False, True)])
    launches: list[dict] = []
    for problem, dtype_name, precision, deterministic in cases:
        label = dict(problem=problem["name"], dtype=dtype_name,
                     precision="ieee" if precision == "highest" and dtype_name == "fp32" else "tf32/none",
                     deterministic=deterministic)
        record_launches(module, problem, dtype_name, precision, deterministic, multiprocessors, launches, label)
    units: dict[str, dict] = {}
    for launch in launches:
        key = json.dumps([launch["kernel"], launch["signature"], launch["constants"], sorted(launch["divisible"])],
                         sort_keys=True, default=str)
        unit = units.setdefault(key, dict(kernel=launch["kernel"], signature=launch["signature"],
                                          constants=launch["constants"], divisible=sorted(launch["divisible"]),
                                          labels=[]))
        if launch["label"] not in unit["labels"]:
            unit["labels"].append(launch["label"])
    return list(units.values())


# ------------------------------------------------------------------------------------------------ compiling
_MODULES: dict[str, object] = {}


def load_module(path: str, name: str = "switchhead_audited_cvmm_triton"):
    """The kernels' file imported from `path` once per process, for the real compiler whatever the caller's
    TRITON_INTERPRET was when it imported the package."""
    if path not in _MODULES:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[path] = module
    return _MODULES[path]


SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P(?:T|\d)\s+)?([A-Z][A-Z0-9_]*)", re.MULTILINE)


def read_sass(sass: str) -> dict:
    """Spill stores (STL) and loads (LDL) in a `cuobjdump -sass` listing."""
    opcodes = collections.Counter(SASS_LINE.findall(sass))
    return dict(spill_stores=opcodes["STL"], spill_loads=opcodes["LDL"])


def read_resources(dump: str) -> dict:
    """Registers, stack and static shared memory from `cuobjdump --dump-resource-usage`."""
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", dump)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {dump[-500:]}")
    return dict(registers=int(found[1]), stack=int(found[2]), static_shared=int(found[3]))


def compile_task(task: dict) -> dict:
    """Compile one (unit, config, architecture) and read its cubin; a compile error becomes the row's `error`."""
    unit, config, arch = task["unit"], task["config"], task["arch"]
    row = dict(kernel=unit["kernel"], arch=arch, config=config, labels=unit["labels"],
               constants={k: v for k, v in unit["constants"].items() if not k.startswith("stride")},
               signature=unit["signature"])
    try:
        fn = getattr(load_module(task["path"]), unit["kernel"]).fn
        signature = dict(unit["signature"], **{name: "constexpr" for name in config["constants"]})
        constants = dict(unit["constants"], **config["constants"])
        attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in unit["divisible"]}
        kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                                options=config["options"])
        with tempfile.TemporaryDirectory() as folder:
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            dump = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                                  text=True, check=True).stdout
            sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                                  check=True).stdout
    except Exception as error:  # noqa: BLE001 - a kernel that does not compile is a finding, reported with the rest
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        return row
    resources = read_resources(dump)
    shared = kernel.metadata.shared + resources["static_shared"]
    row.update(resources, shared=shared, fits=shared <= ARCHS[arch]["shared_per_block"], **read_sass(sass))
    return row


def configs_of(tuner, quick: bool, constants: dict | None = None) -> list[dict]:
    """The configs the autotuner can choose for a launch with `constants` (after its `early_config_prune`, if it has
    one), as {constants (block sizes), options (warps, stages, ...)}; quick: the first and the last."""
    configs = list(tuner.configs)
    prune = getattr(tuner, "early_config_prune", None)
    if prune is not None and constants is not None:
        configs = list(prune(configs, {}, **constants))
    if quick and len(configs) > 2:
        configs = [configs[0], configs[-1]]
    out = []
    for config in configs:
        options = {k: v for k, v in config.all_kwargs().items() if k not in config.kwargs and v is not None}
        out.append(dict(constants=dict(config.kwargs), options=options))
    return out


def run_tasks(tasks: list[dict], jobs: int, log) -> list[dict]:
    rows = []
    started = time.perf_counter()
    pool = (concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
            if jobs > 1 else None)
    results = pool.map(compile_task, tasks, chunksize=1) if pool is not None else map(compile_task, tasks)
    try:
        for number, row in enumerate(results, 1):
            rows.append(row)
            if number % 50 == 0 or number == len(tasks):
                log(f"  compiled {number}/{len(tasks)} ({time.perf_counter() - started:.0f} s)")
    finally:
        if pool is not None:
            pool.shutdown()
    return rows


def failures(rows: list[dict]) -> list[dict]:
    """The compiles that fail the check: an error, a spill store, or more shared memory than a block may have."""
    return [r for r in rows if "error" in r or r["spill_stores"] > 0 or not r["fits"]]


# ------------------------------------------------------------------------------------------------ report
def tile_of(row: dict) -> str:
    blocks = row["config"]["constants"]
    options = row["config"]["options"]
    return "x".join(str(v) for v in blocks.values()) + f" w{options['num_warps']} s{options['num_stages']}"


def markdown(report: dict) -> str:
    rows = report["rows"]
    targets = ", ".join(f"sm_{a} ({ARCHS[a]['gpu']})" for a in report["archs"])
    bad = failures(rows)
    lines = [f"# Compile check of the CVMM kernels: {report['name']}", "",
             f"Compiled on the CPU (no GPU) with triton {report['triton']} and the ptxas in its wheel "
             f"({report['ptxas']}); targets {targets}{'; quick subset' if report['quick'] else ''}. Every launch the "
             f"dispatcher makes on {len(report['problems'])} shapes in every dtype and mode ({report['units']} "
             f"distinct launches) x every autotune config: {len(rows)} compilations, {len(bad)} failing (a compile "
             "error, a spill store, or more shared memory than a block may have). STL / LDL: spill stores / loads "
             "in the SASS.", "",
             "| kernel | arch | config (blocks, warps, stages) | compiles | errors | spilling | STL max | LDL max | "
             "registers | stack max | shared KiB max |", "|---" * 11 + "|"]
    groups = collections.defaultdict(list)
    for row in rows:
        groups[row["kernel"], row["arch"], tile_of(row)].append(row)
    for (kernel, arch, tile), group in sorted(groups.items(), key=lambda item: str(item[0])):
        ok = [r for r in group if "error" not in r]
        registers = [r["registers"] for r in ok] or [0]
        lines.append(f"| {kernel} | sm_{arch} | {tile} | {len(group)} | {len(group) - len(ok)} | "
                     f"{sum(r['spill_stores'] > 0 for r in ok)} | {max((r['spill_stores'] for r in ok), default=0)} | "
                     f"{max((r['spill_loads'] for r in ok), default=0)} | {min(registers)}-{max(registers)} | "
                     f"{max((r['stack'] for r in ok), default=0)} | "
                     f"{max((r['shared'] for r in ok), default=0) / 1024:.0f} |")
    if bad:
        lines += ["", "## Failing compiles", ""]
        for row in bad[:40]:
            problems = sorted({label["problem"] for label in row["labels"]})
            why = row.get("error") or (f"{row['spill_stores']} spill stores" if row["spill_stores"] else
                                       f"{row['shared']} bytes of shared memory")
            lines.append(f"- {row['kernel']} sm_{row['arch']} {tile_of(row)} ({', '.join(problems)}): {why}")
    return "\n".join(lines) + "\n"


def tool_version(tool: str) -> str:
    output = subprocess.run([str(BIN / tool), "--version"], capture_output=True, text=True).stdout.strip()
    return output.splitlines()[-1] if output else f"{tool} (version unknown)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a representative subset on sm_90: the first and last "
                        "config of each kernel, every flag in at least one dtype")
    parser.add_argument("--archs", default=None, help="comma-separated compute capabilities (default: 80,90,100; "
                        "quick: 90)")
    parser.add_argument("--only", default="", help="check only the shapes whose name contains one of these "
                        "comma-separated texts (e.g. 47m,odd: the uses at the 47M sizes and the odd shape)")
    parser.add_argument("--name", default=None, help="result file name (default: gpu_audit, gpu_audit_quick)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    args = parser.parse_args(argv)
    archs = [int(a) for a in (args.archs or ("90" if args.quick else "80,90,100")).split(",")]
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        print(f"gpu_audit: error: --archs {unknown} not among {sorted(ARCHS)}", file=sys.stderr)
        return 2
    if args.quick and args.only:
        print("gpu_audit: error: --quick has its own shapes; leave out --only", file=sys.stderr)
        return 2
    wanted = [text for text in args.only.split(",") if text] or [""]
    problems = [p for p in paper_problems() + off_paper_problems() if any(text in p["name"] for text in wanted)]
    if not problems:
        print(f"gpu_audit: error: --only {args.only!r} matches no shape", file=sys.stderr)
        return 2
    name = args.name or ("gpu_audit_quick" if args.quick else "gpu_audit")

    module = load_module(str(KERNELS))
    tasks, units_count = [], 0
    for arch in archs:
        units = audit_launches(module, problems, ARCHS[arch]["multiprocessors"], args.quick)
        units_count = max(units_count, len(units))
        for unit in units:
            for config in configs_of(getattr(module, unit["kernel"]), args.quick, unit["constants"]):
                tasks.append(dict(unit=unit, config=config, arch=arch, path=str(KERNELS)))
    print(f"gpu_audit: {len(tasks)} compilations ({units_count} distinct launches per architecture) for "
          f"{', '.join(f'sm_{a}' for a in archs)} with {args.jobs} processes")
    rows = run_tasks(tasks, args.jobs, print)

    from machine import describe

    report = dict(name=name, machine=describe(torch.device("cpu")), triton=triton.__version__,
                  ptxas=tool_version("ptxas"), archs=archs, quick=args.quick, problems=problems, units=units_count,
                  rows=rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    path = args.out_dir / f"{name}.md"
    text = markdown(report)
    path.write_text(text)
    print(text)
    print(f"wrote {path.with_suffix('.json')} and {path.name}")
    return 1 if failures(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
