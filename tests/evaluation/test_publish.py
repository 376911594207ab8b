"""`switchhead publish` sends a Hub repository the model and nothing else: a real `switchhead train` folder (with
checkpoints, optimizer pickles, RNG states, logs and TensorBoard events) is published against a recording stand-in
for `huggingface_hub.HfApi`, and the exact set of files it receives is checked."""

import json
from pathlib import Path

import pytest

from switchhead.cli import main

# Code that `from_pretrained(..., trust_remote_code=True)` imports from a saved folder
CODE_FILES = {"configuration_switchhead.py", "modeling_switchhead.py", "expert_ops.py", "positions.py",
              "tensor_parallel.py", "checkpoint_format.py", "transformers_compat.py", "experts_integration.py",
              "routing.py", "model_io.py"}
ALLOWED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
           "README.md", *CODE_FILES}
FORBIDDEN_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz")


class RecordingHub:
    """What `HfApi` is asked to do, with the bytes of every uploaded file; it uploads nothing."""

    instances: list["RecordingHub"] = []

    def __init__(self, token=None):
        self.calls, self.files = [], {}
        RecordingHub.instances.append(self)

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def create_commit(self, *, operations, **kwargs):
        self.calls.append(("create_commit", kwargs))
        for operation in operations:
            source = operation.path_or_fileobj
            self.files[operation.path_in_repo] = source if isinstance(source, bytes) else \
                source.read() if hasattr(source, "read") else Path(source).read_bytes()

    def __getattr__(self, name):  # any other way of uploading (upload_folder, upload_file, ...) is a failure
        raise AssertionError(f"publish called HfApi.{name}")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished tiny `switchhead train` run with two checkpoints, its log and TensorBoard events."""
    folder = tmp_path_factory.mktemp("publish")
    text = folder / "text.txt"
    text.write_text("".join(f"Line {i} of a small corpus about lobsters and games.\n" for i in range(3000)))
    run = folder / "run"
    assert main(["train", "--vocab-size", "512", "--block-size", "32", "--batch-size", "8", "--max-steps", "4",
                 "--log-every", "1", "--eval-every", "2", "--eval-batches", "2", "--save-every", "2",
                 "--no-progress", "--report-to", "tensorboard", "--data", str(text), "--output-dir", str(run)]) == 0
    return run


def _publish(monkeypatch, run, *extra):
    import huggingface_hub

    RecordingHub.instances.clear()
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHub)
    assert main(["publish", str(run), "me/tiny-switchhead", *extra]) == 0
    [hub] = RecordingHub.instances
    return hub


def _is_pickle(data: bytes) -> bool:
    """A pickle stream (protocol 2+ starts with PROTO) or a zip archive (torch.save) holding one."""
    return data[:1] == b"\x80" or data[:2] == b"PK"


@pytest.mark.integration
def test_publish_uploads_only_the_model_tokenizer_code_and_card(trained_run, monkeypatch, capsys):
    every_file = {str(path.relative_to(trained_run)) for path in trained_run.rglob("*") if path.is_file()}
    # the run folder holds what must stay behind: the test is void unless it does
    assert any(name.startswith("checkpoints/") and name.endswith("optimizer.bin") for name in every_file)
    assert any("rng_state" in name for name in every_file) and "log.csv" in every_file
    assert any(name.startswith("tensorboard/") for name in every_file)

    hub = _publish(monkeypatch, trained_run)
    assert [name for name, _ in hub.calls] == ["create_repo", "create_commit"]  # one commit: all or nothing
    assert hub.calls[0][1]["repo_id"] == "me/tiny-switchhead"
    sent = set(hub.files)
    assert sent == ALLOWED
    for name, data in hub.files.items():
        assert "/" not in name and not name.endswith(FORBIDDEN_SUFFIXES), name
        assert name in CODE_FILES or not any(word in name for word in (
            "checkpoint", "optimizer", "rng", "xl_memory", "trainer_state", "events", "log.csv", "SHA256SUMS",
            "training_config")), name
        assert not _is_pickle(data), name
        if name != "README.md":
            assert data == (trained_run / name).read_bytes(), name  # the file as saved, unchanged
    card = hub.files["README.md"].decode()
    assert card.startswith("---\n") and "license: apache-2.0" in card
    # the published card keeps what the run's own card says about its training
    assert "Trained on `text.txt`" in card and "| max_steps | 4 |" in card and "### Training results" in card
    assert str(trained_run) not in card
    assert "uploading" in capsys.readouterr().out


@pytest.mark.integration
def test_publish_sends_evaluation_results_only_when_asked(trained_run, tmp_path, monkeypatch):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"results": {"switchhead_lambada": {"acc": 0.25}}, "limit": 4}))
    hub = _publish(monkeypatch, trained_run, "--results", str(results))
    assert set(hub.files) == ALLOWED and b"LAMBADA" in hub.files["README.md"]
    hub = _publish(monkeypatch, trained_run, "--results", str(results), "--upload-results")
    assert set(hub.files) == ALLOWED | {"eval_results.json"}
    assert hub.files["eval_results.json"] == results.read_bytes()


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

    folder = tmp_path_factory.mktemp("saved")
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead")).save_pretrained(folder)
    return folder


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def test_publish_files_leave_out_pickles_and_everything_not_named(saved_model, tmp_path):
    from switchhead.evaluation.card import publish_files

    folder = _copy(saved_model, tmp_path / "model")
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt", "state.pkl", "notes.txt", "helper.py"):
        (folder / name).write_bytes(b"\x80\x04N.")
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "model.safetensors").write_bytes(b"x")
    assert set(publish_files(folder)) == {"config.json", "generation_config.json", "model.safetensors", *CODE_FILES}


def test_publish_files_take_every_shard_of_an_index_and_refuse_a_missing_one(saved_model, tmp_path):
    from switchhead.evaluation.card import publish_files

    folder = _copy(saved_model, tmp_path / "model")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"} <= set(publish_files(folder))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="00002-of-00002"):
        publish_files(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(ValueError, match="elsewhere"):
        publish_files(folder)


def test_publish_refuses_a_linked_file_and_a_missing_code_file(saved_model, tmp_path, capsys):
    folder = _copy(saved_model, tmp_path / "model")
    (folder / "positions.py").unlink()  # imported by modeling_switchhead.py: the repository would not load
    assert main(["publish", str(folder), "me/x"]) == 2
    folder = _copy(saved_model, tmp_path / "linked")
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    assert main(["publish", str(folder), "me/x"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "positions.py" in errors[0] and "symbolic link" in errors[1]
    assert main(["publish", str(saved_model), "me/x", "--upload-results"]) == 2
    assert "--results" in capsys.readouterr().err


ROOT = Path(__file__).resolve().parents[2]


def test_licence_file_setup_metadata_and_card_default_agree():
    import ast

    from switchhead.model_card import PACKAGE_LICENSE, card_license

    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "Copyright 2026 The switchhead authors" in text
    [setup] = [node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
               if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"]
    keywords = {keyword.arg: keyword.value for keyword in setup.keywords}
    assert ast.literal_eval(keywords["license_expression"]) == PACKAGE_LICENSE == "Apache-2.0"
    assert ast.literal_eval(keywords["license_files"]) == ["LICENSE"]
    assert card_license() == "apache-2.0" and card_license("MIT") == "mit"
    build = (ROOT / "pyproject.toml").read_text()
    assert "[build-system]" in build and "setuptools.build_meta" in build and "[project]" not in build


def test_shipped_files_cite_no_notes_outside_the_package():
    """PAPER.md is not shipped: the package, its Hub code, card template and docs point to docs pages instead."""
    folders = ["modeling_switchhead", "kernels", "integrity", "training", "evaluation", "conversion", "serving",
               "vllm_plugin", "cli", "docs"]
    cited = [str(path.relative_to(ROOT)) for folder in folders for path in (ROOT / folder).rglob("*")
             if path.suffix in (".py", ".md", ".yaml", ".jinja", ".txt") and path.is_file()
             and "PAPER.md" in path.read_text(encoding="utf-8", errors="replace")]
    assert cited == []
