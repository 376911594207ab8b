"""Checkpoints saved before the redesign (one modeling file, commit 28ce4f7) load and give that code's
logits and greedy tokens: with this package (its classes), with the folder's own copied code next to this package
(trust_remote_code=True, where the old code imports today's `switchhead.kernels`), and in a clean environment.

The folders are tests/fixtures/pre_redesign/<variant> (config, fp16 weights, expected.safetensors) plus the model
files that save_pretrained copied, kept once as code.tar.gz (a snapshot of 28ce4f7's files, not code we maintain);
make.py there says how they were made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from switchhead import SwitchHeadForCausalLM
from helpers.clean_venv import clean_venv

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pre_redesign"
VARIANTS = ("switchhead", "switchall", "switchhead_xl", "dense_gate", "value_only")


def saved_folder(variant: str, destination: Path) -> Path:
    """The variant's folder as save_pretrained wrote it: its own files plus the copied model code."""
    folder = destination / variant
    shutil.copytree(FIXTURES / variant, folder)
    with tarfile.open(FIXTURES / "code.tar.gz") as archive:
        archive.extractall(folder, filter="data")
    return folder


def check_outputs(model, expected: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        logits = model(expected["input_ids"], use_cache=False).logits
        greedy = model.generate(expected["input_ids"][:1], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
    assert greedy.tolist() == expected["greedy"].tolist()


@pytest.mark.parametrize("variant", VARIANTS)
def test_pre_redesign_checkpoint_loads_with_the_package(variant, tmp_path):
    folder = saved_folder(variant, tmp_path)
    model, info = SwitchHeadForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # every saved key is a parameter of today's model and vice versa
    assert type(model).__module__ == "switchhead.modeling_switchhead"
    check_outputs(model.eval(), load_file(folder / "expected.safetensors"))


@pytest.mark.parametrize("variant", ["switchhead", "switchall", "switchhead_xl"])
def test_pre_redesign_checkpoint_runs_its_own_code_beside_the_package(variant, tmp_path):
    folder = saved_folder(variant, tmp_path)
    # the registered package classes take precedence in from_pretrained, so the folder's class is loaded directly
    remote = get_class_from_dynamic_module("modeling_switchhead.SwitchHeadForCausalLM", folder)
    model = remote.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
    check_outputs(model.eval(), load_file(folder / "expected.safetensors"))


CLEAN_SCRIPT = """
import importlib.util, json, sys
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
assert importlib.util.find_spec("switchhead") is None, "switchhead must not be importable here"
folder = sys.argv[1]
expected = load_file(folder + "/expected.safetensors")
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(expected["input_ids"], use_cache=False).logits
print(json.dumps({"error": (logits - expected["logits"]).abs().max().item(), "module": type(model).__module__}))
"""


@pytest.mark.integration
def test_pre_redesign_checkpoint_loads_in_a_clean_environment(tmp_path):
    folder = saved_folder("switchall", tmp_path)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "VIRTUAL_ENV"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    result = subprocess.run([str(clean_venv()), "-c", CLEAN_SCRIPT, str(folder)], capture_output=True, text=True,
                            env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["module"].startswith("transformers_modules.")
    assert out["error"] <= 1e-5
