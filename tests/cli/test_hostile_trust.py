"""Code from a model folder never runs without `--trust-remote-code` (`switchhead.integrity.trust`).

Every hostile folder here holds Python files that write a marker file when imported. Every command that loads a
folder is run in process with stdin answering "y" (what Transformers' remote-code prompt would read): each must
exit 2 with one stderr line, and the marker must never appear. The folder check is then bypassed to show that the
Transformers calls themselves get `trust_remote_code=False` (no prompt, no code) as a second line of defence.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.hub_folder import save_hub_folder
from helpers.server import free_port

from switchhead.cli import main
from switchhead.integrity import RemoteCodeRefused, UnloadableModel, check_remote_code, check_saved_model
from switchhead.integrity.trust import remote_code

REFUSAL = "asks to run its own code"

EVIL = """\
import pathlib
pathlib.Path({marker!r}).write_text("code from the model folder ran")
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast


class EvilConfig(PretrainedConfig):
    model_type = "evilnet"


class EvilModel(PreTrainedModel):
    config_class = EvilConfig


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """Our own tiny model with its tokenizer and copied model code (config.json has our `auto_map`)."""
    folder = tmp_path_factory.mktemp("ours") / "model"
    save_hub_folder(folder, "tiny-switchhead")
    return folder


def plant(folder: Path, marker: Path, module: str = "evil") -> None:
    (folder / f"{module}.py").write_text(EVIL.format(marker=str(marker)))


def edit_json(path: Path, **fields) -> None:
    value = json.loads(path.read_text()) if path.exists() else {}
    value.update(fields)
    path.write_text(json.dumps(value))


