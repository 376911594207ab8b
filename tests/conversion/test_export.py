"""Export with a dynamic batch and sequence length: `torch.export` for every variant, ONNX files run by onnxruntime
(switchhead.conversion.export, `switchhead export`)."""

from __future__ import annotations

import sys

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main as cli_main
from switchhead.conversion.export import CHECK_SHAPES, check_onnx, export_program, to_onnx

PRESETS = ["tiny-switchhead", "tiny-switchall", "tiny-dense", "tiny-switchhead-xl", "tiny-dense-xl",
           "tiny-switchall+xl", "tiny-moeut"]  # MoEUT: the torch.export program the ONNX file is made from
SHAPES = [(1, 1), (1, 9), (2, 7), (4, 16), (3, 40)]  # the example is 2 x 8


def _model(preset: str) -> SwitchHeadForCausalLM:
    torch.manual_seed(0)
    name, _, xl = preset.partition("+")  # "+xl": the preset with Transformer-XL attention
    overrides = {"position_encoding": "xl"} if xl else {}
    return SwitchHeadForCausalLM(SwitchHeadConfig.from_preset(name, vocab_size=96, **overrides)).eval()


def _inputs(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, : length // 3] = 0  # a left-padded row
    return ids, mask


@pytest.mark.parametrize("preset", PRESETS)
def test_torch_export_with_dynamic_batch_and_sequence_equals_eager_at_every_shape(preset):
    model = _model(preset)
    program = export_program(model)
    symbols = {str(symbol) for symbol in program.range_constraints}
    assert len(symbols) == 2, symbols  # batch and sequence stay symbols: no size was fixed to the example's
    for batch, length in SHAPES:
        ids, mask = _inputs(batch, length)
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = program.module()(ids, mask)
        keep = mask.bool()  # padded positions' logits are arbitrary in any implementation
        torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-switchhead", "tiny-switchall", "tiny-dense", "tiny-dense-xl",
                                    "tiny-switchall+xl"])
def test_onnx_file_runs_in_onnxruntime_at_several_shapes_within_1e_4(preset, tmp_path):
    pytest.importorskip("onnxscript", reason="the test extra pins onnx, onnxscript and onnxruntime")
    model = _model(preset)
    path = to_onnx(model, str(tmp_path / "model.onnx"))
    differences = check_onnx(path, model, shapes=SHAPES)
    assert set(differences) == set(SHAPES)
    assert max(differences.values()) <= 1e-4, differences


def test_export_command_writes_a_checked_onnx_file_for_xl(tmp_path, capsys):
    """XL through the command line (`switchhead export --check`): the variant whose export failed on a view of the
    attention output."""
    pytest.importorskip("onnxscript", reason="the test extra pins onnx, onnxscript and onnxruntime")
    _model("tiny-switchhead-xl").save_pretrained(tmp_path / "model")
    assert cli_main(["export", str(tmp_path / "model"), str(tmp_path / "xl.onnx"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "largest logit difference" in out
    assert all(f"{batch}x{length}:" in out for batch, length in CHECK_SHAPES)
    # the file is refused as an existing output the second time
    assert cli_main(["export", str(tmp_path / "model"), str(tmp_path / "xl.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # refused before the model is loaded
    assert len(err) == 1 and err[0].startswith("switchhead export: error:") and "already exists" in err[0]


def test_export_command_bad_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    assert cli_main(["export", str(tmp_path / "nope"), str(tmp_path / "x.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("switchhead export: error:") and "config.json" in err[0]
    _model("tiny-dense").model.save_pretrained(tmp_path / "stack")  # a bare decoder stack has no logits
    assert cli_main(["export", str(tmp_path / "stack"), str(tmp_path / "x.onnx")]) == 2
    assert "no logits to export" in capsys.readouterr().err
    _model("tiny-dense").save_pretrained(tmp_path / "model")
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # as where it is not installed
    capsys.readouterr()
    assert cli_main(["export", str(tmp_path / "model"), str(tmp_path / "x.onnx")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not Transformers' bars
    assert len(errors) == 1 and errors[0].startswith("switchhead export: error:")
    assert "onnxscript" in errors[0] and "pip install" in errors[0]
    assert not (tmp_path / "x.onnx").exists()
