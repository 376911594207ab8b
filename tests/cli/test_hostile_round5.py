"""Hostile input, fifth round: checks that a name could step around, publish's inputs, and the last tracebacks.

- A model folder reaches lm-eval as one keyword argument, never inside lm-eval's comma-joined argument string: a
  folder named `m,pretrained=evil` or `m,peft=adp` is evaluated itself.
- A Hub repository id (from the local Hub cache) gets exactly the checks a folder gets, on its cached snapshot.
- The error contract (exit 2, one stderr line `switchhead CMD: error: ...`) for the inputs that ended in a
  traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.server import free_port

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM
from switchhead.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny model folder (config.json, model.safetensors, the copied model code)."""
    folder = tmp_path_factory.mktemp("saved") / "model"
    torch.manual_seed(0)
    SwitchHeadForCausalLM(SwitchHeadConfig.from_preset("tiny-switchhead")).save_pretrained(folder)
    return folder


def one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"switchhead {command}: error: "), err
    return lines[0]


def poison(folder: Path) -> None:
    """One NaN in the folder's weights."""
    tensors = load_file(folder / "model.safetensors")
    name = sorted(key for key, value in tensors.items() if value.is_floating_point())[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


# ============================================================================================= eval: lm-eval's string
@pytest.mark.parametrize("name", ["m,pretrained=evil", "m,peft=adp", "m,trust_remote_code=True"])
def test_a_folder_name_is_never_parsed_into_lm_eval_arguments(saved, tmp_path, monkeypatch, name):
    """lm-eval's HFLM gets the checked folder as `pretrained`, and no argument its name spells (another model, an
    adapter, trust in remote code)."""
    from lm_eval.models.huggingface import HFLM

    from switchhead.evaluation import zero_shot

    folder = tmp_path / name
    shutil.copytree(saved, folder)
    (tmp_path / "evil").mkdir()
    (tmp_path / "adp").mkdir()
    built = []

    class Stop(Exception):
        pass

    def record(self, **arguments):
        built.append(arguments)
        raise Stop

    monkeypatch.chdir(tmp_path)  # 'evil' and 'adp' resolve as relative folders, as a user's would
    monkeypatch.setattr(HFLM, "__init__", record)
    with pytest.raises(Stop):
        zero_shot.run_lm_eval(name, ["switchhead_lambada"])
    (arguments,) = built
    assert arguments["pretrained"] == name
    assert arguments.get("peft") is None and arguments["trust_remote_code"] is False


@pytest.mark.integration
def test_eval_of_a_folder_named_like_lm_eval_arguments_scores_that_folder(saved, tmp_path, monkeypatch, capsys):
    """End to end: `eval` of 'm,pretrained=evil' scores the checked folder (the same numbers as a plain name),
    whatever 'evil' holds."""
    plain, tricky = tmp_path / "plain", tmp_path / "m,pretrained=evil"
    shutil.copytree(saved, plain)
    shutil.copytree(saved, tricky)
    evil = tmp_path / "evil"
    shutil.copytree(saved, evil)
    poison(evil)
    monkeypatch.chdir(tmp_path)
    results = []
    for name in ("plain", "m,pretrained=evil"):
        assert main(["eval", name, "--tasks", "wikitext", "--limit", "1", "--output", f"{name}.json"]) == 0
        results.append(json.loads((tmp_path / f"{name}.json").read_text())["results"])
    capsys.readouterr()
    assert results[0] == results[1] and results[0]


# ============================================================================================= Hub ids
def cache_repo(cache: Path, repo_id: str, folder: Path) -> Path:
    """`folder` as the local Hub cache holds a downloaded repository: blobs named by hash, a snapshot of links to
    them, refs/main naming the snapshot. Returns the snapshot folder."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            blob = hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, root / "blobs" / blob)
            (snapshot / path.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    # `serve` of a Hub id switches the process to offline loading: undone after the test
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", huggingface_hub.constants.HF_HUB_OFFLINE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def serve_hub_id(repo_id: str, monkeypatch, *extra: str) -> tuple[int, list]:
    import switchhead.serving

    started = []
    monkeypatch.setattr(switchhead.serving, "serve", lambda checkpoint, **options: started.append(checkpoint))
    return main(["serve", repo_id, "--port", str(free_port()), *extra]), started


def test_a_cached_hub_repo_with_a_nan_weight_is_refused_like_a_folder(saved, hub_cache, tmp_path, monkeypatch,
                                                                      capsys):
    folder = tmp_path / "nan"
    shutil.copytree(saved, folder)
    poison(folder)
    cache_repo(hub_cache, "someone/nan-model", folder)
    code, started = serve_hub_id("someone/nan-model", monkeypatch)
    line = one_line(capsys, "serve")
    assert code == 2 and not started
    assert "'someone/nan-model'" in line and "NaN" in line and str(hub_cache) not in line, line


def test_a_cached_hub_repo_holding_only_a_pickle_is_one_line(saved, hub_cache, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copyfile(saved / "config.json", folder / "config.json")
    torch.save(load_file(saved / "model.safetensors"), folder / "pytorch_model.bin")
    cache_repo(hub_cache, "someone/pickled", folder)
    code, started = serve_hub_id("someone/pickled", monkeypatch)
    line = one_line(capsys, "serve")
    assert code == 2 and not started and "pytorch_model.bin" in line and "pickle" in line, line


def test_a_sound_cached_hub_repo_is_served_offline_from_the_snapshot_checked(saved, hub_cache, monkeypatch, capsys):
    import huggingface_hub.constants

    cache_repo(hub_cache, "someone/sound", saved)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    code, started = serve_hub_id("someone/sound", monkeypatch)
    assert code == 0 and started == ["someone/sound"], capsys.readouterr().err
    assert huggingface_hub.constants.HF_HUB_OFFLINE is True  # no newer revision can be fetched behind the checks


def test_a_hub_id_missing_from_the_cache_is_refused_not_fetched_unchecked(hub_cache, monkeypatch, capsys):
    code, started = serve_hub_id("someone/absent", monkeypatch)
    line = one_line(capsys, "serve")
    assert code == 2 and not started and "local Hub cache" in line and "hf download someone/absent" in line, line