def hostile(ours: Path, tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A copy of our folder made hostile `how`; returns (folder, marker)."""
    folder, marker = tmp_path / "model", tmp_path / "marker"
    shutil.copytree(ours, folder)
    plant(folder, marker)
    if how == "foreign-config":
        edit_json(folder / "config.json", model_type="evilnet",
                  auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    elif how == "tokenizer-config":
        edit_json(folder / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    elif how == "tokenizer-in-config":  # AutoTokenizer reads config.json's auto_map when the tokenizer has none
        config = json.loads((folder / "config.json").read_text())
        config["auto_map"]["AutoTokenizer"] = ["evil.EvilTokenizer", None]
        (folder / "config.json").write_text(json.dumps(config))
    elif how == "custom-generate":
        (folder / "custom_generate").mkdir()
        plant(folder / "custom_generate", marker, "generate")
    else:
        raise AssertionError(how)
    return folder, marker


HOW = ["foreign-config", "tokenizer-config", "tokenizer-in-config", "custom-generate"]


def commands(folder: Path, tmp_path: Path) -> dict[str, list[str]]:
    text = tmp_path / "text.txt"
    text.write_text("a small boat sails across the quiet bay.\n" * 40)
    return {
        "generate": ["generate", str(folder), "--max-new-tokens", "2"],
        "eval": ["eval", str(folder), "--perplexity", str(text)],
        "eval-lm-eval": ["eval", str(folder), "--tasks", "switchhead_lambada", "--limit", "1"],
        "export": ["export", str(folder), str(tmp_path / "out.onnx")],
        "serve": ["serve", str(folder), "--port", str(free_port())],
        "finetune": ["finetune", str(folder), "--data", str(text), "--output-dir", str(tmp_path / "adapter"),
                     "--max-steps", "1"],
        "card": ["card", str(folder), "--output", "-"],
        "upcycle": ["upcycle", str(folder), str(tmp_path / "upcycled"), "--heads", "1", "--experts", "2", "--k", "1"],
        "convert": ["convert", "hf-to-authors", str(folder), str(tmp_path / "authors.pth")],
        "train": ["train", "--preset", "tiny-switchhead", "--tokenizer", str(folder), "--data", str(text),
                  "--output-dir", str(tmp_path / "run"), "--max-steps", "1"],
    }


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"switchhead {command}: error: "), err
    return lines[0]


@pytest.mark.parametrize("how", HOW)
def test_no_command_runs_a_folders_code_even_when_stdin_answers_yes(ours, tmp_path, capsys, monkeypatch, how):
    folder, marker = hostile(ours, tmp_path, how)
    argvs = commands(folder, tmp_path)
    if how == "foreign-config":
        del argvs["train"]  # train reads only the tokenizer of the folder: the config.json case is not its input
    capsys.readouterr()
    for name, argv in argvs.items():
        monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
        assert main(argv) == 2, (how, name)
        line = one_line(capsys, argv[0])
        if how == "foreign-config" and name == "upcycle":
            assert "'evilnet'" in line, line  # it reads config.json itself and takes only our model types first
        else:
            assert REFUSAL in line and "--trust-remote-code" in line, (how, name, line)
        assert not marker.exists(), (how, name)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["model", "text.txt"], left  # nothing written either


@pytest.mark.parametrize("how", ["foreign-config", "tokenizer-config"])
def test_the_transformers_calls_get_false_even_if_the_folder_check_is_bypassed(ours, tmp_path, capsys, monkeypatch,
                                                                               how):
    """Second line of defence: with `check_remote_code` made to pass, every from_pretrained still gets
    trust_remote_code=False, so Transformers refuses (never prompts) and the code does not run."""
    import switchhead.integrity as integrity
    import switchhead.integrity.loading as loading

    folder, marker = hostile(ours, tmp_path, how)
    monkeypatch.setattr(loading, "check_remote_code", lambda folder, trust=False: trust)
    monkeypatch.setattr(integrity, "check_remote_code", lambda folder, trust=False: trust)
    capsys.readouterr()
    for argv in (["generate", str(folder), "--max-new-tokens", "2"],
                 ["eval", str(folder), "--perplexity", str(folder / "evil.py")],
                 ["export", str(folder), str(tmp_path / "out.onnx")]):
        if how == "tokenizer-config" and argv[0] == "export":
            continue  # export reads no tokenizer
        monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
        main(argv)
        capsys.readouterr()
        assert not marker.exists(), (how, argv[0])


@pytest.mark.integration
def test_lm_eval_is_built_with_the_commands_decision(ours, tmp_path, monkeypatch):
    """evaluation.zero_shot.run_lm_eval passes `trust_remote_code` to lm-eval as given (False unless asked), and
    `eval` gives it the user's --trust-remote-code."""
    from switchhead.evaluation import zero_shot

    built = []

    class Stop(Exception):
        pass

    class Recorder:
        def __init__(self, **arguments):
            built.append((arguments["pretrained"], arguments["trust_remote_code"]))
            raise Stop

    monkeypatch.setattr(zero_shot, "_one_bar_hflm_class", lambda: Recorder)
    for trust in (False, True):
        with pytest.raises(Stop):
            zero_shot.run_lm_eval(str(ours), ["switchhead_lambada"], trust_remote_code=trust)
    assert built == [(str(ours), False), (str(ours), True)]
    with pytest.raises(TypeError):
        zero_shot.run_lm_eval(str(ours), ["switchhead_lambada"], trust_remote_code=None)  # None would prompt

    seen = []
    monkeypatch.setattr(zero_shot, "run_lm_eval", lambda *args, **kwargs: seen.append(kwargs["trust_remote_code"])
                        or {"results": {}})
    monkeypatch.setattr(zero_shot, "summarize", lambda results: {})
    assert main(["eval", str(ours), "--tasks", "switchhead_lambada", "--limit", "1"]) == 0
    assert main(["eval", str(ours), "--tasks", "switchhead_lambada", "--limit", "1", "--trust-remote-code"]) == 0
    assert seen == [False, True]


def test_our_own_folder_loads_without_and_with_trust_remote_code(ours, capsys):
    """Our folders carry an auto_map, yet `import switchhead` registers the type: no opt-in needed, and the opt-in
    changes nothing for them (the same greedy text)."""
    assert remote_code(str(ours)) == []
    assert main(["generate", str(ours), "--max-new-tokens", "3", "--prompt", "Hello"]) == 0
    without = capsys.readouterr().out
    assert main(["generate", str(ours), "--max-new-tokens", "3", "--prompt", "Hello", "--trust-remote-code"]) == 0
    with_code = capsys.readouterr().out
    assert without == with_code and without.startswith("Hello")


def test_trust_remote_code_is_what_lets_the_folders_code_run(ours, tmp_path):
    """The opt-in is the only switch: with it the check passes the folder on (and a remote config loads with the
    folder's code), without it the same folder is refused."""
    folder, marker = hostile(ours, tmp_path, "foreign-config")
    with pytest.raises(RemoteCodeRefused):
        check_remote_code(str(folder), False)
    assert check_remote_code(str(folder), True) is True
    assert not marker.exists()
    from switchhead.integrity.loading import read_config

    read_config(str(folder), True)
    assert marker.exists()


@pytest.mark.parametrize("value", [None, "yes", 1, 0])
def test_the_decision_is_a_bool_never_none(ours, value):
    with pytest.raises(TypeError):
        check_remote_code(str(ours), value)


# --------------------------------------------------------------------------- what counts as the folder's own code
@pytest.mark.parametrize("name", ["generation_config.json", "processor_config.json", "preprocessor_config.json",
                                  "feature_extractor_config.json", "image_processor_config.json"])
def test_an_auto_map_in_any_config_file_is_refused(ours, tmp_path, name):
    folder = tmp_path / "model"
    shutil.copytree(ours, folder)
    edit_json(folder / name, auto_map={"AutoProcessor": "evil.EvilProcessor"})
    with pytest.raises(UnloadableModel, match=f"{REFUSAL} \\({name}: evil.EvilProcessor\\)"):
        check_saved_model(str(folder), verify=False)


@pytest.mark.parametrize("auto_map,refused", [
    ({"AutoConfig": "evil.C", "AutoModel": "evil.M"}, False),  # our registered type: Transformers uses our classes
    ({"AutoModelForSequenceClassification": "evil.M"}, False),
    ({"AutoTokenizer": "evil.T"}, True),  # a tokenizer class is the folder's even under our model type
    ({"AutoProcessor": "evil.P"}, True),
    ("evil.Everything", True),  # not an object: what it names cannot be told
    (["evil.A"], True),
], ids=["model-classes", "task-head", "tokenizer", "processor", "string", "list"])
def test_config_auto_maps_under_our_model_type(ours, tmp_path, auto_map, refused):
    folder = tmp_path / "model"
    shutil.copytree(ours, folder)
    edit_json(folder / "config.json", auto_map=auto_map)
    assert bool(remote_code(str(folder))) is refused


@pytest.mark.parametrize("model_type", ["evilnet", None, 7, ""])
def test_config_auto_map_of_a_type_without_a_local_class_is_refused(ours, tmp_path, model_type):
    folder = tmp_path / "model"
    shutil.copytree(ours, folder)
    config = json.loads((folder / "config.json").read_text())
    if model_type is None:
        del config["model_type"]
    else:
        config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    assert remote_code(str(folder)) and remote_code(str(folder))[0].startswith("config.json: ")
    with pytest.raises(RemoteCodeRefused, match=REFUSAL):
        check_remote_code(str(folder))


def test_a_tokenizer_folder_with_its_own_class_is_refused_by_train(ours, tmp_path):
    from switchhead.training.data import load_tokenizer

    folder, marker = hostile(ours, tmp_path, "tokenizer-config")
    with pytest.raises(RemoteCodeRefused, match=REFUSAL):
        load_tokenizer(str(folder))
    assert not marker.exists()
    assert load_tokenizer(str(ours)) is not None  # our own tokenizer folder loads


def test_unreadable_side_files_do_not_hide_an_auto_map_elsewhere(ours, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(ours, folder)
    (folder / "generation_config.json").write_text("[" * 100000)  # too deep for json: left to its own loader
    (folder / "processor_config.json").write_text("[1, 2]")
    assert remote_code(str(folder)) == []
    edit_json(folder / "preprocessor_config.json", auto_map={"AutoImageProcessor": "evil.P"})
    assert remote_code(str(folder)) == ["preprocessor_config.json: evil.P"]


@pytest.mark.integration
@pytest.mark.parametrize("how", ["foreign-config", "tokenizer-config"])
def test_the_console_command_with_yes_on_stdin_runs_nothing(ours, tmp_path, how):
    """As a user runs it: `python -m switchhead.cli generate DIR` with "y" piped in, Transformers' prompt timer on."""
    folder, marker = hostile(ours, tmp_path, how)
    for argv in (["generate", str(folder), "--max-new-tokens", "2"], ["eval", str(folder), "--tasks",
                                                                       "switchhead_lambada", "--limit", "1"]):
        done = subprocess.run([sys.executable, "-m", "switchhead.cli", *argv], input="y\ny\ny\n", text=True,
                              capture_output=True, timeout=300)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and REFUSAL in lines[0], done.stderr
        assert not marker.exists()
