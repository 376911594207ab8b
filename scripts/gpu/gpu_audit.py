"""Compile audit of the CVMM Triton kernels for Ampere (sm_80), Hopper (sm_90) and Blackwell (sm_100), no GPU needed.

    python scripts/gpu/gpu_audit.py                    # every launch x config x architecture
    python scripts/gpu/gpu_audit.py --quick            # a representative subset, sm_90 only (the test's)
    python scripts/gpu/gpu_audit.py --authors-cvmm PATH/TO/their/switchhead/cvmm.py   # + the authors' kernel
    python scripts/gpu/gpu_audit.py --kernels OLD/cvmm_triton.py --name gpu_audit_before   # another version

What is compiled: the dispatcher itself (`cvmm_forward_triton` and `cvmm_backward_triton`) runs on meta tensors for
the paper's projections (bench_cvmm.paper_problems, at the training batch) and a few off-paper shapes (odd sizes,
transposed layouts, a problem large enough for an unsplit weight gradient), in fp32 (IEEE and TF32), fp16 and bf16,
atomic and deterministic, as it would on a GPU with the target's multiprocessor count; every kernel launch it makes is
recorded with its arguments specialised the way Triton's launcher does (integers equal to 1 become constants, sizes
and pointers divisible by 16 are marked so), and each distinct launch is compiled with every autotune config of its
kernel through `triton.compile` (Triton's compiler and the ptxas in its wheel) for each architecture. cuobjdump reads
the cubin: registers, stack, spill stores (STL) and loads (LDL), shared memory, the tensor-core MMA instructions (and
FFMA, for IEEE fp32 dots, which have no tensor-core form), the widest global load, and the occupancy those resources
allow under the CUDA occupancy calculator's rules. Controls compiled the same way: a plain tiled matmul of each tile
(the form of Triton's matmul tutorial, written here) and, with --authors-cvmm, the authors' `cvmm_kernel`, driven
through their own launcher on the same shapes. JSON (every compile) and Markdown (summaries, the comparison with
--compare, and a roofline prediction for an H100 from NVIDIA's published figures) go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import importlib.util
import json
import math
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
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# bench_cvmm (the paper's problems) and machine (the machine's description) are benchmark scripts, in a folder of
# scripts rather than a package: it goes on sys.path as each benchmark puts itself there
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
RESULTS = BENCHMARKS / "results"
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# Per-SM limits from the CUDA C++ Programming Guide's table of compute capabilities (8.0, 9.0, 10.0): 64K 32-bit
# registers, at most 64 resident warps and 32 resident blocks; shared memory per SM and the most one block may opt
# into. Multiprocessor counts of the A100, H100 SXM and B200 (the weight gradient's split depends on them).
ARCHS = {
    80: dict(gpu="A100", registers=65536, max_warps=64, max_blocks=32, shared_per_sm=164 * 1024,
             shared_per_block=163 * 1024, multiprocessors=108),
    90: dict(gpu="H100 SXM", registers=65536, max_warps=64, max_blocks=32, shared_per_sm=228 * 1024,
             shared_per_block=227 * 1024, multiprocessors=132),
    100: dict(gpu="B200", registers=65536, max_warps=64, max_blocks=32, shared_per_sm=228 * 1024,
              shared_per_block=227 * 1024, multiprocessors=148),
}
REGISTER_UNIT = 256  # registers are given to a warp in blocks of 256
SHARED_UNIT = 128  # shared memory is given to a block in units of 128 bytes ...
SHARED_RESERVED = 1024  # ... plus 1 KB the system keeps per block (compute capability 8.0 and later)

# NVIDIA's published H100 SXM figures (H100 Tensor Core GPU datasheet): BF16 tensor core 1,979 TFLOP/s "with
# sparsity", so half that dense, and 3.35 TB/s of HBM3 bandwidth.
H100_SXM = dict(bf16_dense_tflops=1979 / 2, hbm_tb_per_s=3.35)

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


@contextlib.contextmanager
def recording(module, names: tuple[str, ...], sink: list, label: dict, multiprocessors: int | None = None):
    """Replace `module`'s kernels by recorders; `multiprocessors` stands in for the GPU's count where the module
    asks for one, which sizes the weight gradient's split: through `_multiprocessors`, or (earlier versions) read
    inline from `torch.cuda.get_device_properties` by `_weight_grad_split`, which is then given a CUDA device and
    that count."""
    backend = make_backend(GPUTarget("cuda", 90, 32))
    saved = {name: getattr(module, name) for name in names}
    counter = getattr(module, "_multiprocessors", None)
    split = getattr(module, "_weight_grad_split", None)
    for name in names:
        setattr(module, name, _Recorder(name, saved[name], sink, label, backend))
    if multiprocessors is not None:
        if counter is not None:
            module._multiprocessors = lambda device: multiprocessors
        elif split is not None:
            module._weight_grad_split = lambda device, *sizes: _split_on_cuda(split, multiprocessors, *sizes)
    try:
        yield
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)
        if counter is not None:
            module._multiprocessors = counter
        if split is not None:
            module._weight_grad_split = split


def _split_on_cuda(split, multiprocessors: int, *sizes: int) -> int:
    """`split(device, *sizes)` as on a CUDA GPU with `multiprocessors` (no GPU is touched: only its properties are
    asked for)."""
    properties = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: type("Properties", (), dict(
        multi_processor_count=multiprocessors))()
    try:
        return split(torch.device("cuda", 0), *sizes)
    finally:
        torch.cuda.get_device_properties = properties


def drive_dispatcher(module, problem: dict, dtype_name: str, precision: str, deterministic: bool) -> None:
    """One forward and one full backward (d inputs, d weight, d gates) of `problem` through the module's launchers."""
    dtype = DTYPES[dtype_name]
    n, rows, slots = problem["tokens"], problem["rows"], problem["slots"]
    strided = problem.get("strided", False)
    inputs = meta_tensor((n, rows, problem["d_in"]), dtype, strided)
    weight = meta_tensor((problem["experts"], problem["d_in"], problem["d_out"]), dtype, strided)
    gates = meta_tensor((n, slots), torch.float32, strided) if problem["gated"] else None
    sorted_expert = meta_tensor((n * slots,), torch.int64)
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


