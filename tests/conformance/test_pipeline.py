"""`pipeline("text-generation", model=DIR)` on a folder saved by this package, and what that folder holds.

The folder (tests/helpers/hub_folder.py) is what `push_to_hub` would upload: it must be complete without the Hub and
without this package (see tests/conformance/test_clean_env.py for the load in a fresh virtual environment).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, pipeline

import switchhead
from helpers.hub_folder import HUB_FILES, save_hub_folder
from switchhead import SwitchHeadForCausalLM


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hub-folder")
    model = save_hub_folder(folder, preset="tiny-switchall")
    return folder, model


def greedy_text(folder: Path, model, prompt: str, new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def test_text_generation_pipeline_matches_generate(hub_folder):
    folder, model = hub_folder
    generator = pipeline("text-generation", model=str(folder))
    assert isinstance(generator.model, SwitchHeadForCausalLM)
    prompt = "The meaning of life is"
    result = generator(prompt, max_new_tokens=8, do_sample=False)
    text = result[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt)
    assert text == greedy_text(folder, model, prompt, 8)


def test_pipeline_batched_prompts_match_one_by_one(hub_folder):
    folder, _ = hub_folder
    generator = pipeline("text-generation", model=str(folder))
    prompts = ["Hello", "A much longer prompt with several more words in it"]
    one_by_one = [generator(p, max_new_tokens=6, do_sample=False)[0]["generated_text"] for p in prompts]
    batched = generator(prompts, max_new_tokens=6, do_sample=False, batch_size=2)
    assert generator.tokenizer.padding_side == "left"  # decoder-only batching pads on the left
    assert [item[0]["generated_text"] for item in batched] == one_by_one


def test_pipeline_with_trust_remote_code_uses_the_folder_code(hub_folder):
    folder, model = hub_folder
    generator = pipeline("text-generation", model=str(folder), trust_remote_code=True)
    prompt = "Once upon a time"
    text = generator(prompt, max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text == greedy_text(folder, model, prompt, 5)


def test_folder_is_push_to_hub_ready(hub_folder):
    folder, model = hub_folder
    present = {p.name for p in folder.iterdir()}
    assert set(HUB_FILES) <= present, f"missing: {set(HUB_FILES) - present}"

    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "switchhead"
    assert config["architectures"] == ["SwitchHeadForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_switchhead.SwitchHeadConfig",
        "AutoModel": "modeling_switchhead.SwitchHeadModel",
        "AutoModelForCausalLM": "modeling_switchhead.SwitchHeadForCausalLM",
        "AutoModelForSequenceClassification": "modeling_switchhead.SwitchHeadForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_switchhead.SwitchHeadForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_switchhead.SwitchHeadForQuestionAnswering",
    }
    generation = GenerationConfig.from_pretrained(folder)
    assert generation.eos_token_id == generation.pad_token_id == 50256
    assert generation.max_new_tokens == 16

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.decode(tokenizer("SwitchHead attention").input_ids) == "SwitchHead attention"

    # the copied code is this package's code, and imports nothing a bare torch + transformers install lacks
    package = Path(switchhead.__file__).parent
    copied = sorted(path.name for path in folder.glob("*.py"))  # the model, its configuration and their siblings
    assert {"modeling_switchhead.py", "configuration_switchhead.py", "expert_ops.py", "positions.py",
            "tensor_parallel.py", "checkpoint_format.py", "transformers_compat.py", "routing.py",
            "model_io.py"} <= set(copied)
    for name in copied:
        assert (folder / name).read_text() == (package / name).read_text()
        tree = ast.parse((folder / name).read_text())
        # an import of this package inside `try: ... except ...:` is optional (the kernels, where it is installed)
        optional = {id(statement) for node in ast.walk(tree) if isinstance(node, ast.Try) and node.handlers
                    for statement in node.body if isinstance(statement, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if id(node) in optional and isinstance(node, ast.ImportFrom) and node.module == "switchhead":
                continue
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {"." if node.level else node.module.split(".")[0]}
            else:
                continue
            # packaging: a dependency of transformers, which the compatibility file reads versions with
            allowed = {"torch", "transformers", "packaging", ".", "__future__"} | set(sys.stdlib_module_names)
            assert roots <= allowed, f"{name} imports {roots - allowed}"


def test_saved_weights_reload_exactly(hub_folder):
    folder, model = hub_folder
    reloaded = SwitchHeadForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[464, 3616, 286, 1204, 318]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
