"""SwitchAll's sigma-MoE is a router `mlp.gate` and an experts module `mlp.experts` whose parameters are
`expert_keys` / `expert_values` (they were the MLP's own `keys` / `values`, names that torch parametrizations, and so
PEFT's `target_parameters`, cannot take). Checkpoints keep the names `mlp.keys` / `mlp.values` / `mlp.expert_selection.weight` (Transformers' conversion mapping,
registered by the model file): folders of every release load with identical logits, through `from_pretrained` (the
package's classes, a task head, the folder's own copy of the code) and `load_state_dict`; folders saved with
`save_original_format=False` (the parameters' names) load too.

The folders saved by a release before the rename are tests/fixtures/pre_redesign (run by
tests/conformance/test_pre_redesign_checkpoints.py, with the old code beside this package too).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils import parametrize
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from helpers.clean_venv import clean_venv, run_checked
from helpers.models import logits_of

# parameter name (under the MLP) -> checkpoint name
OLD_NAMES = {"experts.expert_keys": "keys", "experts.expert_values": "values", "gate.weight": "expert_selection.weight"}
IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def _model(preset: str = "tiny-switchall") -> SwitchHeadForCausalLM:
    torch.manual_seed(0)
    name, _, xl = preset.partition("+")
    config = SwitchHeadConfig.from_preset(name, vocab_size=96, **({"position_encoding": "xl"} if xl else {}))
    return SwitchHeadForCausalLM(config).eval()


def _old_names(key: str) -> str:
    prefix, mlp, name = key.partition(".mlp.")
    return f"{prefix}.mlp.{OLD_NAMES[name]}" if mlp and name in OLD_NAMES else key


def _save_under_old_names(model, folder) -> None:
    """`save_pretrained`, which writes the sigma-MoE tensors under the checkpoint names every release wrote."""
    model.save_pretrained(folder)
    keys = load_file(os.path.join(folder, "model.safetensors")).keys()
    assert {"model.layers.0.mlp.keys", "model.layers.0.mlp.expert_selection.weight"} <= set(keys)
    assert not any("expert_keys" in key or ".gate." in key for key in keys)


@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-switchall+xl"])
def test_folder_under_old_names_loads_with_identical_logits(preset, tmp_path):
    model = _model(preset)
    _save_under_old_names(model, tmp_path / "old")
    for loader in (SwitchHeadForCausalLM, AutoModelForCausalLM):
        reloaded, info = loader.from_pretrained(tmp_path / "old", output_loading_info=True)
        assert not any(info.values()), info
        assert torch.equal(logits_of(reloaded, IDS), logits_of(model, IDS))
    # a task head takes the body from the same folder
    classifier, info = AutoModelForSequenceClassification.from_pretrained(tmp_path / "old", num_labels=2,
                                                                          output_loading_info=True)
    assert set(info["missing_keys"]) == {"score.weight"}
    assert torch.equal(classifier.model.layers[1].mlp.experts.expert_values,
                       model.model.layers[1].mlp.experts.expert_values)


def test_folder_under_todays_names_loads(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "today", save_original_format=False)
    assert "model.layers.0.mlp.experts.expert_keys" in load_file(tmp_path / "today" / "model.safetensors")
    loaded, info = SwitchHeadForCausalLM.from_pretrained(tmp_path / "today", output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(logits_of(loaded, IDS), logits_of(model, IDS))
    loaded.save_pretrained(tmp_path / "again")  # Transformers saves a loaded model in the format it was loaded from
    assert "model.layers.0.mlp.experts.expert_keys" in load_file(tmp_path / "again" / "model.safetensors")
    assert torch.equal(logits_of(SwitchHeadForCausalLM.from_pretrained(tmp_path / "again"), IDS), logits_of(model, IDS))


def test_load_state_dict_takes_old_names(tmp_path):
    model = _model()
    old = {_old_names(key): tensor for key, tensor in model.state_dict().items()}
    assert "model.layers.0.mlp.keys" in old
    fresh = _model("tiny-switchall")
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.zero_()
    assert fresh.load_state_dict(old, strict=True) is not None  # no missing or unexpected key
    assert torch.equal(logits_of(fresh, IDS), logits_of(model, IDS))
    # the caller's state dict is left as given (the renaming works on a copy)
    assert "model.layers.0.mlp.keys" in old and "model.layers.0.mlp.experts.expert_keys" not in old
    # the old and today's name of one tensor with different values: which one is meant cannot be told
    both = {**model.state_dict(), "model.layers.0.mlp.keys": torch.ones_like(old["model.layers.0.mlp.keys"])}
    with pytest.raises(ValueError, match="which one is meant"):
        fresh.load_state_dict(both)


def test_sigma_moe_experts_take_a_torch_parametrization():
    """What PEFT's `target_parameters` does: `register_parametrization` on each expert tensor (it failed for the old
    names with "attribute 'keys' already exists")."""

    class Doubled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    model = _model()
    expected = [2 * layer.mlp.experts.expert_keys.detach().clone() for layer in model.model.layers]
    for layer in model.model.layers:
        parametrize.register_parametrization(layer.mlp.experts, "expert_keys", Doubled())
        parametrize.register_parametrization(layer.mlp.experts, "expert_values", Doubled())
    for layer, keys in zip(model.model.layers, expected):
        assert torch.equal(layer.mlp.experts.expert_keys, keys)
        assert torch.equal(layer.mlp.experts.up_proj, keys)  # Transformers' experts name
    assert torch.isfinite(logits_of(model, IDS)).all()


CLEAN_SCRIPT = """
import importlib.util, json, sys
import torch
from transformers import AutoModelForCausalLM
assert importlib.util.find_spec("switchhead") is None, "switchhead must not be importable here"
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    print(json.dumps(model(input_ids=torch.tensor(json.loads(sys.argv[2])), use_cache=False).logits.tolist()))
"""


@pytest.mark.integration
def test_folder_under_old_names_loads_with_its_own_code_without_the_package(tmp_path):
    model = _model()
    _save_under_old_names(model, tmp_path / "old")  # today's code copied beside the weights
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "VIRTUAL_ENV"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    result = run_checked([str(clean_venv()), "-c", CLEAN_SCRIPT, str(tmp_path / "old"), str(IDS.tolist())],
                         env=env, cwd=tmp_path)
    logits = torch.tensor(json.loads(result.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(logits, logits_of(model, IDS), rtol=0, atol=1e-6)