def _unit_key(launch: dict) -> str:
    return json.dumps([launch["kernel"], launch["signature"], launch["constants"], sorted(launch["divisible"])],
                      sort_keys=True, default=str)


def group_launches(launches: list[dict]) -> list[dict]:
    """Distinct compilations ("units"), each with the labels of every call that makes it."""
    units: dict[str, dict] = {}
    for launch in launches:
        unit = units.setdefault(_unit_key(launch), dict(
            kernel=launch["kernel"], signature=launch["signature"], constants=launch["constants"],
            divisible=sorted(launch["divisible"]), labels=[]))
        if launch["label"] not in unit["labels"]:
            unit["labels"].append(launch["label"])
    return list(units.values())


def audit_launches(module, problems: list[dict], multiprocessors: int, quick: bool) -> list[dict]:
    """Every distinct launch the dispatcher makes for `problems` in every dtype and mode (QUICK_CASES if quick)."""
    by_name = {p["name"]: p for p in problems}
    cases = ([(by_name[name], d, p, det) for name, d, p, det in QUICK_CASES] if quick else
             [(problem, d, p, det) for problem in problems for d, p in PRECISIONS for det in (False, True)])
    launches: list[dict] = []
    for problem, dtype_name, precision, deterministic in cases:
        label = dict(problem=problem["name"], dtype=dtype_name,
                     precision="ieee" if precision == "highest" and dtype_name == "fp32" else "tf32/none",
                     deterministic=deterministic)
        with recording(module, ("_gathered_expert_matmul", "_expert_weight_grad"), launches, label,
                       multiprocessors):
            drive_dispatcher(module, problem, dtype_name, precision, deterministic)
    return group_launches(launches)


def authors_launches(module, problems: list[dict]) -> list[dict]:
    """The authors' forward kernel as their own launcher calls it for each problem and dtype: input row
    `sel_index[m]` of the flattened inputs, output row `out_index[m]`, sorted expert ids `sel`. Their launcher is
    registered as a torch.library op whose meta implementation launches nothing, so it gets uninitialised CPU
    tensors (never touched: the recorder stands in for the kernel)."""
    launcher = module.cvmm_triton if callable(module.cvmm_triton) else module.cvmm_triton_call
    launches: list[dict] = []
    for problem in problems:
        for dtype_name, dtype in DTYPES.items():
            n, rows, slots = problem["tokens"], problem["rows"], problem["slots"]
            x = torch.empty(n * rows, problem["d_in"], dtype=dtype)
            keys = torch.empty(problem["experts"], problem["d_in"], problem["d_out"], dtype=dtype)
            index = torch.empty(n * slots, dtype=torch.int64)
            label = dict(problem=problem["name"], dtype=dtype_name, precision="ieee" if dtype_name == "fp32" else
                         "tf32/none", deterministic=False)
            with recording(module, ("cvmm_kernel",), launches, label):
                launcher(x, index, index, keys, dtype, index)
    return group_launches(launches)


# ------------------------------------------------------------------------------------------------ the control
@triton.jit
def tiled_matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C = A @ B for row-major A [M, K], B [K, N], C [M, N]: the plain tiled matmul of Triton's tutorial, as the
    control for what a kernel with this tile compiles to when it gathers nothing."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < K - k0), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < K - k0) & (offs_n[None, :] < N), other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def control_units(quick: bool) -> list[dict]:
    """The tiled matmul in each dtype with every size a multiple of 16 (its best case), and in bf16 with the 47M
    value projection's sizes (d 412 -> 76: no size divisible by 16)."""
    units = []
    variants = [(d, p, True) for d, p in (("bf16", "tf32"),) + (() if quick else (
        ("fp16", "tf32"), ("fp32", "tf32"), ("fp32", "ieee")))] + ([] if quick else [("bf16", "tf32", False)])
    for dtype_name, precision, aligned in variants:
        pointer = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16"}[dtype_name]
        signature = dict(a_ptr=pointer, b_ptr=pointer, c_ptr=pointer, M="i32", N="i32", K="i32", stride_am="i32",
                         stride_bk="i32", stride_cm="i32", PRECISION="constexpr")
        divisible = ["a_ptr", "b_ptr", "c_ptr", "M"] + (["N", "K", "stride_am", "stride_bk", "stride_cm"]
                                                        if aligned else [])
        units.append(dict(kernel="tiled_matmul", signature=signature, constants=dict(PRECISION=precision),
                          divisible=divisible, labels=[dict(problem="aligned (all sizes % 16 == 0)" if aligned else
                                                            "47M value sizes (412 -> 76)", dtype=dtype_name,
                                                            precision=precision if dtype_name == "fp32" else
                                                            "tf32/none", deterministic=False)]))
    return units


# ------------------------------------------------------------------------------------------------ compiling
_MODULES: dict[str, object] = {}


