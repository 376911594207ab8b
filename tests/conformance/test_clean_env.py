"""A folder saved by this package loads with `trust_remote_code=True` where only torch, transformers and safetensors
are installed, generates, and gives the logits this package gives.

The fresh virtual environment (python -m venv, no system site-packages) gets torch==2.13.0 (the local CPU wheel),
transformers==<the installed version> and safetensors from the package registry. It is cached in
~/.cache/switchhead/clean-venv-<torch>-<transformers> (a `.complete` marker is written last, under a file lock, so a
half-built environment is rebuilt, never used); from scratch it takes a minute or two.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

from helpers.clean_venv import clean_venv, run_checked
from helpers.hub_folder import save_hub_folder

PROMPT_IDS = [[464, 3616, 286, 1204, 318, 257], [50256, 50256, 7454, 2402, 257, 640]]
PROMPT_MASK = [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]]  # the second prompt is left-padded

# Runs inside the clean environment: load with trust_remote_code, forward, generate; print JSON.
CLEAN_SCRIPT = textwrap.dedent("""
    import importlib.util, json, sys
    import torch
    from transformers import AutoModelForCausalLM, pipeline
    assert importlib.util.find_spec("switchhead") is None, "switchhead must not be importable here"
    folder, ids, mask = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    text = pipeline("text-generation", model=folder, trust_remote_code=True)(
        "The meaning of life is", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    print(json.dumps({"module": type(model).__module__, "class": type(model).__name__,
                      "logits": logits.tolist(), "generated": generated.tolist(), "text": text}))
""")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clean-env-folder")
    model = save_hub_folder(folder, preset="tiny-switchall")
    ids, mask = torch.tensor(PROMPT_IDS), torch.tensor(PROMPT_MASK)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    return folder, logits, generated


@pytest.mark.integration
def test_trust_remote_code_load_in_clean_venv_matches_package(saved, tmp_path):
    folder, logits, generated = saved
    python = clean_venv()
    # a clean process too: no PYTHONPATH, a fresh module cache for the copied code, offline Hub, run away from
    # the repository so that nothing of this checkout is importable
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "HF_", "VIRTUAL_ENV"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = run_checked([str(python), "-c", CLEAN_SCRIPT, str(folder), json.dumps(PROMPT_IDS), json.dumps(PROMPT_MASK)],
                  env=env, cwd=tmp_path)
    out = json.loads(result.stdout.strip().splitlines()[-1])

    assert out["class"] == "SwitchHeadForCausalLM"
    assert out["module"].startswith("transformers_modules."), out["module"]  # the folder's copy of our code
    clean_logits = torch.tensor(out["logits"])
    # the padded positions of row 2 are excluded: their values are arbitrary in any implementation
    torch.testing.assert_close(clean_logits[0], logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(clean_logits[1, 2:], logits[1, 2:], rtol=1e-5, atol=1e-5)
    assert out["generated"] == generated.tolist()
    assert out["text"].startswith("The meaning of life is") and len(out["text"]) > len("The meaning of life is")
