"""The command line answers at once: `import switchhead`, `switchhead --help`, `--version`, every subcommand's
--help and argument errors import neither torch nor the model stack nor an optional library (checked in sys.modules
of a fresh process, not timed: benchmarks/bench_startup.py times it), while `import switchhead` still registers the
model with the Auto classes and our experts functions with Transformers. A missing optional library is one line that
names the pip command that installs its extra where the package was installed from."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import switchhead

HEAVY = ("torch", "torch._dynamo", "transformers.modeling_utils", "switchhead.modeling_switchhead", "lm_eval",
         "fastapi", "uvicorn", "peft", "accelerate", "datasets", "triton", "onnx", "matplotlib", "tensorboard")
COMMANDS = [["--version"], ["--help"], ["nonsense"], ["eval", "--bogus"], ["train", "--steps", "x"]] + [
    [name, "--help"] for name in ("train", "finetune", "eval", "flops", "card", "publish", "convert", "upcycle",
                                  "export", "generate", "serve")]


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.integration
def test_import_and_every_help_and_argument_error_load_nothing_heavy():
    code = f"""
import contextlib, io, json, sys
import switchhead
loaded = {{"import": [m for m in {HEAVY!r} if m in sys.modules]}}
from switchhead.cli import main
for argv in {COMMANDS!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    loaded[" ".join(argv)] = [m for m in {HEAVY!r} if m in sys.modules]
print(json.dumps(loaded))
"""
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded == {name: [] for name in loaded} and len(loaded) == len(COMMANDS) + 1


@pytest.mark.integration
def test_import_still_registers_the_model_and_the_experts_functions():
    """Whichever comes first, `import switchhead` or Transformers' Auto classes, AutoConfig knows the model type,
    an Auto model class is built from a config, and "cvmm" is a Transformers experts function once its MoE
    integration loads."""
    check = """
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("switchhead", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                              vocab_size=64, intermediate_size=64)
model = AutoModelForCausalLM.from_config(config)
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
assert type(model).__name__ == "SwitchHeadForCausalLM" and "cvmm" in ALL_EXPERTS_FUNCTIONS
print("ok")
"""
    for first in ("import switchhead\n", "import transformers.models.auto\nimport switchhead\n"):
        result = _python(first + check)
        assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    from helpers.models import tiny_model

    folder = tmp_path_factory.mktemp("startup") / "model"
    tiny_model("tiny-switchhead").save_pretrained(folder)
    (folder.parent / "text.txt").write_text("a few words of text for a run that stops before it reads them\n" * 4)
    return folder


@pytest.mark.integration
@pytest.mark.parametrize("argv, missing, extra", [
    (["eval", "{model}", "--tasks", "lambada"], "lm_eval", "eval"),
    (["serve", "{model}"], "fastapi", "serve"),
    (["serve", "{model}"], "uvicorn", "serve"),
    (["finetune", "{model}", "--data", "{text}", "--output-dir", "{out}"], "peft", "peft"),
])
def test_a_missing_optional_library_is_one_line_naming_the_install_command(saved_model, tmp_path, argv, missing,
                                                                          extra):
    """Each subcommand run where one optional library it uses is missing (the module set to None in sys.modules,
    as an uninstalled one fails to import): exit 2 and one line naming the pip command of its extra."""
    argv = [a.format(model=saved_model, text=saved_model.parent / "text.txt", out=tmp_path / "out") for a in argv]
    code = (f"import sys\nsys.modules[{missing!r}] = None\nfrom switchhead.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    result = _python(code, *argv)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"switchhead {argv[0]}: error: "), result.stderr
    assert switchhead.install_command(extra) in result.stderr


class _Distribution:
    def __init__(self, direct_url):
        self.direct_url = direct_url

    def read_text(self, name):
        return None if self.direct_url is None else json.dumps(self.direct_url)


@pytest.mark.parametrize("direct_url, expected", [
    ({"url": "file:///src/switchhead", "dir_info": {"editable": True}}, 'pip install -e "/src/switchhead[serve]"'),
    ({"url": "file:///src/switchhead", "dir_info": {}}, 'pip install "/src/switchhead[serve]"'),
    (None, "pip install 'switchhead[serve]'"),  # from the package index
    ({"url": "https://example.org/switchhead-0.1.0.whl", "archive_info": {}}, "pip install 'switchhead[serve]'"),
])
def test_install_command_names_what_works_where_the_package_came_from(monkeypatch, direct_url, expected):
    monkeypatch.setattr(metadata, "distribution", lambda name: _Distribution(direct_url))
    assert switchhead.install_command("serve") == expected


def test_install_command_from_a_checkout_names_its_path_or_dot(monkeypatch, tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    url = {"url": checkout.as_uri(), "dir_info": {"editable": True}}
    monkeypatch.setattr(metadata, "distribution", lambda name: _Distribution(url))
    assert switchhead.install_command("eval") == f'pip install -e "{checkout}[eval]"'
    monkeypatch.chdir(checkout)
    assert switchhead.install_command("eval") == 'pip install -e ".[eval]"'

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)
    monkeypatch.setattr(metadata, "distribution", not_installed)  # imported from a checkout, not installed
    root = Path(switchhead.__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    assert switchhead.install_command("eval") == 'pip install -e ".[eval]"'
