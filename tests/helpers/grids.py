"""What the grid tests share: loading an experiments/ script as a module (the folder is no package), and the small
WikiText-2 slice and environment a tiny run through a grid's driver uses."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from helpers.data import require

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_experiment(name: str):
    """experiments/`name`.py as a module, its folder on sys.path (the scripts import grid_driver and each other)."""
    sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_wikitext2(folder: Path, characters: int = 40_000) -> Path:
    """`folder`/data holding the first `characters` of each WikiText-2 split, as a grid's `--data` reads them."""
    wikitext2 = require("wikitext-2") / "wikitext-2"
    data = folder / "data"
    data.mkdir()
    for split in ("train", "valid", "test"):
        with open(wikitext2 / f"wiki.{split}.tokens", encoding="utf-8") as handle:
            (data / f"wiki.{split}.tokens").write_text(handle.read(characters), encoding="utf-8")
    return data


def run_environment() -> dict:
    """The environment of a grid run in a test: one thread, offline."""
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1")