def load_module(path: str, name: str):
    """A Python file imported from `path` once per process (the kernels under audit, or the authors' file)."""
    if path not in _MODULES:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[path] = module
    return _MODULES[path]


def kernel_function(source: dict):
    """The `triton.jit` function a task compiles: an autotuned kernel of a loaded file, or the control here."""
    if source["kind"] == "control":
        return tiled_matmul
    kernel = getattr(load_module(source["path"], source["module_name"]), source["kernel"])
    return getattr(kernel, "fn", kernel)


SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P(?:T|\d)\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)",
                       re.MULTILINE)


def read_sass(sass: str) -> dict:
    """Instruction counts of a `cuobjdump -sass` listing: spill stores and loads, tensor-core MMAs by full opcode
    (shape and types included), FFMA, and the widest global load (LDG, or LDGSTS: cp.async) in bytes."""
    spill_stores = spill_loads = ffma = 0
    mma: collections.Counter = collections.Counter()
    widest = 0
    for opcode, modifiers in SASS_LINE.findall(sass):
        if opcode == "STL":
            spill_stores += 1
        elif opcode == "LDL":
            spill_loads += 1
        elif opcode == "FFMA":
            ffma += 1
        elif "MMA" in opcode:
            mma[opcode + modifiers] += 1
        elif opcode in ("LDG", "LDGSTS"):
            bits = [int(m) for m in re.findall(r"\.(?:U|S)?(8|16|32|64|128)\b", modifiers)]
            widest = max(widest, (max(bits) if bits else 32) // 8)
    return dict(spill_stores=spill_stores, spill_loads=spill_loads, mma=dict(mma), ffma=ffma,
                widest_global_load_bytes=widest)


def read_resources(dump: str) -> dict:
    """Registers, stack and static shared memory from `cuobjdump --dump-resource-usage`."""
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", dump)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {dump[-500:]}")
    return dict(registers=int(found[1]), stack=int(found[2]), static_shared=int(found[3]))


def occupancy(registers: int, shared: int, warps: int, arch: int) -> dict:
    """Resident blocks and warps per SM that registers, shared memory and warps allow (the CUDA occupancy
    calculator's rules: registers per warp in 256s, shared memory in 128-byte units plus 1 KB per block)."""
    limits = ARCHS[arch]
    warp_registers = math.ceil(registers * 32 / REGISTER_UNIT) * REGISTER_UNIT
    by = dict(registers=limits["registers"] // (warp_registers * warps), warps=limits["max_warps"] // warps,
              blocks=limits["max_blocks"])
    if shared:
        by["shared"] = limits["shared_per_sm"] // (math.ceil(shared / SHARED_UNIT) * SHARED_UNIT + SHARED_RESERVED)
    blocks = min(by.values())
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * warps, occupancy=blocks * warps / limits["max_warps"],
                limited_by=min(by, key=by.get))


def compile_task(task: dict) -> dict:
    """Compile one (unit, config, architecture) and read its cubin; a compile error becomes the row's `error`."""
    unit, config, arch = task["unit"], task["config"], task["arch"]
    row = dict(kernel=unit["kernel"], family=task["family"], arch=arch, config=config, labels=unit["labels"],
               constants={k: v for k, v in unit["constants"].items() if not k.startswith("stride")},
               signature=unit["signature"])
    try:
        fn = kernel_function(task["source"])
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
    except Exception as error:  # noqa: BLE001 - a kernel that does not compile is a result of the audit
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        return row
    resources = read_resources(dump)
    shared = kernel.metadata.shared + resources["static_shared"]
    warps = config["options"]["num_warps"]
    row.update(resources, shared=shared, fits=shared <= ARCHS[arch]["shared_per_block"], **read_sass(sass),
               **occupancy(resources["registers"], shared, warps, arch))
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
    if jobs <= 1:
        results = map(compile_task, tasks)
        pool = None
    else:
        pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        results = pool.map(compile_task, tasks, chunksize=1)
    try:
        for number, row in enumerate(results, 1):
            rows.append(row)
            if number % 50 == 0 or number == len(tasks):
                log(f"  compiled {number}/{len(tasks)} ({time.perf_counter() - started:.0f} s)")
    finally:
        if pool is not None:
            pool.shutdown()
    return rows


# ------------------------------------------------------------------------------------------------ reports
def flags_of(row: dict) -> str:
    """A compile unit's switches in words: dtype and precision, gates, reduction, gate gradient, layout."""
    constants = row["constants"]
    dtypes = sorted({(label["dtype"], label["precision"]) for label in row["labels"]})
    parts = ["/".join(d if p == "tf32/none" or d != "fp32" else f"{d}-{p}" for d, p in dtypes)]
    if "HAS_GATES" in constants:
        parts.append("gates" if constants["HAS_GATES"] else "no gates")
    if "ATOMIC" in constants:
        parts.append("atomic" if constants["ATOMIC"] else "store")
    if constants.get("COMPUTE_DGATE"):
        parts.append("d gates")
    signature = row["signature"]
    if "stride_wn" in signature:  # the row kernel: W as stored (forward) or transposed (backward d inputs)
        parts.append("W" if signature["stride_wn"] == "constexpr" else
                     "W^T" if signature["stride_wk"] == "constexpr" else "W strided")
    output = signature.get("out_ptr") or signature.get("dw_ptr")
    if output:
        parts.append(f"out {output[1:]}")
    if "ALIGN" in constants:
        parts.append(f"align {constants['ALIGN']}")
    return ", ".join(parts)


