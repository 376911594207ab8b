"""The compile check (scripts/gpu/gpu_audit.py): the CVMM kernels compiled for a Hopper GPU (sm_90) with Triton's
compiler and the ptxas in its wheel, no GPU needed; the quick subset must compile with no register spill.

The full check (every launch x config x sm_80 / sm_90 / sm_100) is the script run without --quick; here a
representative subset holds the line: both kernels, every flag (gates, atomic or stored reduction, the gate gradient,
W or W^T, fp32 IEEE and TF32, fp16, bf16, odd sizes), the first and last config of each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "gpu"))  # gpu_audit.py, a tool script

import gpu_audit  # noqa: E402

pytestmark = pytest.mark.integration  # compiles every kernel for sm_80/90/100


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audit")
    status = gpu_audit.main(["--quick", "--out-dir", str(folder), "--jobs", "2"])
    report = json.loads((folder / "gpu_audit_quick.json").read_text())
    return status, report, (folder / "gpu_audit_quick.md").read_text()


def test_quick_audit_compiles_for_sm90_with_no_spill_store(quick_report):
    status, report, markdown = quick_report
    ours = report["rows"]
    assert report["archs"] == [90] and ours
    assert [row for row in ours if "error" in row] == []
    spilled = [(row["kernel"], row["constants"], gpu_audit.tile_of(row), row["spill_stores"]) for row in ours
               if row["spill_stores"]]
    assert spilled == []
    assert all(row["fits"] and row["registers"] > 0 for row in ours)  # within the 227 KiB a block may have
    assert status == 0 and gpu_audit.failures(ours) == []
    assert f"{len(ours)} compilations, 0 failing" in markdown and "| _expert_weight_grad | sm_90 |" in markdown


def test_quick_audit_covers_every_flag_of_both_kernels(quick_report):
    _, report, _ = quick_report
    ours = report["rows"]
    rows = [r for r in ours if r["kernel"] == "_gathered_expert_matmul"]
    weights = [r for r in ours if r["kernel"] == "_expert_weight_grad"]
    assert {(r["constants"]["HAS_GATES"], r["constants"]["ATOMIC"], r["constants"]["COMPUTE_DGATE"]) for r in rows} \
        >= {(True, True, False), (True, True, True), (False, False, False), (True, False, True), (False, True, False)}
    assert {r["constants"]["W_N_CONTIGUOUS"] for r in rows} == {True, False}
    assert {r["constants"]["VECTOR_LOADS"] for r in rows} == {True, False}
    assert {r["constants"]["HAS_GATES"] for r in weights} == {True, False}
    dtypes = {(label["dtype"], label["precision"]) for r in ours for label in r["labels"]}
    assert dtypes == {("bf16", "tf32/none"), ("fp16", "tf32/none"), ("fp32", "tf32/none"), ("fp32", "ieee")}


def test_every_launch_the_dispatcher_makes_is_recorded_with_its_specialisation():
    module = gpu_audit.load_module(str(gpu_audit.KERNELS))
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
    module = gpu_audit.load_module(str(gpu_audit.KERNELS))
    tensor_core = gpu_audit.configs_of(module._gathered_expert_matmul, False, dict(PRECISION="tf32"))
    ieee = gpu_audit.configs_of(module._gathered_expert_matmul, False, dict(PRECISION="ieee"))
    assert len(tensor_core) == len(module._gathered_expert_matmul.configs)
    assert ieee and all(c["constants"]["BLOCK_N"] <= 32 for c in ieee) and len(ieee) < len(tensor_core)
    weights = gpu_audit.configs_of(module._expert_weight_grad, False, dict(PRECISION="ieee"))
    assert weights and all(c["constants"]["BLOCK_N"] <= 32 and c["constants"]["BLOCK_K"] <= 64 for c in weights)


def test_only_takes_comma_separated_shape_names_and_refuses_one_that_matches_nothing(tmp_path, capsys):
    assert gpu_audit.main(["--only", "no-such-shape,nor-this", "--out-dir", str(tmp_path)]) == 2
    assert "matches no shape" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_read_sass_counts_spill_stores_and_loads():
    listing = "\n".join([
        "        /*0040*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;",
        "        /*0050*/              @!P0 STL [R1+0x8], R2 ;",
        "        /*0060*/                   STL.64 [R1], R4 ;",
        "        /*0070*/                   LDL R2, [R1+0x8] ;",
        "        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;",
    ])
    assert gpu_audit.read_sass(listing) == dict(spill_stores=2, spill_loads=1)


def test_a_spill_an_error_or_too_much_shared_memory_fails_the_check():
    clean = dict(spill_stores=0, fits=True)
    rows = [clean, dict(clean, spill_stores=3), dict(clean, fits=False), dict(error="CompilationError: x")]
    assert gpu_audit.failures(rows) == rows[1:]
