"""The compile audit (scripts/gpu/gpu_audit.py, issue #30): the CVMM kernels compiled for a Hopper GPU (sm_90) with
Triton's compiler and the ptxas in its wheel, no GPU needed; the quick subset must compile with no register spill.

The full audit (every launch x config x sm_80 / sm_90 / sm_100) is the script run without --quick; here a representative
subset holds the line: both kernels, every flag (gates, atomic or stored reduction, the gate gradient, W or W^T,
fp32 IEEE and TF32, fp16, bf16, odd sizes), the first and last config of each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))  # gpu_audit.py, a tool script

import gpu_audit  # noqa: E402

KERNELS = Path(__file__).resolve().parents[2] / "kernels" / "cvmm_triton.py"

# A stand-in for the authors' switchhead/cvmm.py with the parts the audit uses: an autotuned `cvmm_kernel` and the
# launcher `cvmm_triton(x, sel_index, sel, keys, out_dtype, out_index)` that calls it (rows gathered by sel_index,
# the expert of the block's first row, outputs scattered by out_index).
AUTHORS_STAND_IN = '''
import torch
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3)],
                 key=["M", "N", "K"])
@triton.jit
def cvmm_kernel(x_ptr, w_ptr, out_ptr, index_ptr, sel_ptr, out_index_ptr, M, N, K, stride_xm, stride_we, stride_wk,
                stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.load(index_ptr + offs_m, mask=offs_m < M, other=0)
    expert = tl.load(sel_ptr + (pid // tiles_n) * BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=(k0 + offs_k)[None, :] < K,
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :],
                    mask=((k0 + offs_k)[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc += tl.dot(x, w)
    out_rows = tl.load(out_index_ptr + offs_m, mask=offs_m < M, other=0)
    tl.store(out_ptr + out_rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def cvmm_triton(x, sel_index, sel, keys, out_dtype, out_index):
    m = sel.numel()
    _, k, n = keys.shape
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    cvmm_kernel[grid](x, keys, out, sel_index, sel, out_index, m, n, k, x.stride(0), keys.stride(0), keys.stride(1),
                      out.stride(0))
    return out
'''


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audit")
    stand_in = folder / "cvmm.py"
    stand_in.write_text(AUTHORS_STAND_IN)
    status = gpu_audit.main(["--quick", "--out-dir", str(folder), "--authors-cvmm", str(stand_in), "--jobs", "2"])
    report = json.loads((folder / "gpu_audit_quick.json").read_text())
    return status, report, (folder / "gpu_audit_quick.md").read_text()


def _ours(report):
    return [row for row in report["rows"] if row["family"] == "ours"]


def test_quick_audit_compiles_for_sm90_with_no_spill_store(quick_report):
    status, report, _ = quick_report
    ours = _ours(report)
    assert report["archs"] == [90] and ours
    assert [row for row in ours if "error" in row] == []
    spilled = [(row["kernel"], gpu_audit.flags_of(row), gpu_audit.tile_of(row), row["spill_stores"]) for row in ours
               if row["spill_stores"]]
    assert spilled == []
    assert all(row["fits"] for row in ours)  # within the 227 KiB a block may have on an H100
    assert status == 0


def test_quick_audit_uses_warpgroup_mma_on_tensor_core_dtypes_and_fma_for_ieee(quick_report):
    _, report, _ = quick_report
    for row in _ours(report):
        ieee = row["constants"]["PRECISION"] == "ieee"
        kinds = {kind.split(".")[0] for kind in row["mma"]}
        assert (kinds == set() and row["ffma"] > 0) if ieee else kinds == {"HGMMA"}, (gpu_audit.flags_of(row), kinds)
        if not ieee:
            assert gpu_audit.sass_mma_check(row) == "ok"  # the loop body's MMAs do the tile's work


def test_quick_audit_covers_every_flag_of_both_kernels(quick_report):
    _, report, _ = quick_report
    ours = _ours(report)
    rows = [r for r in ours if r["kernel"] == "_gathered_expert_matmul"]
    weights = [r for r in ours if r["kernel"] == "_expert_weight_grad"]
    assert {(r["constants"]["HAS_GATES"], r["constants"]["ATOMIC"], r["constants"]["COMPUTE_DGATE"]) for r in rows} \
        >= {(True, True, False), (True, True, True), (False, False, False), (True, False, True), (False, True, False)}
    assert {r["constants"]["W_N_CONTIGUOUS"] for r in rows} == {True, False}
    assert {r["constants"]["VECTOR_LOADS"] for r in rows} == {True, False}
    assert {r["constants"]["HAS_GATES"] for r in weights} == {True, False}
    dtypes = {(label["dtype"], label["precision"]) for r in ours for label in r["labels"]}
    assert dtypes == {("bf16", "tf32/none"), ("fp16", "tf32/none"), ("fp32", "tf32/none"), ("fp32", "ieee")}


def test_quick_audit_compiles_the_controls_and_writes_markdown(quick_report):
    _, report, markdown = quick_report
    families = {row["family"] for row in report["rows"]}
    assert families == {"ours", "control: tiled matmul", "control: authors' cvmm_kernel"}
    authors = [row for row in report["rows"] if row["family"] == "control: authors' cvmm_kernel"]
    assert authors and all("error" not in row and "HGMMA" in "".join(row["mma"]) for row in authors)
    assert report["machine"]["machine"] and report["ptxas"]
    for heading in ("## Totals", "## Our kernels by config", "## Our kernels by combination", "## Controls"):
        assert heading in markdown


def test_every_launch_the_dispatcher_makes_is_recorded_with_its_specialisation():
    module = gpu_audit.load_module(str(KERNELS), "switchhead_audited_cvmm_triton")
    problems = gpu_audit.paper_problems() + gpu_audit.off_paper_problems()
    units = gpu_audit.audit_launches(module, problems, gpu_audit.ARCHS[90]["multiprocessors"], quick=False)
    rows = [u for u in units if u["kernel"] == "_gathered_expert_matmul"]
    weights = [u for u in units if u["kernel"] == "_expert_weight_grad"]
    flags = {(u["constants"]["HAS_GATES"], u["constants"]["ATOMIC"], u["constants"]["COMPUTE_DGATE"]) for u in rows}
    assert flags == {(g, a, d) for g in (True, False) for a in (True, False) for d in (False, g)}
    assert {u["constants"]["PRECISION"] for u in rows + weights} == {"ieee", "tf32"}
    assert {u["signature"]["a_ptr"] for u in rows} == {"*fp32", "*fp16", "*bf16"}
    assert {u["constants"]["ALIGN"] for u in rows} == {1, 4, 8}  # odd sizes, the 47M / 262M widths, aligned
    # the split weight gradient writes fp32 partial sums; the large expert grid writes the weight's dtype
    assert {u["signature"]["dw_ptr"] for u in weights} == {"*fp32", "*fp16", "*bf16"}
    # Triton's launcher turns an integer 1 into a constant and marks sizes divisible by 16
    value = [u for u in rows if any(label["problem"] == "c4-262m-switchhead-xl/value" for label in u["labels"])]
    assert all(u["signature"]["stride_ak"] == "constexpr" and u["constants"]["stride_ak"] == 1 for u in value
               if u["constants"]["W_N_CONTIGUOUS"])
    assert all("K" in u["divisible"] for u in value if u["constants"]["W_N_CONTIGUOUS"])  # d = 1024


def test_ieee_fp32_launches_get_only_the_narrow_tiles():
    module = gpu_audit.load_module(str(KERNELS), "switchhead_audited_cvmm_triton")
    tensor_core = gpu_audit.configs_of(module._gathered_expert_matmul, False, dict(PRECISION="tf32"))
    ieee = gpu_audit.configs_of(module._gathered_expert_matmul, False, dict(PRECISION="ieee"))
    assert len(tensor_core) == len(module._gathered_expert_matmul.configs)
    assert ieee and all(c["constants"]["BLOCK_N"] <= 32 for c in ieee) and len(ieee) < len(tensor_core)
    weights = gpu_audit.configs_of(module._expert_weight_grad, False, dict(PRECISION="ieee"))
    assert weights and all(c["constants"]["BLOCK_N"] <= 32 and c["constants"]["BLOCK_K"] <= 64 for c in weights)


def test_occupancy_follows_the_calculator_rules():
    # 255 registers round up to 256 a thread: 8 warps use 64K registers, one block per SM
    assert gpu_audit.occupancy(255, 0, 8, 90) == dict(blocks_per_sm=1, warps_per_sm=8, occupancy=0.125,
                                                      limited_by="registers")
    # 100 KiB (+1 KiB reserved) of shared memory: two blocks in an H100's 228 KiB, one in an A100's 164 KiB
    assert gpu_audit.occupancy(128, 100 * 1024, 4, 90)["blocks_per_sm"] == 2
    assert gpu_audit.occupancy(128, 100 * 1024, 4, 80)["limited_by"] == "shared"
    assert gpu_audit.occupancy(128, 100 * 1024, 4, 80)["blocks_per_sm"] == 1
    assert gpu_audit.occupancy(24, 0, 4, 90)["limited_by"] == "warps"  # 16 blocks of 4 warps fill the 64


def test_read_sass_counts_spills_mma_and_load_width():
    listing = "\n".join([
        "        /*0040*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;",
        "        /*0050*/              @!P0 STL [R1+0x8], R2 ;",
        "        /*0060*/                   STL.64 [R1], R4 ;",
        "        /*0070*/                   LDL R2, [R1+0x8] ;",
        "        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;",
        "        /*0090*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;",
        "        /*00a0*/                   FFMA R5, R6, R7, R5 ;",
        "        /*00b0*/                   LDG.E.U16 R9, desc[UR4][R10.64] ;",
    ])
    found = gpu_audit.read_sass(listing)
    assert found == dict(spill_stores=2, spill_loads=1, mma={"HGMMA.64x128x16.F32.BF16": 2}, ffma=1,
                         widest_global_load_bytes=16)
    row = dict(kernel="tiled_matmul", constants={}, mma=found["mma"],
               config=dict(constants=dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32), options=dict(num_warps=4)))
    assert gpu_audit.sass_mma_check(row) == "ok"  # 2 x 64x128x16 = the 64 x 128 x 32 tile


def test_missing_authors_file_exits_2(tmp_path, capsys):
    assert gpu_audit.main(["--quick", "--authors-cvmm", str(tmp_path / "nowhere.py")]) == 2
    assert "--authors-cvmm" in capsys.readouterr().err


def test_only_takes_comma_separated_shape_names_and_refuses_one_that_matches_nothing(tmp_path, capsys):
    assert gpu_audit.main(["--only", "no-such-shape,nor-this", "--out-dir", str(tmp_path)]) == 2
    assert "matches no shape" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_earlier_kernel_file_that_reads_the_multiprocessor_count_inline_gets_the_targets_count():
    # the kernels before issue #30 asked torch.cuda for the count inside _weight_grad_split; the audit (and its
    # "before" table) must size the weight gradient's split for the target GPU, not for the meta device's 4
    module = type(sys)("earlier_kernels")
    exec("import torch\n"
         "def _weight_grad_split(device, experts, d_in, d_out):\n"
         "    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 4\n"
         "    return sms * 1000 + experts\n", module.__dict__)
    with gpu_audit.recording(module, (), [], {}, gpu_audit.ARCHS[90]["multiprocessors"]):
        assert module._weight_grad_split(__import__("torch").device("meta"), 10, 412, 76) == 132010
    assert module._weight_grad_split(__import__("torch").device("meta"), 10, 412, 76) == 4010  # restored


def test_the_before_and_after_table_keeps_to_the_shapes_and_architectures_both_audits_compiled():
    def row(kernel, arch, problem, spills, registers):
        return dict(kernel=kernel, family="ours", arch=arch, labels=[dict(problem=problem)], spill_stores=spills,
                    registers=registers, stack=0, shared=0, fits=True, occupancy=0.25, mma={})

    before = dict(kernels="old.py", archs=[80, 90], problems=[dict(name="a")],
                  rows=[row("k", 90, "a", 100, 255), row("k", 80, "a", 50, 255)])
    after = dict(kernels="new.py", archs=[90, 100], problems=[dict(name="a"), dict(name="b")],
                 rows=[row("k", 90, "a", 0, 168), row("k", 90, "b", 7, 200), row("k", 100, "a", 0, 100)])
    lines = gpu_audit.comparison_table(before, after)
    assert lines[0].startswith("On the 1 shapes both audits compiled")
    body = [line for line in lines if line.startswith("| k ")]
    assert body == ["| k | sm_90 | 1 / 1 | 100, 100 | 255-255 | 0 / 1 | 0, 0 | 168-168 |"]


def test_the_roofline_counts_the_dense_comparators_bytes_once_per_matmul_and_pads_split_shares():
    problem = dict(name="p", tokens=1024, rows=1, slots=4, gated=True, out_groups=2, experts=8, heads=2, d_in=100,
                   d_out=64)
    matmuls = gpu_audit.matmuls_of(problem, split=3)
    m = 1024 * 4
    assert [mm["dense_bytes"] for mm in matmuls] == [2 * (m * 100 + 100 * 64 + m * 64)] * 3
    weight = matmuls[2]
    assert (weight["m"], weight["k"], weight["n"], weight["split"]) == (8 * 100, m // 8, 64, 3)
    # 512 slots an expert in 3 shares of 171, each padded to 176 (BLOCK_M 16): 528 deep, 2 x 64 x 64 columns/rows
    flops, tile_bytes = gpu_audit.issued_work(weight, dict(BLOCK_K=64, BLOCK_N=64, BLOCK_M=16), problem)
    programs = 8 * 2 * 1
    assert flops == 2 * programs * 64 * 64 * 528 and tile_bytes == 2 * programs * (64 + 64) * 528
    # no clean sm_90 bf16 row: no prediction rather than a table of nothing
    assert gpu_audit.roofline([problem], [], lambda p: 1) == ([], [
        "No config of our kernels compiles for sm_90 in bf16 without spilling: no prediction."])