def tile_of(row: dict) -> str:
    blocks = row["config"]["constants"]
    options = row["config"]["options"]
    return "x".join(str(v) for v in blocks.values()) + f" w{options['num_warps']} s{options['num_stages']}"


def mma_kinds(rows: list[dict]) -> str:
    kinds = sorted({kind.split(".")[0] for row in rows for kind in row.get("mma", {})})
    if any(row.get("ffma") and not row.get("mma") for row in rows):
        kinds.append("FFMA only (IEEE fp32)")
    return ", ".join(kinds) or "none"


def summarise(rows: list[dict], key) -> list[tuple]:
    groups = collections.defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return sorted(groups.items(), key=lambda item: str(item[0]))


def _stats(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]

    def most(key, default=0):
        return max((r[key] for r in ok), default=default)

    def least(key, default=0):
        return min((r[key] for r in ok), default=default)

    return dict(compiles=len(rows), errors=len(rows) - len(ok), spilling=sum(r["spill_stores"] > 0 for r in ok),
                stl_max=most("spill_stores"), stl_total=sum(r["spill_stores"] for r in ok),
                regs_max=most("registers"), regs_min=least("registers"), stack_max=most("stack"),
                shared_max=most("shared"), not_fitting=sum(not r["fits"] for r in ok), occ_min=least("occupancy"),
                occ_max=most("occupancy"), mma=mma_kinds(ok))


def config_table(rows: list[dict]) -> list[str]:
    lines = ["| kernel | arch | config (blocks, warps, stages) | compiles | spilling | STL max | STL total | "
             "registers | stack max | shared KiB max | MMA | occupancy |", "|---" * 12 + "|"]
    for (kernel, arch, tile), group in summarise(rows, lambda r: (r["kernel"], r["arch"], tile_of(r))):
        s = _stats(group)
        errors = f" ({s['errors']} errors)" if s["errors"] else ""
        lines.append(f"| {kernel} | sm_{arch} | {tile} | {s['compiles']}{errors} | {s['spilling']} | {s['stl_max']} | "
                     f"{s['stl_total']} | {s['regs_min']}-{s['regs_max']} | {s['stack_max']} | "
                     f"{s['shared_max'] / 1024:.0f} | {s['mma']} | {s['occ_min']:.2f}-{s['occ_max']:.2f} |")
    return lines


def combination_table(rows: list[dict]) -> list[str]:
    archs = sorted({r["arch"] for r in rows})
    lines = ["| kernel | combination | " + " | ".join(f"sm_{a}: STL max, regs max" for a in archs) + " |",
             "|---|---|" + "---|" * len(archs)]
    for (kernel, flags), group in summarise(rows, lambda r: (r["kernel"], flags_of(r))):
        cells = []
        for arch in archs:
            s = _stats([r for r in group if r["arch"] == arch])
            cells.append(f"{s['stl_max']}, {s['regs_max']}" + (f" ({s['errors']} errors)" if s["errors"] else ""))
        lines.append(f"| {kernel} | {flags} | " + " | ".join(cells) + " |")
    return lines


