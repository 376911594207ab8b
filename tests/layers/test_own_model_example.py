"""examples/own_model.py, the worked example of docs/own-model.md: a torch.nn GPT with the drop-in layers trains on
WikiText-2 beside its dense twin, converts to a Transformers folder with identical logits, generates, and converts
back tensor for tensor. Its conversion half also runs in the fast tier, on an untrained model."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from helpers.data import require

import switchhead
from switchhead.conversion import ConversionError, config_fields_from_layers, state_dict_to_module

_PATH = Path(__file__).resolve().parents[2] / "examples" / "own_model.py"
_spec = importlib.util.spec_from_file_location("switchhead_own_model_example", _PATH)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


@pytest.mark.parametrize("kind", ["switchhead", "dense"])
def test_converts_both_ways_bit_exactly(kind):
    torch.manual_seed(0)
    model = example.build(kind, 97).eval()
    hf_model = example.to_transformers(model)
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(ids), hf_model(ids).logits)
    back = example.build(kind, 97)
    back.load_state_dict(state_dict_to_module(hf_model.state_dict(), hf_model.config, "blocks.{i}.attn.",
                                              example.RENAMES), strict=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name


def test_config_fields_from_layers_reads_the_sigma_moe_and_refuses_other_modules():
    fields = config_fields_from_layers(switchhead.SwitchHeadXL(64, 2, 4), switchhead.SigmaMoE(64, 8, 16, 2))
    assert fields["position_encoding"] == "xl" and fields["num_attention_experts"] == 4
    assert fields["mlp_type"] == "sigma_moe" and fields["num_mlp_experts_per_tok"] == 2
    with pytest.raises(ConversionError, match="SwitchHeadRope or SwitchHeadXL"):
        config_fields_from_layers(torch.nn.Linear(2, 2))


@pytest.mark.integration
def test_the_example_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHHEAD_DATA_DIR", str(require("wikitext-2", "tokenizers")))
    results = example.main(["--steps", "40", "--vocab", "1024", "--batch", "8", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(results))
    for kind in ("switchhead", "dense"):
        curve = results[kind]["train_loss"]
        assert curve[-1][1] < curve[0][1] - 1.0, curve  # it learns
    assert results["logits_max_difference"] == 0.0 and results["round_trip_bit_exact"]
    assert results["generated"]