def totals_table(rows: list[dict]) -> list[str]:
    lines = ["| family | kernel | arch | compiles | errors | spilling | STL total | registers | MMA | occupancy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (family, kernel, arch), group in summarise(rows, lambda r: (r["family"], r["kernel"], r["arch"])):
        s = _stats(group)
        lines.append(f"| {family} | {kernel} | sm_{arch} | {s['compiles']} | {s['errors']} | {s['spilling']} | "
                     f"{s['stl_total']} | {s['regs_min']}-{s['regs_max']} | {s['mma']} | "
                     f"{s['occ_min']:.2f}-{s['occ_max']:.2f} |")
    return lines


def comparison_table(before: dict, after: dict) -> list[str]:
    """Per kernel and architecture, before and after, on the shapes and architectures both audits compiled:
    compiles, how many spill, the most and all spill stores, the register range."""
    shapes = {p["name"] for p in before["problems"]} & {p["name"] for p in after["problems"]}
    archs = set(before["archs"]) & set(after["archs"])

    def common(report):
        return [r for r in report["rows"] if r["family"] == "ours" and r["arch"] in archs
                and any(label["problem"] in shapes for label in r["labels"])]

    old, new = common(before), common(after)
    lines = [f"On the {len(shapes)} shapes both audits compiled. Before: {before['kernels']}; after: "
             f"{after['kernels']}.", "",
             "| kernel | arch | before: spilling / compiles | before: STL max, total | before: registers | "
             "after: spilling / compiles | after: STL max, total | after: registers |", "|---" * 8 + "|"]
    for kernel, arch in sorted({(r["kernel"], r["arch"]) for r in old + new}):
        cells = []
        for rows in (old, new):
            s = _stats([r for r in rows if r["kernel"] == kernel and r["arch"] == arch])
            cells += [f"{s['spilling']} / {s['compiles']}", f"{s['stl_max']}, {s['stl_total']}",
                      f"{s['regs_min']}-{s['regs_max']}"]
        lines.append(f"| {kernel} | sm_{arch} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------------------ roofline
def matmuls_of(problem: dict, split: int, dgate_tile: int = 32) -> list[dict]:
    """The three matmuls of one CVMM layer (forward; backward d inputs with d gates; backward d weight), each with
    its sizes in the kernel's terms and the HBM bytes the dispatcher's atomic mode moves at least: bf16 operands read
    once, fp32 gates, int64 slot indices; an fp32 atomics buffer costs its zero fill (4 bytes an element), the
    atomics' result (4) and the conversion pass (4 read, 2 written); d gates' fp32 partial sums (one row per column
    tile of `dgate_tile`, the row kernel's narrowest BLOCK_N) their zero fill, write and read; split weight-gradient
    partials their fp32 write and read back, then the sum (4 written, 4 read, 2 written)."""
    n, rows, slots, g = problem["tokens"], problem["rows"], problem["slots"], problem["experts"]
    m, d_in, d_out = n * slots, problem["d_in"], problem["d_out"]
    groups = problem["out_groups"] if problem["gated"] else slots
    gates, indices = (4 * m if problem["gated"] else 0), 16 * m
    inputs, grads, weights = 2 * n * rows * d_in, 2 * n * groups * d_out, 2 * g * d_in * d_out

    def result(count: int, shared: bool) -> int:
        return count * (4 + 4 + 4 + 2 if shared else 2)

    dgates = 3 * 4 * math.ceil(d_in / dgate_tile) * m if problem["gated"] else 0

    dense = 2 * (m * d_in + d_in * d_out + m * d_out)  # a dense layer's matmuls with m rows touch these once
    matmuls = [
        dict(matmul="forward", kernel="_gathered_expert_matmul", m=m, k=d_in, n=d_out,
             hbm=inputs + weights + gates + indices + result(n * groups * d_out, slots // groups > 1)),
        dict(matmul="d inputs", kernel="_gathered_expert_matmul", m=m, k=d_out, n=d_in,
             hbm=grads + weights + gates + indices + (inputs + dgates if problem["gated"] else 0)
             + result(n * rows * d_in, slots // rows > 1)),
        dict(matmul="d weight", kernel="_expert_weight_grad", m=g * d_in, k=m // g, n=d_out,
             hbm=inputs + grads + gates + indices // 2 + (weights * (4 * split + 5) if split > 1 else weights)),
    ]
    return [dict(matmul, dense_bytes=dense, split=split) for matmul in matmuls]


def issued_work(matmul: dict, blocks: dict, problem: dict) -> tuple[int, int]:
    """(FLOPs the tiles issue, bytes the tiles read) for one matmul at one tile: whole blocks (padded columns and
    reduction steps; each share of a split weight gradient padded on its own) and, in the row kernel, one pass per
    expert of every block that spans an expert boundary."""
    def padded(size: int, block: int) -> int:
        return math.ceil(size / block) * block

    g = problem["experts"]
    if matmul["kernel"] == "_gathered_expert_matmul":
        bm, bn, bk = blocks["BLOCK_M"], blocks["BLOCK_N"], blocks["BLOCK_K"]
        passes = math.ceil(matmul["m"] / bm) + g - 1
        column_tiles = math.ceil(matmul["n"] / bn)
        return (2 * passes * bm * column_tiles * bn * padded(matmul["k"], bk),
                2 * passes * column_tiles * (bm + bn) * padded(matmul["k"], bk))
    bk, bn, bm = blocks["BLOCK_K"], blocks["BLOCK_N"], blocks["BLOCK_M"]
    programs = g * math.ceil(problem["d_in"] / bk) * math.ceil(matmul["n"] / bn)
    depth = matmul["split"] * padded(math.ceil(matmul["k"] / matmul["split"]), bm)
    return 2 * programs * bk * bn * depth, 2 * programs * (bk + bn) * depth


def matmul_of_row(row: dict) -> str | None:
    """Which of a layer's matmuls a compile of our kernels is: the weight gradient, or the row kernel with W as
    stored (unit column stride: the forward) or transposed (backward d inputs)."""
    if row["kernel"] == "_expert_weight_grad":
        return "d weight"
    if row["kernel"] == "_gathered_expert_matmul":
        return "forward" if row["signature"].get("stride_wn") == "constexpr" else "d inputs"
    return None


def clean_tiles(rows: list[dict], problem: str, matmul: str) -> list[dict]:
    """One row for each config that compiles without a spill store for every sm_90 bf16 launch (atomic mode) the
    dispatcher makes for `matmul` of `problem`: the tiles the prediction may use."""
    launches = [r for r in rows if r["family"] == "ours" and r["arch"] == 90 and matmul_of_row(r) == matmul
                and any(label["problem"] == problem and label["dtype"] == "bf16" and not label["deterministic"]
                        for label in r["labels"])]
    by_tile = collections.defaultdict(list)
    for row in launches:
        by_tile[tile_of(row)].append(row)
    return [group[0] for group in by_tile.values() if all("error" not in r and r["spill_stores"] == 0 for r in group)]


def roofline(problems: list[dict], rows: list[dict], split_of) -> tuple[list[dict], list[str]]:
    """A prediction for an H100 SXM from its published dense bf16 throughput and HBM bandwidth: for each paper shape
    and matmul, at the tile that predicts best among those that compile for that launch on sm_90 in bf16 without a
    spill, the time bound max(issued FLOPs / peak, HBM bytes / bandwidth) against the same bound for a dense matmul
    of the same useful FLOPs ([tokens x slots, d_in] x [d_in, d_out], every byte read once, no padding)."""
    peak, bandwidth = H100_SXM["bf16_dense_tflops"] * 1e12, H100_SXM["hbm_tb_per_s"] * 1e12
    dgate_tile = min((r["config"]["constants"]["BLOCK_N"] for r in rows
                      if r["kernel"] == "_gathered_expert_matmul"), default=32)
    results, missing = [], []
    for problem in problems:
        for matmul in matmuls_of(problem, split_of(problem), dgate_tile):
            flops = 2 * matmul["m"] * matmul["k"] * matmul["n"]
            dense_time = max(flops / peak, matmul["dense_bytes"] / bandwidth)
            best = None
            for row in clean_tiles(rows, problem["name"], matmul["matmul"]):
                issued, tile_bytes = issued_work(matmul, row["config"]["constants"], problem)
                time_bound = max(issued / peak, matmul["hbm"] / bandwidth)
                candidate = dict(problem=problem["name"], matmul=matmul["matmul"], tile=tile_of(row), flops=flops,
                                 issued_flops=issued, mma_efficiency=flops / issued, tile_bytes=tile_bytes,
                                 tile_intensity=issued / tile_bytes, hbm_bytes=matmul["hbm"],
                                 hbm_intensity=flops / matmul["hbm"],
                                 bound="compute" if issued / peak >= matmul["hbm"] / bandwidth else "memory",
                                 time_us=time_bound * 1e6, dense_time_us=dense_time * 1e6,
                                 fraction_of_dense=dense_time / time_bound, sass_mma_per_k_step=sass_mma_check(row))
                if best is None or candidate["fraction_of_dense"] > best["fraction_of_dense"]:
                    best = candidate
            if best is not None:
                results.append(best)
            else:
                missing.append((problem["name"], matmul["matmul"]))
    if not results:
        return [], ["No config of our kernels compiles for sm_90 in bf16 without spilling: no prediction."]
    reuse = sorted(r["tile_intensity"] for r in results)
    lines = [f"H100 SXM, NVIDIA's published figures: {H100_SXM['bf16_dense_tflops']:.1f} TFLOP/s dense bf16 tensor "
             f"core, {H100_SXM['hbm_tb_per_s']} TB/s HBM3 (ridge point {peak / bandwidth:.0f} FLOP/byte). This is a "
             "prediction from the compiled tiles and those two numbers, not a measurement: it assumes the tensor "
             "cores run at peak whenever HBM allows, and leaves out L2 bandwidth (NVIDIA publishes none; at peak, "
             f"tiles of {reuse[-1]:.0f} down to {reuse[0]:.0f} FLOP/byte would pull {peak / reuse[-1] / 1e12:.0f} "
             f"to {peak / reuse[0] / 1e12:.0f} TB/s from L2), latency the pipeline does not hide, the atomics' "
             "read-modify-writes, launch overhead and the host-side sums. The dense comparator is bench_cvmm's: one "
             "[tokens x slots, d_in] x [d_in, d_out] matmul of the same FLOPs, whose left operand is larger than "
             "the inputs CVMM reads (slots share input rows), so a fraction above 1 is possible.", "",
             "Forward + backward per shape (the three matmuls; the issue's target is >= 0.8 of dense):", "",
             "| shape | predicted us | dense us | fraction of dense |", "|---|---|---|---|"]
    for name in dict.fromkeys(r["problem"] for r in results):
        mine = [r for r in results if r["problem"] == name]
        lacking = [matmul for problem, matmul in missing if problem == name]
        if lacking:
            lines.append(f"| {name} | no clean tile for {', '.join(lacking)} | | |")
            continue
        ours, dense = sum(r["time_us"] for r in mine), sum(r["dense_time_us"] for r in mine)
        lines.append(f"| {name} | {ours:.1f} | {dense:.1f} | {dense / ours:.2f} |")
    if missing:
        lines += ["", f"{len(missing)} of {len(missing) + len(results)} matmuls have no tile that compiles for all "
                  "their sm_90 bf16 launches without a spill: " + "; ".join(f"{p} {m}" for p, m in missing) + "."]
    lines += ["", "Per matmul. Useful GFLOP: 2 x tokens x slots x d_in x d_out. MMA efficiency: useful / issued "
              "(whole tiles, padded columns and reduction steps, one pass per expert for blocks at an expert "
              "boundary). Tile FLOP/byte: issued FLOPs per byte the tiles load (the reuse a tile gives; L2 serves the "
              "repeats). HBM FLOP/byte: useful FLOPs per compulsory HBM byte. SASS check: the MMA instructions in the "
              "compiled loop body do the tile's work.", "",
              "| shape | matmul | best clean tile | useful GFLOP | MMA efficiency | tile FLOP/byte | HBM FLOP/byte | "
              "bound | predicted us | dense us | fraction of dense | SASS check |", "|---" * 12 + "|"]
    for r in results:
        lines.append(f"| {r['problem']} | {r['matmul']} | {r['tile']} | {r['flops'] / 1e9:.2f} | "
                     f"{r['mma_efficiency']:.2f} | {r['tile_intensity']:.0f} | {r['hbm_intensity']:.0f} | "
                     f"{r['bound']} | {r['time_us']:.1f} | {r['dense_time_us']:.1f} | {r['fraction_of_dense']:.2f} | "
                     f"{r['sass_mma_per_k_step']} |")
    return results, lines


WGMMA_SHAPE = re.compile(r"^(?:HGMMA|UTCHMMA|UTCQMMA)\.(\d+)x(\d+)x(\d+)")
MMA_SYNC_SHAPES = {"16816": (16, 8, 16), "1688": (16, 8, 8), "1684": (16, 8, 4), "884": (8, 8, 4)}


def reduction_block(row: dict) -> str:
    """The config's block size along the reduction: slots in the weight gradient, K elsewhere."""
    if row["kernel"] == "_expert_weight_grad":
        return "BLOCK_M"
    return "BLOCK_SIZE_K" if "BLOCK_SIZE_K" in row["config"]["constants"] else "BLOCK_K"


def reduction_step(row: dict) -> int:
    """How deep one loop step of the compiled kernel reduces: our kernels' K_STEP / M_STEP rule (the block in
    16-bit elements' worth, at least 16; 16 for scalar loads or FMA dots), the whole block for the others."""
    block, constants = row["config"]["constants"][reduction_block(row)], row["constants"]
    if "VECTOR_LOADS" not in constants:
        return block
    if not constants["VECTOR_LOADS"] or constants["PRECISION"] == "ieee":
        return 16
    first_pointer = next(v for v in row["signature"].values() if v.startswith("*"))
    return max(16, block * 16 // (32 if first_pointer == "*fp32" else 16))


def sass_mma_check(row: dict) -> str:
    """The MMA work in the SASS (instruction shape x count x the warpgroups or warps that run it) against the
    tile's output block x reduction step: "ok" when they agree, so the loop body issues exactly the tile's work."""
    blocks = row["config"]["constants"]
    output = math.prod(v for k, v in blocks.items() if k.startswith("BLOCK") and k != reduction_block(row))
    tile = output * reduction_step(row)
    warps = row["config"]["options"]["num_warps"]
    work = 0
    for kind, count in row.get("mma", {}).items():
        wgmma = WGMMA_SHAPE.match(kind)
        sync = MMA_SYNC_SHAPES.get(kind.split(".")[1]) if kind.startswith("HMMA.") else None
        if wgmma:  # one warpgroup (4 warps) issues it
            work += count * math.prod(int(v) for v in wgmma.groups()) * max(1, warps // 4)
        elif sync:  # each warp issues it
            work += count * math.prod(sync) * warps
        else:
            return "shape not in the opcode"
    if not work:
        return "no MMA"
    return "ok" if work == tile else f"{work / tile:.2f} x tile"


# ------------------------------------------------------------------------------------------------ main
def markdown(report: dict, compare: dict | None, roofline_lines: list[str]) -> str:
    rows = report["rows"]
    ours = [r for r in rows if r["family"] == "ours"]
    targets = ", ".join(f"sm_{a} ({ARCHS[a]['gpu']})" for a in report["archs"])
    authors = "; the authors' cvmm_kernel (their switchhead/cvmm.py) as a control" if report["authors_cvmm"] else ""
    lines = [f"# GPU compile audit: {report['name']}", "",
             f"Compiled on {report['machine']['device']} (host {report['machine']['machine']}), no GPU; triton "
             f"{report['triton']} and the ptxas in its wheel ({report['ptxas']}); kernels from {report['kernels']}"
             f"{authors}; targets {targets}{'; quick subset' if report['quick'] else ''}. Every launch the "
             f"dispatcher makes on {len(report['problems'])} shapes in every dtype and mode ({report['units']} "
             "distinct compilations) x every autotune config x architecture. STL/LDL: spill stores/loads in the "
             "SASS; occupancy: resident warps / 64 that registers and shared memory allow.", "", "## Totals", ""]
    lines += totals_table(rows)
    lines += ["", "## Our kernels by config", ""] + config_table(ours)
    lines += ["", "## Our kernels by combination (worst over configs and shapes)", ""] + combination_table(ours)
    controls = [r for r in rows if r["family"] != "ours"]
    if controls:
        lines += ["", "## Controls by config", ""] + config_table(controls)
    if compare is not None:
        lines += ["", "## Before and after", ""] + comparison_table(compare, report)
    if roofline_lines:
        lines += ["", "## Roofline prediction (H100 SXM, bf16)", ""] + roofline_lines
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "## Compile errors", ""] + [f"- {r['kernel']} sm_{r['arch']} {tile_of(r)}: {r['error']}"
                                                   for r in errors[:40]]
    return "\n".join(lines) + "\n"


def tool_version(tool: str) -> str:
    output = subprocess.run([str(BIN / tool), "--version"], capture_output=True, text=True).stdout.strip()
    return output.splitlines()[-1] if output else f"{tool} (version unknown)"


def write_report(report: dict, compare: dict | None, roofline_lines: list[str], folder: Path) -> None:
    """The Markdown of `report` (its JSON is written already) into `folder`, and on stdout."""
    path = folder / f"{report['name']}.md"
    text = markdown(report, compare, roofline_lines)
    path.write_text(text)
    print(text)
    print(f"wrote {path.with_suffix('.json')} and {path.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a representative subset on sm_90: the first and last "
                        "config of each kernel, every flag in at least one dtype")
    parser.add_argument("--archs", default=None, help="comma-separated compute capabilities (default: 80,90,100; "
                        "quick: 90)")
    parser.add_argument("--kernels", type=Path, default=None,
                        help="the cvmm_triton.py to audit (default: this checkout's kernels/cvmm_triton.py)")
    parser.add_argument("--authors-cvmm", type=Path, default=None,
                        help="path of the authors' switchhead/cvmm.py, to audit their cvmm_kernel beside ours")
    parser.add_argument("--only", default="", help="audit only the shapes whose name contains one of these "
                        "comma-separated texts (e.g. 47m,odd: the six uses at the 47M sizes and the odd shape)")
    parser.add_argument("--compare", type=Path, default=None, help="an earlier audit's JSON, shown beside this one "
                        "(on the shapes and architectures both audited)")
    parser.add_argument("--render", type=Path, default=None, help="compile nothing: write the Markdown of this "
                        "earlier audit's JSON again (with --compare: beside that one)")
    parser.add_argument("--name", default=None, help="result file name (default: gpu_audit, gpu_audit_quick)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    args = parser.parse_args(argv)
    kernels_path = (args.kernels or REPO / "kernels" / "cvmm_triton.py").resolve()
    for option, path in (("--kernels", args.kernels), ("--authors-cvmm", args.authors_cvmm),
                         ("--compare", args.compare), ("--render", args.render)):
        if path is not None and not path.is_file():
            print(f"gpu_audit: error: {option} {path} is not a file", file=sys.stderr)
            return 2
    archs = [int(a) for a in (args.archs or ("90" if args.quick else "80,90,100")).split(",")]
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        print(f"gpu_audit: error: --archs {unknown} not among {sorted(ARCHS)}", file=sys.stderr)
        return 2
    name = args.name or ("gpu_audit_quick" if args.quick else "gpu_audit")
    log = print

    module = load_module(str(kernels_path), "switchhead_audited_cvmm_triton")
    if getattr(module, "INTERPRET", False):
        print("gpu_audit: error: the kernels were loaded for Triton's interpreter; unset TRITON_INTERPRET",
              file=sys.stderr)
        return 2
    compare = json.loads(args.compare.read_text()) if args.compare else None

    def h100_split(problem: dict) -> int:  # the weight gradient's split on an H100's 132 multiprocessors
        if not hasattr(module, "_weight_grad_split"):
            return 1
        with recording(module, (), [], {}, ARCHS[90]["multiprocessors"]):
            return module._weight_grad_split(torch.device("meta"), problem["experts"], problem["d_in"],
                                             problem["d_out"])

    if args.render is not None:
        report = json.loads(args.render.read_text())
        report["arch_limits"] = {int(a): limits for a, limits in report["arch_limits"].items()}
        paper_names = {p["name"] for p in paper_problems()}
        paper = [p for p in report["problems"] if p["name"] in paper_names]
        _, roofline_lines = (roofline(paper, report["rows"], h100_split) if 90 in report["archs"]
                             and not report["quick"] else ([], []))
        write_report(report, compare, roofline_lines, args.render.parent)
        return 0

    wanted = [text for text in args.only.split(",") if text] or [""]
    paper = [p for p in paper_problems() if any(text in p["name"] for text in wanted)]
    problems = paper + [p for p in off_paper_problems() if any(text in p["name"] for text in wanted)]
    if args.quick and args.only:
        print("gpu_audit: error: --quick has its own shapes; leave out --only", file=sys.stderr)
        return 2
    if not problems:
        print(f"gpu_audit: error: --only {args.only!r} matches no shape", file=sys.stderr)
        return 2
    tasks = []
    units_count = 0
    for arch in archs:
        units = audit_launches(module, problems, ARCHS[arch]["multiprocessors"], args.quick)
        units_count = max(units_count, len(units))
        source = dict(kind="module", path=str(kernels_path), module_name="switchhead_audited_cvmm_triton")
        for unit in units:
            for config in configs_of(getattr(module, unit["kernel"]), args.quick, unit["constants"]):
                tasks.append(dict(unit=unit, config=config, arch=arch, family="ours",
                                  source=dict(source, kernel=unit["kernel"])))
        for unit in control_units(args.quick):
            for config in configs_of(module._gathered_expert_matmul, args.quick):
                tasks.append(dict(unit=unit, config=config, arch=arch, family="control: tiled matmul",
                                  source=dict(kind="control")))
        if args.authors_cvmm is not None:
            authors = load_module(str(args.authors_cvmm.resolve()), "switchhead_audit_authors_cvmm")
            if not (hasattr(authors, "cvmm_kernel") and hasattr(authors, "cvmm_triton")):
                print(f"gpu_audit: error: {args.authors_cvmm} has no cvmm_kernel / cvmm_triton: expected the "
                      "authors' switchhead/cvmm.py", file=sys.stderr)
                return 2
            authors_problems = [p for p in problems if not p.get("strided")]
            if args.quick:
                authors_problems = [p for p in authors_problems if p["name"] == QUICK_CASES[0][0]]
            for unit in authors_launches(authors, authors_problems):
                if args.quick and unit["labels"][0]["dtype"] != "bf16":
                    continue
                for config in configs_of(authors.cvmm_kernel, args.quick):
                    tasks.append(dict(unit=unit, config=config, arch=arch, family="control: authors' cvmm_kernel",
                                      source=dict(kind="module", path=str(args.authors_cvmm.resolve()),
                                                  module_name="switchhead_audit_authors_cvmm",
                                                  kernel="cvmm_kernel")))
    log(f"gpu_audit: {len(tasks)} compilations ({units_count} distinct launches of our kernels per architecture) "
        f"for {', '.join(f'sm_{a}' for a in archs)} with {args.jobs} processes")
    rows = run_tasks(tasks, args.jobs, log)

    from machine import describe

    predictions, roofline_lines = roofline(paper, rows, h100_split) if 90 in archs and not args.quick else ([], [])
    report = dict(name=name, machine=describe(torch.device("cpu")), triton=triton.__version__,
                  ptxas=tool_version("ptxas"), cuobjdump=tool_version("cuobjdump"),
                  kernels=str(kernels_path.relative_to(REPO)) if kernels_path.is_relative_to(REPO)
                  else kernels_path.name, authors_cvmm=str(args.authors_cvmm) if args.authors_cvmm else None,
                  archs=archs, arch_limits={a: ARCHS[a] for a in archs}, quick=args.quick, problems=problems,
                  units=units_count, h100_sxm=H100_SXM, roofline=predictions, rows=rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    write_report(report, compare, roofline_lines, args.out_dir)
    ours = [r for r in rows if r["family"] == "ours"]
    failed = [r for r in ours if "error" in r or r["spill_stores"] > 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
